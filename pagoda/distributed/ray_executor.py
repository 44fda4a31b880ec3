"""Tensor and pipeline parallelism over the nodes of a Ray cluster. As with MultiprocExecutor,
rank 0 is the engine's own process (it schedules; it samples too, unless the last pipeline
stage does); ranks 1..N-1 are Ray actors, one per bundle of a placement group that holds a GPU
(a CPU on the CPU) per rank, bundle 0 on this node for rank 0. Each step's SchedulerOutput is
put in Ray's object store once and every actor is handed its reference without waiting: Ray
runs one caller's calls on an actor in order, and the ranks meet only in torch.distributed's
collectives, at rank 0's node's address. A failed actor is noticed at the next step.

Ray is joined where it runs (``ray start`` / RAY_ADDRESS), else started on this node for this
process's life: it is left running for the next engine, and Ray ends it at exit. The engine
does shut down what it made: its actors and its placement group."""
import os
import re
import weakref

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagoda.config import EngineConfig
from pagoda.core.sched_output import SchedulerOutput
from pagoda.distributed.child_procs import ERROR_GRACE_S, StopsOnFailure, WorkerFailed
from pagoda.distributed.executor import ParallelExecutor, split_masks
from pagoda.distributed.parallel_state import check_no_process_group, destroy_distributed, rendezvous_store
from pagoda.distributed.worker import COLLECTIVE_TIMEOUT_S, Worker

# How long the cluster has to find the ranks' GPUs (or CPUs) and start their actors.
START_TIMEOUT_S = 300


@ray.remote(max_restarts=0)
class RayWorker:
    """Rank 1..N-1. A call that fails leaves the process group first: a peer waiting on this
    rank in a collective then fails at once, not at the collectives' timeout."""

    def __init__(self):
        self.worker = None

    def node(self) -> tuple[str, list[str]]:
        """This actor's node address and the GPUs Ray gave it."""
        return ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def start(self, config: EngineConfig, rank: int, host: str, port: int) -> None:
        def build():
            self.worker = Worker(config, rank, port, host, local_gpu(self.node()[1]))
        self._run(build)

    def execute_model(self, sched: SchedulerOutput) -> None:
        self._run(self.worker.execute_model, sched)

    def call(self, method, args: tuple):
        return self._run(self.worker.call, method, args)

    def _run(self, fn, *args):
        try:
            return fn(*args)
        except BaseException:
            destroy_distributed()
            raise


def local_gpu(ray_gpu_ids: list[str]) -> int | None:
    """This process's CUDA index of the GPU Ray gave (the first): an actor sees that one alone
    (cuda:0), as Ray sets its CUDA_VISIBLE_DEVICES; in the engine's process (or where Ray was
    told not to set it) it is that id's place among the visible ones."""
    if not ray_gpu_ids:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return int(ray_gpu_ids[0])
    if ray_gpu_ids[0] not in visible.split(","):
        raise RuntimeError(f"Ray gave rank 0 GPU {ray_gpu_ids[0]}, which this process does not see "
                           f"(CUDA_VISIBLE_DEVICES={visible}): start Ray on this node with the same GPUs visible.")
    return visible.split(",").index(ray_gpu_ids[0])


def _shutdown(actors: list, pg, num_threads: int) -> None:
    """Kill the actors, free their placement group, leave the process group, and give this
    process back the threads it gave up. A plain function over plain values: the finalizer
    that calls it must not keep the executor alive."""
    destroy_distributed()
    if ray.is_initialized():      # (at exit Ray may have shut down first: the actors went with it)
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(pg)
    torch.set_num_threads(num_threads)


def _connect(world: int, device: str) -> None:
    """Join the cluster of RAY_ADDRESS or of `ray start` on this node, else start one here."""
    if ray.is_initialized():
        return
    if device == "cpu":
        # One started here counts a CPU per rank at least: the ranks share the cores (as over
        # processes). Ray refuses num_cpus when it would join a cluster instead.
        try:
            ray.init(num_cpus=max(os.cpu_count() or 1, world))
            return
        except ValueError:
            pass
    ray.init()


def check_cluster_has(kind: str, count: int, need: str) -> None:
    """A ValueError at once (``need``, and what the cluster has) where the whole cluster has
    fewer than ``count`` of ``kind``, rather than actors that wait for good."""
    have = ray.cluster_resources().get(kind, 0)
    if have < count:
        raise ValueError(f"{need}, but it has {have:g}. Add nodes (ray start --address=...)"
                         + (", or count more CPUs (ray start --num-cpus, ray.init(num_cpus=...))."
                            if kind == "CPU" else "."))


def _placement_group(world: int, device: str, host: str):
    """A bundle per rank, bundle 0 on this node (rank 0 is this process); PACK keeps the
    ranks on as few nodes as they fit on."""
    kind = "GPU" if device == "cuda" else "CPU"
    check_cluster_has(kind, world, f"tensor_parallel_size x pipeline_parallel_size = {world} ranks need {world} "
                                   f"{kind}s in the Ray cluster (one per rank)")
    bundles = [{kind: 1} for _ in range(world)]
    bundles[0][f"node:{host}"] = 0.001
    return placement_group(bundles, strategy="PACK")


