import functools

import torch
from torch import nn

from pagoda.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from pagoda.kernels import reference


@functools.cache
def _triton_ops():
    # Imported on first use, not with the layers: importing triton fixes, for the whole process,
    # whether its kernels run compiled or in the CPU interpreter (TRITON_INTERPRET).
    from pagoda.kernels import triton_ops
    return triton_ops


def kernels_for(x: torch.Tensor):
    """The module of elementwise kernels for ``x``'s device: the fused Triton kernels
    (``pagoda.kernels.triton_ops``) on CUDA, the torch versions (``pagoda.kernels.reference``,
    same functions and signatures) elsewhere. Shared by the norm and activation layers."""
    return _triton_ops() if x.is_cuda else reference


class QuantizesForNext:
    """A layer whose output only the linear layer ``feeds`` names takes: when that layer's matmul
    would quantize its input rows per token (W8A8), this one's kernel writes them quantized
    (``reference.QuantizedInput``), saving a launch and a pass over the rows."""
    _next = None

    def feeds(self, linear: nn.Module) -> None:
        if linear.quant_method.quantizes_input:
            # (kept out of the module tree: the linear layer belongs to its own parent)
            self.__dict__["_next"] = linear

    def quant_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        linear = self._next
        if linear is None or linear.lora is not None:   # (a LoRA adapter reads x itself)
            return None
        return linear.quant_method.input_quant(linear, x)


class RMSNorm(QuantizesForNext, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, unit_offset: bool = False):
        """``unit_offset``: Gemma's norm, the weight an offset from 1 (``reference.rms_norm``)."""
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: add it first (the fused residual-add + norm of every decoder layer)
        and return the sum as the next residual. Inputs are left unchanged."""
        quant_dtype = self.quant_dtype(x)
        if residual is None:
            return kernels_for(x).rms_norm(x, self.weight, self.eps, quant_dtype=quant_dtype,
                                           unit_offset=self.unit_offset)
        return kernels_for(x).fused_add_rms_norm(x, residual, self.weight, self.eps, quant_dtype=quant_dtype,
                                                 unit_offset=self.unit_offset)


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over a whole projection whose heads are split over the tensor-parallel ranks (OLMo
    2/3's q and k norms): this rank's slice of the weight, and the root mean square taken over
    every rank's part (one all-reduce of the sums of squares; a head held by ``replicas`` ranks,
    as KV heads are when there are more ranks than them, counted once)."""

    def __init__(self, local_size: int, eps: float, replicas: int = 1):
        super().__init__()
        self.eps, self.replicas, self.tp_size = eps, replicas, get_tp_size()
        self.rank = get_tp_rank() // replicas       # (which slice of the weight this rank holds)
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)

    def weight_loader(self, param, loaded):
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return kernels_for(x).rms_norm(x, self.weight, self.eps)
        xf = x.float()
        squares = tp_all_reduce(xf.square().sum(-1, keepdim=True)) / self.replicas
        mean = squares / (x.shape[-1] * self.tp_size // self.replicas)
        return (xf * torch.rsqrt(mean + self.eps)).to(x.dtype) * self.weight
