"""Data parallelism: ``data_parallel_size`` engine replicas, each a whole LLMEngine (holding the
model, or its tensor/pipeline-parallel split), behind a front in the user's process that answers
the engine's calls (what LLM and AsyncLLM use). The replicas are spawned processes of this node,
or with ``data_parallel_backend="ray"`` Ray actors on a cluster's nodes (engine/dp_ray.py); the
front reaches either through the same few calls (``Replicas``). A request goes to the replica
with the fewest sequences in flight, all its samples with it (they share the prompt's KV
blocks); its seed travels with it, so outputs do not depend on the replica count.
The replicas step on their own, not in lock step: step() starts a step on every busy replica
that is not stepping yet and returns the outputs of those that have finished one, waiting only
until one has, so a replica in a long prefill step does not hold back the others' decodes."""
import itertools
from multiprocessing.connection import wait
from typing import Protocol

from pagoda.config import EngineConfig
from pagoda.distributed.child_procs import SPAWN_HINT, ChildProcs
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.dp_replica import replica_env, replica_main
from pagoda.engine.profiler import profiler_dir
from pagoda.engine.stats import EngineStats, sum_stats
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


def _step_if_busy(engine) -> list[RequestOutput]:
    return engine.step() if engine.has_unfinished_requests() else []


def _take_inter_token_latencies(engine) -> list[float]:
    return engine.take_inter_token_latencies()


def _stats(engine) -> EngineStats:
    return engine.stats


def _eos_token_id(engine) -> int | None:
    return engine.eos_token_id


def _collective_rpc(engine, method, args: tuple, kwargs: dict | None) -> list:
    return engine.collective_rpc(method, args, kwargs)


class Replicas(Protocol):
    """The front's way to its replicas, started with their engines built (a replica's error at
    start-up raises from the constructor, every replica stopped). A replica answers its calls
    in the order they were sent. A call that raised in a replica raises in the caller and the
    replicas go on; a replica that died is an error, and stops the others; then ``dead`` says
    why, and later calls raise at once (StopsOnFailure)."""
    dead: str | None

    def send(self, method, args: tuple, only: list[int] | None = None) -> None:
        """Queue ``method`` (an LLMEngine method's name, or a function taking the engine
        first) with ``args`` on every replica, or on those numbered in ``only``; no waiting."""

    def replies(self, only: list[int] | None = None) -> list:
        """Each replica's (or each of ``only``'s) answer to its oldest call not yet answered,
        waiting for it."""

    def ready(self, only: list[int]) -> list[int]:
        """Those of ``only`` whose oldest call has its answer (or that died), waiting until
        one has."""

    def shutdown(self) -> None:
        ...


class PipeReplicas(ChildProcs):
    """The replicas as spawned processes of this node, each behind a pipe (replica_main)."""
    child_name = "data parallel replica"
    first_id = 0
    # A replica spawns its own tensor-parallel workers. Not daemonic, it is still ended at exit:
    # by the front's finalizer, or by its pipe's end when the front is killed.
    daemon = False

    def __init__(self, args: EngineArgs, config: EngineConfig):
        dp, ranks = config.parallel.data_parallel_size, config.parallel.world_size
        try:
            gpus = (lambda d: replica_env(d, dp, ranks)) if config.device == "cuda" else None
            self._start_children(replica_main, lambda d: (args, d, dp), dp, gpus)
            self._replies(SPAWN_HINT)      # every replica past its imports
            self._replies()                # every engine built (a ValueError of one raises here)
        except BaseException:
            self.shutdown()
            raise

    def send(self, method, args: tuple, only: list[int] | None = None) -> None:
        self._send((method, args), only)

    def replies(self, only: list[int] | None = None) -> list:
        return self._replies(only=only)

    def ready(self, only: list[int]) -> list[int]:
        children = self._children(only)
        done = wait([c for _, conn, p in children for c in (conn, p.sentinel)])
        return [d for d, conn, p in children if conn in done or p.sentinel in done]


