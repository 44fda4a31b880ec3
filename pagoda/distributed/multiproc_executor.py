"""Tensor and pipeline parallelism over processes on one node. Rank 0 is the engine's own
process (it schedules and detokenizes; it samples too, unless the last pipeline stage does);
ranks 1..N-1 are spawned worker processes. Each step's SchedulerOutput is pickled once and
written to every worker's pipe; the ranks then meet only in the model's collectives and the
pipeline stages' sends and receives (torch.distributed: gloo on CPU, NCCL on CUDA)."""
import multiprocessing as mp
import pickle
import socket
import weakref
from multiprocessing.connection import wait

import torch

from pagoda.config import EngineConfig
from pagoda.core.sched_output import SchedulerOutput
from pagoda.distributed.parallel_state import check_no_process_group, destroy_distributed
from pagoda.distributed.worker import Worker, worker_main

# A spawned process first imports the parent's main module: a script that starts an engine at
# import time would start one in every worker.
SPAWN_HINT = (" It died before it started: workers are spawned processes that import the main script "
              "first, so a script must create its LLM under `if __name__ == \"__main__\":`.")
# How long rank 0 waits for a worker's last words once it knows something went wrong.
ERROR_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shutdown(procs: list, conns: list, num_threads: int) -> None:
    """Stop the workers (politely, then by force), leave the process group and give this process
    back the threads rank 0 gave up. A plain function over plain values: the finalizer that
    calls it must not keep the executor alive."""
    for conn in conns:
        try:
            conn.send(("shutdown", ()))
        except (OSError, ValueError):
            pass
    destroy_distributed()     # (first: a worker stuck in a collective then fails at once)
    for p in procs:
        p.join(timeout=ERROR_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    torch.set_num_threads(num_threads)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        check_no_process_group()          # (one torch.distributed group per process)
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.procs, self.conns = [], []
        self.dead: str | None = None
        # Runs on `del llm`, garbage collection or interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, torch.get_num_threads())
        try:
            for rank in range(1, config.parallel.world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(config, rank, port, child),
                                name=f"pagoda-rank{rank}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            # Every worker alive past its imports before rank 0 blocks in the rendezvous.
            self._replies(SPAWN_HINT)
            self.worker = Worker(config, 0, port)
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ calls on every rank
    def collective_rpc(self, method, args: tuple = ()) -> list:
        """``method`` (a Worker method's name, or a function taking the worker first) run on
        every rank; the results in rank order."""
        self._send((method, args))
        try:
            local = method(self.worker, *args) if callable(method) else getattr(self.worker, method)(*args)
        except BaseException as e:
            raise self._fail(e) from e
        return [local] + self._replies()

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, sched: SchedulerOutput):
        self._send(("execute_model", (sched,)))
        try:
            out = self.worker.runner.execute_model(sched)
        except BaseException as e:
            raise self._fail(e) from e
        self._check_workers()
        return out

    # ------------------------------------------------------------------ failures
    def _send(self, msg) -> None:
        if self.dead is not None:
            raise RuntimeError(f"The parallel engine has stopped ({self.dead}); create a new LLM.")
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)   # once for all workers
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as e:
            raise self._fail(e) from e

    def _replies(self, hint: str = "") -> list:
        """Each worker's answer to the last call, waiting as long as it works; a worker's error,
        or its death, raises."""
        results = []
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            wait([conn, p.sentinel])
            status, value = self._read(rank, conn, p, hint)
            if status == "error":
                raise self._fail(WorkerFailed(value))
            results.append(value)
        return results

    def _read(self, rank: int, conn, p, hint: str = "") -> tuple[str, object]:
        """The message of a worker whose pipe or process is ready: what it sent, or that it died."""
        try:
            return conn.recv()
        except (EOFError, OSError):
            p.join(ERROR_GRACE_S)
            return "error", f"parallel worker rank {rank} died (exit code {p.exitcode}).{hint}"

    def _check_workers(self) -> None:
        """After a step: a worker that failed once the ranks' collectives were over, or died
        since, is noticed here (a poll per worker)."""
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            if conn.poll():
                raise self._fail(WorkerFailed(self._read(rank, conn, p)[1]))

    def _last_words(self) -> str | None:
        """The error of a worker that failed or died around rank 0's failure, if any."""
        ready = wait(self.conns + [p.sentinel for p in self.procs], ERROR_GRACE_S / 5)
        for rank, (conn, p) in enumerate(zip(self.conns, self.procs), start=1):
            if conn in ready or p.sentinel in ready:
                status, value = self._read(rank, conn, p)
                if status == "error":
                    return value
        return None

    def _fail(self, error: BaseException) -> BaseException:
        """After a failed call that involves the workers, the ranks' collectives can no longer
        be matched: stop them all. The error to raise is the worker's (with its traceback) when
        one failed or died, else rank 0's own."""
        if not isinstance(error, WorkerFailed):
            reason = self._last_words()
            error = WorkerFailed(reason) if reason else error
        self.shutdown()
        self.dead = str(error).splitlines()[0] if str(error) else repr(error)
        return error


class WorkerFailed(RuntimeError):
    pass
