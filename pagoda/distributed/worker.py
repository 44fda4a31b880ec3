"""One rank: the model runner on this rank's shard of the weights (its tensor-parallel slice of
its pipeline stage's layers). Rank 0 lives in the engine's process (MultiprocExecutor,
RayExecutor); ranks 1..N-1 run in processes of their own (``worker_main``, or a Ray actor) and
do what rank 0 sends them."""
import os
import traceback
from collections import deque

import torch

from pagoda.config import EngineConfig
from pagoda.distributed.child_procs import run_call
from pagoda.distributed.executor import RankWorker
from pagoda.distributed.parallel_state import building_parallel_model, destroy_distributed, init_distributed
from pagoda.runner.model_runner import ModelRunner

# Bounds every collective: a rank waiting on a peer that died or hangs fails after this long
# (weights loading on a slower rank at start-up must fit in it).
COLLECTIVE_TIMEOUT_S = 600


class Worker(RankWorker):
    def __init__(self, config: EngineConfig, rank: int, port: int, host: str = "127.0.0.1",
                 local_rank: int | None = None, store=None):
        """Join the group at ``host:port`` (rank 0's node) as ``rank`` (rank 0: hold it, at its
        ``store``, ``parallel_state.rendezvous_store``). On CUDA the rank's GPU is
        ``cuda:{local_rank}`` of this process: its rank on one node of spawned processes, 0 (or
        what Ray gave it) in a Ray actor, which sees its own GPU alone."""
        self.rank = rank
        self.last = None       # the step before, whose outputs this rank reads one step late
        self.in_flight: deque = deque()     # (pipeline parallelism) the steps whose outputs it has not read
        pc = config.parallel
        world, tp = pc.world_size, pc.tensor_parallel_size
        if config.device == "cuda":
            torch.cuda.set_device(rank if local_rank is None else local_rank)
        else:
            # The ranks share the cores (those this process may use: a data-parallel replica's
            # share): with a thread per core each, their spinning OpenMP threads would take
            # turns on every core and each collective would wait for them.
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
        init_distributed(world, rank, port, config.device, COLLECTIVE_TIMEOUT_S, tp, host, store)
        try:
            with building_parallel_model(tp, rank % tp, pc.pipeline_parallel_size, rank // tp,
                                         pc.enable_expert_parallel):
                self.runner = ModelRunner(config)
            self.extend(config.worker_extension_cls)
        except BaseException:
            destroy_distributed()
            raise

    def call(self, method, args: tuple = ()):
        """``method``: a Worker method's name, or a function taking the worker first."""
        return run_call(self, method, args)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)

    def execute_model(self, sched) -> None:
        """A step on a rank other than 0, whose outputs nobody reads: this step's tokens reach
        the rows one step late, as on rank 0 with async scheduling (the next step reads them on
        the device meanwhile). With pipeline parallelism several steps are in flight: a step's
        tokens are taken in before a later step schedules one of its requests again (as the
        engine on rank 0 has done before scheduling it), and at most one step a stage is left
        pending."""
        if self.runner.pp.world_size > 1:
            wanted = sched.num_scheduled_tokens.keys()
            last = max((i for i, out in enumerate(self.in_flight) if not wanted.isdisjoint(out.req_ids)), default=-1)
            for _ in range(max(last + 1, len(self.in_flight) + 1 - self.runner.batches_in_flight)):
                self.in_flight.popleft().get_output()
            self.in_flight.append(self.runner.execute_model(sched))
            return
        if self.runner.drafter is not None:
            # A draft model proposes after each step, with collectives: as rank 0's engine does,
            # which takes each step in at once (speculative decoding schedules synchronously).
            self.runner.execute_model(sched).get_output()
            return
        if self.last is not None and self.last.drafts is not None:
            # Speculative decoding: the drafts kept decide where this step's inputs go.
            self.last.get_output()
            self.last = None
        out = self.runner.execute_model(sched)
        if self.last is not None:
            self.last.get_output()
        self.last = out


def worker_main(config: EngineConfig, rank: int, port: int, conn) -> None:
    """A worker process: join the group, build the runner, then serve rank 0's messages
    ``(method, args)`` until told to stop or rank 0 is gone. Steps (``execute_model``) are not
    answered; other calls answer ``("ok", result)``. A failure answers ``("error", traceback)``
    and ends the process: the group's collectives can no longer be matched."""
    conn.send(("started", None))
    worker = None
    try:
        worker = Worker(config, rank, port)
        while True:
            try:
                method, args = conn.recv()
            except EOFError:          # rank 0's process has exited
                break
            if method == "shutdown":
                break
            result = worker.call(method, args)
            if method != "execute_model":
                conn.send(("ok", result))
    except BaseException:
        try:
            conn.send(("error", f"parallel worker rank {rank} failed:\n{traceback.format_exc()}"))
        except OSError:               # rank 0 is gone: nobody to tell
            pass
    finally:
        if worker is not None:
            destroy_distributed()
        conn.close()
