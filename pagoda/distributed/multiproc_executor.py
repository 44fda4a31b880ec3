"""Tensor and pipeline parallelism over processes on one node. Rank 0 is the engine's own
process (it schedules and detokenizes; it samples too, unless the last pipeline stage does);
ranks 1..N-1 are spawned worker processes. Each step's SchedulerOutput is pickled once and
written to every worker's pipe; the ranks then meet only in the model's collectives and the
pipeline stages' sends and receives (torch.distributed: gloo on CPU, NCCL on CUDA)."""
from pagoda.config import EngineConfig
from pagoda.core.sched_output import SchedulerOutput
from pagoda.distributed.child_procs import SPAWN_HINT, ChildProcs
from pagoda.distributed.executor import ParallelExecutor, split_masks
from pagoda.distributed.parallel_state import check_no_process_group, rendezvous_store
from pagoda.distributed.worker import COLLECTIVE_TIMEOUT_S, Worker, worker_main


class MultiprocExecutor(ChildProcs, ParallelExecutor):
    child_name = "parallel worker rank"
    first_id = 1

    def __init__(self, config: EngineConfig):
        check_no_process_group()          # (one torch.distributed group per process)
        self.world_size, self.tp_size = config.parallel.world_size, config.parallel.tensor_parallel_size
        store = rendezvous_store(self.world_size, COLLECTIVE_TIMEOUT_S)
        try:
            self._start_children(worker_main, lambda rank: (config, rank, store.port), self.world_size - 1)
            # Every worker alive past its imports before rank 0 blocks in the rendezvous.
            self._replies(SPAWN_HINT)
            self.worker = Worker(config, 0, store.port, store=store)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ calls on every rank
    def collective_rpc(self, method, args: tuple = ()) -> list:
        """``method`` (a Worker method's name, or a function taking the worker first) run on
        every rank; the results in rank order."""
        self._send((method, args))
        try:
            local = self.worker.call(method, args)
        except BaseException as e:
            raise self._fail(e) from e
        return [local] + self._replies()

    def execute_model(self, sched: SchedulerOutput):
        lean, driver = split_masks(sched, self.world_size, self.tp_size)
        others = [r for r in range(1, self.world_size) if r != driver]
        self._send(("execute_model", (lean,)), others)
        if driver is not None:
            self._send(("execute_model", (sched,)), [driver])
        try:
            out = self.worker.runner.execute_model(sched)
        except BaseException as e:
            raise self._fail(e) from e
        self._check_children()
        return out
