"""Linear layers that know how they are split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes a slice, no
communication); row-parallel layers split the input features and all-reduce the partial sums.
Fused QKV and gate_up projections are column-parallel layers loaded from several checkpoint
tensors (``shard_id``). With tp_size 1 they are plain linear layers.

A parameter says where its output and input features lie (``output_dim``, ``input_dim``; a
dense weight is ``(out, in)``) and how many of them one of its elements holds (``output_pack``,
``input_pack``: 8 for 4-bit values packed in int32, the group size for per-group scales), so
that the loaders narrow quantized tensors as they do dense ones. ``output_dim`` None: the
tensor is the same for every output slice (GPTQ's ``g_idx``); ``input_dim`` None: it is not split
along the input (a scale per output row). A one-element checkpoint tensor loaded into several
rows is a per-tensor scale and fills them.
"""
import torch
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from pagoda.quant.base import QuantMethod, UnquantizedLinearMethod


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by tensor_parallel_size {b}.")
    return a // b


class LinearBase(nn.Module):
    # LoRA adapters (lora/layers.py: LoRALinear), when the engine has them: added to the output
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quant_method: QuantMethod | None):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        dtype = torch.get_default_dtype()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        return out if self.lora is None else self.lora.apply(x, out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(in_features, out_features, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


def _copy(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """``target.copy_(loaded)``, a one-element ``loaded`` (a per-tensor scale) filling every row."""
    target.copy_(loaded.reshape(()) if loaded.numel() == 1 else loaded)


def _load_shared(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """A tensor that every shard of a fused layer carries (``output_dim`` None): they must agree,
    since the fused layer holds one."""
    if getattr(param, "shared_loaded", False) and not torch.equal(param.data, loaded.to(param.device)):
        raise ValueError("The checkpoint's projections fused into one layer (q/k/v or gate/up) carry different "
                         f"{tuple(param.shape)} tensors (act-order g_idx?); pagoda needs them equal to fuse them.")
    param.data.copy_(loaded)
    param.shared_loaded = True


def _split_output(param, loaded: torch.Tensor, sizes: dict) -> list[tuple[object, torch.Tensor]]:
    """A checkpoint tensor that holds a fused layer's projections whole (Phi-3's qkv_proj and
    gate_up_proj), cut into each projection's (shard id, tensor), ``sizes`` in output features
    (a tensor every projection carries, ``output_dim`` None, goes to each whole)."""
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        return [(sid, loaded) for sid in sizes]
    pack = getattr(param, "output_pack", 1)
    return list(zip(sizes, loaded.split([size // pack for size in sizes.values()], dim=dim)))


def _narrow_output(param, loaded, offset: int, size: int, rank: int) -> None:
    """Copy output features ``[rank * size, + size)`` of a checkpoint shard to ``[offset, +
    size)`` of the parameter's (counted in features; divided by the packing)."""
    dim = getattr(param, "output_dim", 0)
    if dim is None:
        return _load_shared(param, loaded)
    pack = getattr(param, "output_pack", 1)
    # (a layer of one shard, unsplit, may end in a partial block)
    if (size % pack or offset % pack) and not (offset == 0 and loaded.shape[dim] == param.shape[dim]):
        raise ValueError(f"A projection's {size} output rows at row {offset} of its layer do not fall on whole "
                         f"blocks of the checkpoint's {pack}-row scales (block-wise FP8); its blocks would mix "
                         "projections or ranks.")
    size, offset = -(-size // pack), offset // pack
    shard = loaded if loaded.numel() == 1 else loaded.narrow(dim, rank * size, size)
    _copy(param.data.narrow(dim, offset, size), shard)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(in_features, _divide(out_features, get_tp_size()), bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        _narrow_output(param, loaded, 0, self.out_features, self.tp_rank)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features, output_sizes: list[int], bias=False, quant_method=None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, quant_method)

    def weight_loader(self, param, loaded, shard_id: int = None):
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _narrow_output(param, loaded, offset, size, self.tp_rank)

    def checkpoint_shards(self, param, loaded):
        return _split_output(param, loaded, dict(enumerate(self.output_sizes)))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. With more ranks than KV heads, KV heads are
    replicated so each rank holds at least one."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, quant_method=None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        self.checkpoint_sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id: str = None):
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        _narrow_output(param, loaded, offset, size, rank)

    def checkpoint_shards(self, param, loaded):
        return _split_output(param, loaded, self.checkpoint_sizes)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(_divide(in_features, get_tp_size()), out_features, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:    # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        dim = getattr(param, "input_dim", 1)
        if dim is None:              # not split along the input (a scale per output row)
            return _copy(param.data, loaded)
        size = param.shape[dim]      # (already in the parameter's own units: packed, or groups)
        param.data.copy_(loaded.narrow(dim, self.tp_rank * size, size))

    def forward(self, x):
        # The partial sums are reduced: rank 0's alone carry the bias. A LoRA term goes in before
        # the reduction too (lora/layers.py).
        out = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.lora is not None:
            out = self.lora.apply(x, out)
        return out if self.tp_size == 1 else tp_all_reduce(out)
