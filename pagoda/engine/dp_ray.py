"""Data-parallel replicas as Ray actors (``data_parallel_backend="ray"``), so that the cluster
can place them on any of its nodes: one actor a replica, holding a whole LLMEngine whose own
tensor/pipeline-parallel ranks are processes of that node (the actor asks for all their GPUs,
so Ray gives it a node that has them and sets its CUDA_VISIBLE_DEVICES). DPEngine reaches the
actors as it reaches its pipe replicas: Ray runs one caller's calls on an actor in order, so
each replica's calls not yet answered are a queue of object references, oldest first.

Ray is joined where it runs (``ray start`` / RAY_ADDRESS), else started on this node, as the
Ray executor does; the engine kills its actors when it goes."""
import weakref
from collections import deque

import ray

from pagoda.config import EngineConfig
from pagoda.distributed.child_procs import ERROR_GRACE_S, StopsOnFailure, WorkerFailed, picklable, run_call
from pagoda.distributed.ray_executor import _connect, _get_in_time, _plain, check_cluster_has
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.dp_replica import replica_engine


@ray.remote(max_restarts=0)
class RayReplica:
    """The engine is built by ``start``, not in ``__init__``: a call's error reaches the
    caller as that error, where a constructor's would only leave a dead actor. Errors are
    made picklable here, as the pipe replica does, so that the caller gets the exception."""

    def __init__(self):
        self.engine = None

    def node(self) -> str:
        return ray.util.get_node_ip_address()

    def start(self, args: EngineArgs, share: int, shares: int) -> None:
        try:
            self.engine = replica_engine(args, share, shares)
        except Exception as e:     # noqa: BLE001 - raised by the front's LLM(...) as by an engine of its own
            raise picklable(e) from None

    def call(self, method, args: tuple):
        try:
            return run_call(self.engine, method, args)
        except Exception as e:     # noqa: BLE001 - handed to the caller; the engine decides if it can go on
            raise picklable(e) from None

    def stop(self) -> None:
        self.engine = None         # (stops its own workers now, before the actor is killed)


def _shutdown(actors: list) -> None:
    """Let each replica stop its engine (its workers), for a moment, then kill the actors. A
    plain function over plain values: the finalizer that calls it must not keep the owner alive."""
    if not ray.is_initialized():      # (at exit Ray may have shut down first: the actors went with it)
        return
    ray.wait([a.stop.remote() for a in actors], num_returns=len(actors), timeout=ERROR_GRACE_S)
    for actor in actors:
        ray.kill(actor)


class RayReplicas(StopsOnFailure):
    """The ``Replicas`` of DPEngine (dp_engine.py) as Ray actors."""

    def __init__(self, args: EngineArgs, config: EngineConfig):
        dp, ranks, device = config.parallel.data_parallel_size, config.parallel.world_size, config.device
        _connect(dp, device)
        gpu = device == "cuda"
        if gpu:
            check_cluster_has("GPU", dp * ranks, f"data_parallel_size={dp} replicas of {ranks} ranks need "
                                                 f"{dp * ranks} GPUs in the Ray cluster (one per rank)")
        else:
            check_cluster_has("CPU", dp, f"data_parallel_size={dp} replicas need {dp} CPUs in the Ray "
                                         f"cluster (one per replica)")
        # On CUDA the replica's ranks need its GPUs on one node (its ranks are that node's
        # processes); on the CPU it takes a share of its node's cores, and one CPU of Ray's.
        self.actors = [RayReplica.options(num_cpus=0 if gpu else 1, num_gpus=ranks if gpu else 0).remote()
                       for _ in range(dp)]
        self._pending: list[deque] = [deque() for _ in range(dp)]
        # Runs on `del llm`, garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, list(self.actors))
        try:
            nodes = _get_in_time([a.node.remote() for a in self.actors],
                                 f"start the {dp} replicas' actors ({ranks if gpu else 1} {'GPU' if gpu else 'CPU'}"
                                 f"s each, a replica's on one node)")
            for d, actor in enumerate(self.actors):
                # Replicas that share a node split its cores between them, as on one node.
                neighbours = [e for e, node in enumerate(nodes) if node == nodes[d]]
                self._pending[d].append(actor.start.remote(args, neighbours.index(d), len(neighbours)))
            self.replies()         # every engine built (a ValueError of one raises here)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        self._finalizer()

    def send(self, method, args: tuple, only: list[int] | None = None) -> None:
        self._check_running()
        for d in self._numbers(only):
            self._pending[d].append(self.actors[d].call.remote(method, args))

    def replies(self, only: list[int] | None = None) -> list:
        results, raised = [], None
        for d in self._numbers(only):
            try:
                results.append(ray.get(self._pending[d].popleft()))
            except ray.exceptions.RayTaskError as e:      # the call raised; the replica goes on
                raised = raised or (e.cause if isinstance(e.cause, BaseException) else RuntimeError(_plain(e)))
                results.append(None)
            except ray.exceptions.RayActorError as e:
                raise self._fail(WorkerFailed(f"data parallel replica {d} died: {_plain(e)}")) from None
        if raised is not None:
            raise raised
        return results

    def ready(self, only: list[int]) -> list[int]:
        heads = {self._pending[d][0]: d for d in only}
        ray.wait(list(heads), num_returns=1)
        done, _ = ray.wait(list(heads), num_returns=len(heads), timeout=0)
        return [heads[ref] for ref in done]

    def _numbers(self, only: list[int] | None) -> list[int]:
        return list(range(len(self.actors))) if only is None else list(only)

    def _last_words(self) -> str | None:
        """A replica's death around this process's failure, if any (its first call not yet
        answered fails then)."""
        heads = {q[0]: d for d, q in enumerate(self._pending) if q}
        if not heads:
            return None
        done, _ = ray.wait(list(heads), num_returns=len(heads), timeout=ERROR_GRACE_S / 5)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return f"data parallel replica {heads[ref]} died: {_plain(e)}"
            except Exception:      # noqa: BLE001 - a call's own error is not a death
                pass
        return None