class DPEngine:
    def __init__(self, args: EngineArgs, config: EngineConfig, tokenizer: Tokenizer | None):
        self.config = config
        self.tokenizer = tokenizer
        self.async_scheduling = config.scheduler.async_scheduling
        dp = config.parallel.data_parallel_size
        self._ids = itertools.count()
        self._owner: dict[str, tuple[int, int]] = {}   # request id -> (its replica, its samples)
        self._load = [0] * dp                          # sequences in flight, per replica
        self._stepping: set[int] = set()               # replicas with a step under way
        self._outputs: list[RequestOutput] = []        # of steps finished, not yet returned by step()
        if config.parallel.data_parallel_backend == "ray":
            from pagoda.engine.dp_ray import RayReplicas     # (Ray is imported only for it)
            self.replicas: Replicas = RayReplicas(args, config)
        else:
            self.replicas = PipeReplicas(args, config)
        try:
            self.eos_token_id = self._call(0, _eos_token_id)
        except BaseException:
            self.shutdown()
            raise

    @property
    def dead(self) -> str | None:
        return self.replicas.dead

    def shutdown(self) -> None:
        self.replicas.shutdown()

    def _call(self, replica: int, method, *args):
        self._finish_steps([replica])
        self.replicas.send(method, args, [replica])
        return self.replicas.replies([replica])[0]

    def _call_all(self, method, *args) -> list:
        self._finish_steps(range(len(self._load)))
        self.replicas.send(method, args)
        return self.replicas.replies()

    def _finish_steps(self, replicas) -> None:
        """The outputs of the steps under way on ``replicas``, waited for (a replica answers
        in order: its step first) and kept for step() to return."""
        for d in sorted(self._stepping.intersection(replicas)):
            self._stepping.discard(d)
            for out in self.replicas.replies([d])[0]:
                if out.request_id not in self._owner:      # aborted while the step ran
                    continue
                if out.finished:
                    self._forget(out.request_id)
                self._outputs.append(out)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt, params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue the request on the least-loaded replica; a bad one raises its ValueError here
        and leaves that replica as it was."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._owner:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        replica = min(range(len(self._load)), key=self._load.__getitem__)
        self._call(replica, "add_request", request_id, prompt, params, arrival_time, priority, lora_request)
        n = getattr(params, "n", 1)           # (PoolingParams: one sequence)
        self._owner[request_id] = replica, n
        self._load[replica] += n
        return request_id

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._owner:
                by_replica.setdefault(self._owner[rid][0], []).append(rid)
                self._forget(rid)
        if self.dead is not None:     # (the caller cleans up after a failure: nothing to tell)
            return
        for replica, rids in by_replica.items():
            self._call(replica, "abort_request", rids)

    def _forget(self, request_id: str) -> None:
        replica, n = self._owner.pop(request_id)
        self._load[replica] -= n

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner or self._outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self._owner)

    def prompt_token_ids(self, prompt) -> list[int]:
        return self._call(0, "prompt_token_ids", prompt)

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Checked by every replica (any of them may get its requests)."""
        return all(self._call_all("add_lora", lora_request))

    def remove_lora(self, lora_id: int) -> bool:
        return any(self._call_all("remove_lora", lora_id))

    def list_loras(self) -> set[int]:
        return set().union(*self._call_all("list_loras"))

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        """Start a step on each replica with requests that is not stepping yet, then return the
        outputs of every step that has finished, waiting until one has if none has yet."""
        start = [d for d, load in enumerate(self._load) if load and d not in self._stepping]
        self.replicas.send(_step_if_busy, (), start)     # (with none to start: raises if stopped)
        self._stepping.update(start)
        if self._stepping and not self._outputs:
            self._finish_steps(self.replicas.ready(sorted(self._stepping)))
        outputs, self._outputs = self._outputs, []
        return outputs

    def take_inter_token_latencies(self) -> list[float]:
        return [x for latencies in self._call_all(_take_inter_token_latencies) for x in latencies]

    def reset_prefix_cache(self) -> bool:
        return all(self._call_all("reset_prefix_cache"))

    def sleep(self, level: int = 1) -> None:
        self._call_all("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call_all("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(self._call_all("is_sleeping"))

    def start_profile(self, directory: str | None = None) -> None:
        self._call_all("start_profile", directory or profiler_dir())

    def stop_profile(self) -> None:
        self._call_all("stop_profile")

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """LLMEngine.collective_rpc on every replica: their ranks' results, replica by replica."""
        return [r for replica in self._call_all(_collective_rpc, method, args, kwargs) for r in replica]

    @property
    def stats(self) -> EngineStats:
        """The replicas' figures summed (replica_stats() has each one's)."""
        return sum_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        return self._call_all(_stats)
