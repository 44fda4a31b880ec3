"""Tensor-parallel group state: this process's rank and the group's size, set once per process
by the executor's worker before it builds the model. Layers ask these functions, never
torch.distributed directly; at tp_size 1 every collective is a no-op."""
from datetime import timedelta

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


def init_distributed(world_size: int, rank: int, port: int, device: str, timeout_s: float) -> None:
    """Join the localhost process group (gloo on CPU, NCCL on CUDA) and set the TP state.
    ``timeout_s`` bounds every collective, so a rank left waiting on a dead peer fails instead
    of hanging."""
    if dist.is_initialized():
        raise RuntimeError("A tensor-parallel engine is already running in this process; delete it "
                           "(del llm) before starting another.")
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=timeout_s))
    init_tensor_parallel(world_size, rank)


def destroy_distributed() -> None:
    init_tensor_parallel(1, 0)
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` from rank 0 on every rank (in place)."""
    if _TP_SIZE > 1:
        dist.broadcast(x, src=0)
    return x
