"""Tensor-parallel state. While a model is built (``building_tp_model``), its layers read the
group's size and this process's rank and keep them; at run time they call the collectives here
(never torch.distributed directly) only when they are split. So a one-process engine built
beside a tensor-parallel one in the same process stays unsplit, and pays nothing."""
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_rank() -> int:
    return _TP_RANK


@contextmanager
def building_tp_model(tp_size: int, tp_rank: int):
    global _TP_SIZE, _TP_RANK
    prev = _TP_SIZE, _TP_RANK
    _TP_SIZE, _TP_RANK = tp_size, tp_rank
    try:
        yield
    finally:
        _TP_SIZE, _TP_RANK = prev


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError("A tensor-parallel engine is already running in this process; delete it "
                           "(del llm) before starting another.")


def init_distributed(world_size: int, rank: int, port: int, device: str, timeout_s: float) -> None:
    """Join the localhost process group: gloo on CPU, NCCL on CUDA. ``timeout_s`` bounds every
    collective, so a rank left waiting on a peer that hangs fails instead of waiting forever."""
    check_no_process_group()
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=timeout_s))


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` from rank 0 on every rank (in place)."""
    dist.broadcast(x, src=0)
    return x
