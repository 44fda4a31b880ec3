"""Tensor-parallel group state. Single process (tp_size 1) until the distributed executors
land; layers ask these functions, never torch.distributed directly, so that change is local."""
import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0


def init_tensor_parallel(tp_size: int, tp_rank: int) -> None:
    global _TP_SIZE, _TP_RANK
    _TP_SIZE, _TP_RANK = tp_size, tp_rank


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_rank() -> int:
    return _TP_RANK


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
