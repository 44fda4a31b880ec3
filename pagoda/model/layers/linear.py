"""Linear layers that know how they are split across tensor-parallel ranks.

Column-parallel layers split the output features (each rank computes a slice, no
communication); row-parallel layers split the input features and all-reduce the partial sums.
Fused QKV and gate_up projections are column-parallel layers loaded from several checkpoint
tensors (``shard_id``). With tp_size 1 they are plain linear layers.
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
    def __init__(self, in_features: int, out_features: int, bias: bool,
                 quant_method: QuantMethod | None):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedLinearMethod()
        dtype = torch.get_default_dtype()
        self.quant_method.create_weights(self, in_features, out_features, dtype)
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(in_features, out_features, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(in_features, _divide(out_features, get_tp_size()), bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features, output_sizes: list[int], bias=False, quant_method=None):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, quant_method)

    def weight_loader(self, param, loaded, shard_id: int = None):
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matmul. With more ranks than KV heads, KV heads are
    replicated so each rank holds at least one."""

    def __init__(self, hidden_size, head_dim, num_heads, num_kv_heads, bias=False, quant_method=None):
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id: str = None):
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    def __init__(self, in_features, out_features, bias=False, quant_method=None):
        super().__init__(_divide(in_features, get_tp_size()), out_features, bias, quant_method)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:    # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x):
        bias = self.bias if self.tp_rank == 0 else None
        return tp_all_reduce(self.quant_method.apply(self, x, bias))