def _get_in_time(refs, what: str):
    """``ray.get(refs)``, but a cluster that cannot give what the ranks need in time raises."""
    try:
        return ray.get(refs, timeout=START_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray did not {what} in {START_TIMEOUT_S} s; the cluster has free: "
                           f"{ray.available_resources()}.") from None


def _result(rank: int, ref):
    """A call's result; its failure (with the actor's traceback), or its actor's death, raises."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise WorkerFailed(f"parallel worker rank {rank} failed:\n{_plain(e)}") from None
    except ray.exceptions.RayActorError as e:
        raise WorkerFailed(f"parallel worker rank {rank} died: {_plain(e)}") from None


def _plain(error: BaseException) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", str(error))      # (Ray colours the actor's name)


class RayExecutor(StopsOnFailure, ParallelExecutor):
    def __init__(self, config: EngineConfig):
        check_no_process_group()          # (one torch.distributed group per process)
        world, device = config.parallel.world_size, config.device
        self.world_size, self.tp_size = world, config.parallel.tensor_parallel_size
        _connect(world, device)
        host = ray.util.get_node_ip_address()
        self.actors: list = []          # rank 1..N-1's, in rank order
        self._pending: list = []        # (rank, reference) of the calls not seen to end yet
        owned: list = []                # every actor made (the GPU holder of rank 0's bundle too)
        self.pg = _placement_group(world, device, host)
        self._finalizer = weakref.finalize(self, _shutdown, owned, self.pg, torch.get_num_threads())
        try:
            _get_in_time(self.pg.ready(), f"reserve {self.pg.bundle_specs} (a bundle per rank, the first on this node)")
            # On CUDA an idle actor holds bundle 0's GPU, and tells which it is: rank 0 runs here, on it.
            owned += [self._actor(device, b) for b in range(0 if device == "cuda" else 1, world)]
            nodes = _get_in_time([a.node.remote() for a in owned], "start the ranks' actors")
            gpu = local_gpu(nodes.pop(0)[1]) if device == "cuda" else None
            ranked = owned[1:] if device == "cuda" else owned
            # Consecutive ranks (a tensor-parallel group) on one node: this node's first.
            order = sorted(range(len(ranked)), key=lambda i: (nodes[i][0] != host, nodes[i][0]))
            self.actors += [ranked[i] for i in order]
            store = rendezvous_store(world, COLLECTIVE_TIMEOUT_S, host)
            self._pending += [(r, a.start.remote(config, r, host, store.port)) for r, a in enumerate(self.actors, 1)]
            self.worker = Worker(config, 0, store.port, host, gpu, store)
            self._reap()
        except ValueError:
            self.shutdown()     # (a layout or checkpoint the model refuses: rank 0's own words)
            raise
        except BaseException as e:
            raise self._fail(e) from e

    def _actor(self, device: str, bundle: int):
        gpu = device == "cuda"
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)
        return RayWorker.options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                                 scheduling_strategy=strategy).remote()

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ calls on every rank
    def _submit(self, method: str, *args, only_args: dict | None = None) -> list:
        """``method(*args)`` queued on every actor, without waiting (rank r's arguments
        ``only_args[r]`` where given)."""
        refs = [getattr(a, method).remote(*(only_args or {}).get(r, args)) for r, a in enumerate(self.actors, 1)]
        self._pending += zip(range(1, len(refs) + 1), refs)
        return refs

    def _reap(self, timeout: float | None = None) -> dict:
        """The results of the actors' calls that have ended, by reference, waiting up to
        ``timeout`` for them all (None: for every one, as long as they work). The first that
        failed, or whose actor died, raises, naming its rank."""
        results = {}
        while self._pending:
            refs = [ref for _, ref in self._pending]
            ready = set(ray.wait(refs, num_returns=1 if timeout is None else len(refs), timeout=timeout)[0])
            results.update((ref, _result(rank, ref)) for rank, ref in self._pending if ref in ready)
            self._pending = [(rank, ref) for rank, ref in self._pending if ref not in ready]
            if timeout is not None:
                break
        return results

    def _last_words(self) -> str | None:
        try:
            self._reap(ERROR_GRACE_S / 5)
        except WorkerFailed as e:
            return str(e)
        return None

    def collective_rpc(self, method, args: tuple = ()) -> list:
        """``method`` (a Worker method's name, or a function taking the worker first) run on
        every rank; the results in rank order."""
        self._check_running()
        try:
            refs = self._submit("call", method, args)
            local = self.worker.call(method, args)
            results = self._reap()
        except BaseException as e:
            raise self._fail(e) from e
        return [local] + [results[ref] for ref in refs]

    def execute_model(self, sched: SchedulerOutput):
        self._check_running()
        try:
            self._reap(timeout=0)       # an earlier step's failure, seen without waiting
            lean, driver = split_masks(sched, self.world_size, self.tp_size)
            self._submit("execute_model", ray.put(lean),
                         only_args=None if driver is None else {driver: (ray.put(sched),)})
            return self.worker.runner.execute_model(sched)
        except BaseException as e:
            raise self._fail(e) from e
