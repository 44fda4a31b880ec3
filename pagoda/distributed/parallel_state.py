"""Parallel state. While a model is built (``building_parallel_model``), its layers read the
tensor-parallel group's size and this process's rank in it (and whether a mixture of experts
shares its experts out over that group, ``expert_parallel``), and the model reads its pipeline
stage (``get_pp_group``); they keep them. At run time they call the collectives here (never
torch.distributed directly) only when they are split. So a one-process engine built beside a
parallel one in the same process stays unsplit, and pays nothing.

Ranks are laid out as in vLLM: global rank = pp_rank * tp_size + tp_rank, so each pipeline stage
is a tensor-parallel group of consecutive ranks, and a rank's peer in the next stage is
rank + tp_size."""
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_TP_SIZE = 1
_TP_RANK = 0
_EXPERT_PARALLEL = False
# This process's tensor-parallel group when the world holds several stages (None: the world).
_TP_GROUP = None
# With several stages, a second group of the whole world for the sampled tokens, which the last
# stage hands back while the stages' activations go forward: the two flows then never wait on
# each other's order (a step's tokens go back after the next step's activations went on).
_OUTPUT_GROUP = None
# Holders of CUDA graphs that captured this group's collectives (weak references): NCCL cannot
# tear a communicator down while a graph of its kernels lives (seen on two H200s: the abort
# waited for good), so destroy_distributed releases them first.
_CAPTURED: list[weakref.ref] = []


@dataclass(frozen=True)
class GroupCoordinator:
    """This rank's place in its pipeline: ``world_size`` stages, this one ``rank_in_group``;
    the peers it passes activations to are the same tensor-parallel rank one stage away."""
    world_size: int = 1
    rank_in_group: int = 0
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def global_rank(self) -> int:
        return self.rank_in_group * self.tp_size + self.tp_rank

    @property
    def last_stage_driver(self) -> int:
        """The global rank that samples: the last stage's tensor-parallel rank 0."""
        return (self.world_size - 1) * self.tp_size

    def send_tensor_dict(self, tensors: dict[str, torch.Tensor]) -> list:
        """Sent without waiting (the stage goes on with the next batch): the (work, tensor)
        pairs, to be kept until the sends are done."""
        sends = []
        for t in tensors.values():
            t = t.contiguous()
            sends.append((dist.isend(t, dst=self.global_rank + self.tp_size), t))
        return sends

    def recv_tensor_dict(self, shapes: dict[str, tuple], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
        out = {}
        for name, shape in shapes.items():
            out[name] = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(out[name], src=self.global_rank - self.tp_size)
        return out


_PP = GroupCoordinator()


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_rank() -> int:
    return _TP_RANK


def get_pp_group() -> GroupCoordinator:
    return _PP


def expert_parallel() -> bool:
    """Whether a mixture of experts shares its experts out over the tensor-parallel ranks."""
    return _EXPERT_PARALLEL


@contextmanager
def building_parallel_model(tp_size: int, tp_rank: int, pp_size: int = 1, pp_rank: int = 0,
                            enable_expert_parallel: bool = False):
    global _TP_SIZE, _TP_RANK, _PP, _EXPERT_PARALLEL
    prev = _TP_SIZE, _TP_RANK, _PP, _EXPERT_PARALLEL
    _TP_SIZE, _TP_RANK, _PP = tp_size, tp_rank, GroupCoordinator(pp_size, pp_rank, tp_size, tp_rank)
    _EXPERT_PARALLEL = enable_expert_parallel
    try:
        yield
    finally:
        _TP_SIZE, _TP_RANK, _PP, _EXPERT_PARALLEL = prev


def check_no_process_group() -> None:
    if dist.is_initialized():
        raise RuntimeError("A parallel engine is already running in this process; delete it "
                           "(del llm) before starting another.")


def rendezvous_store(world_size: int, timeout_s: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """Rank 0's side of the group's rendezvous at ``host``, listening at a port the system picks
    before the other ranks start: its ``port`` is theirs to meet at. (A port found free and bound
    only when rank 0 joins could be taken in between, e.g. by another group's connections: a
    data-parallel replica's. It was, once, in a CI run.)"""
    return dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_distributed(world_size: int, rank: int, port: int, device: str, timeout_s: float,
                     tp_size: int | None = None, host: str = "127.0.0.1",
                     store: dist.TCPStore | None = None) -> None:
    """Join the process group that rank 0 holds at ``host:port`` (localhost for processes of one
    node, rank 0's node's address over Ray; rank 0 passes its ``rendezvous_store``): gloo on CPU,
    NCCL on CUDA. ``timeout_s`` bounds every collective, so a rank left waiting on a peer that
    hangs fails instead of waiting forever. With several pipeline stages of several ranks, each
    stage's tensor-parallel group is made here, once (every rank must create every group, in the
    same order), and with several stages the output group (``broadcast_output``)."""
    global _TP_GROUP, _OUTPUT_GROUP
    check_no_process_group()
    if store is None:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, world_size=world_size,
                            rank=rank, timeout=timedelta(seconds=timeout_s))
    tp_size = tp_size or world_size
    if 1 < tp_size < world_size:
        for start in range(0, world_size, tp_size):
            group = dist.new_group(list(range(start, start + tp_size)))
            if start <= rank < start + tp_size:
                _TP_GROUP = group
    if tp_size < world_size:
        _OUTPUT_GROUP = dist.new_group(list(range(world_size)))


def graphs_captured(holder) -> None:
    """``holder.release()`` frees CUDA graphs that captured collectives; it runs before the group
    is torn down."""
    _CAPTURED.append(weakref.ref(holder))


def destroy_distributed() -> None:
    """Leave the process group. NCCL's groups are aborted, not destroyed: destroying finalizes
    each communicator, which waits on the peers, and a peer that has died may never answer."""
    global _TP_GROUP, _OUTPUT_GROUP
    _TP_GROUP = _OUTPUT_GROUP = None
    if not dist.is_initialized():
        return
    for ref in _CAPTURED:
        holder = ref()
        if holder is not None:
            holder.release()
    _CAPTURED.clear()
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_gather(x: torch.Tensor, tp_size: int, tp_rank: int, dim: int = -1) -> torch.Tensor | None:
    """``x`` of every rank of the tensor-parallel group, concatenated along ``dim`` on the
    group's first rank (the one that samples); None on the others."""
    parts = [torch.empty_like(x) for _ in range(tp_size)] if tp_rank == 0 else None
    dist.gather(x.contiguous(), parts, group=_TP_GROUP, group_dst=0)
    return None if parts is None else torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """``x`` from global rank ``src`` on every rank of the world (in place)."""
    dist.broadcast(x, src=src)
    return x


def broadcast_output(x: torch.Tensor, src: int):
    """``x`` from global rank ``src`` on every rank (in place), over the output group, without
    waiting: the work, whose ``wait()`` comes before ``x`` is read."""
    return dist.broadcast(x, src=src, group=_OUTPUT_GROUP, async_op=True)


def send_object(obj, dst: int) -> None:
    dist.send_object_list([obj], dst=dst)


def recv_object(src: int):
    box = [None]
    dist.recv_object_list(box, src=src)
    return box[0]
