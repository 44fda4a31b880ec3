"""One data-parallel replica: a whole LLMEngine (with its own tensor/pipeline-parallel workers,
if any) in a spawned process, doing what the front (DPEngine) asks over a pipe (or in a Ray
actor: engine/dp_ray.py)."""
import os
from dataclasses import replace

from pagoda.distributed.child_procs import picklable, run_call
from pagoda.engine.arg_utils import EngineArgs


def cpu_share(dp_rank: int, dp_size: int, cpus: list[int]) -> list[int]:
    """Replica ``dp_rank``'s cores: every ``dp_size``-th one, so that the replicas' OpenMP
    threads do not take turns on the same cores (they share one when there are fewer cores
    than replicas)."""
    return cpus[dp_rank::dp_size] or [cpus[dp_rank % len(cpus)]]


def replica_env(dp_rank: int, dp_size: int, ranks_per_replica: int) -> dict[str, str]:
    """Replica d sees only GPUs [d*W, (d+1)*W) of those visible here (W ranks each), as
    cuda:0..W-1; set before it starts, so nothing it imports can start CUDA with all of them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(dp_size * ranks_per_replica)]
    return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[dp_rank * ranks_per_replica:(dp_rank + 1) * ranks_per_replica])}


def _claim_cores(dp_rank: int, dp_size: int) -> None:
    """Run on this replica's share of the cores; its ranks split it (Worker)."""
    share = cpu_share(dp_rank, dp_size, sorted(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, share)
    import torch
    torch.set_num_threads(len(share))


def replica_engine(args: EngineArgs, dp_rank: int, dp_size: int):
    """Replica ``dp_rank``'s LLMEngine, on its share of the cores (its GPUs are set by
    ``replica_env`` before its process starts)."""
    _claim_cores(dp_rank, dp_size)
    from pagoda.engine.llm_engine import LLMEngine
    return LLMEngine.from_engine_args(replace(args, data_parallel_size=1))


def replica_main(args: EngineArgs, dp_rank: int, dp_size: int, conn) -> None:
    """Build the engine, then serve ``(method, args)`` calls until told to stop or the front is
    gone. A call that raises (a bad request) answers ``("raise", exception)`` and the replica
    goes on; a failure to start is answered so too, and ends it."""
    conn.send(("started", None))
    try:
        engine = replica_engine(args, dp_rank, dp_size)
        conn.send(("ok", None))
    except Exception as e:       # noqa: BLE001 - raised by the front's LLM(...) as by an engine of its own
        conn.send(("raise", picklable(e)))
        conn.close()
        return
    while True:
        try:
            method, call_args = conn.recv()
        except EOFError:          # the front's process has exited
            break
        if method == "shutdown":
            break
        try:
            result = run_call(engine, method, call_args)
        except Exception as e:    # noqa: BLE001 - handed to the caller; the engine decides if it can go on
            conn.send(("raise", picklable(e)))
        else:
            conn.send(("ok", result))
    del engine                    # (stops its own workers now, before the process ends)
    conn.close()
