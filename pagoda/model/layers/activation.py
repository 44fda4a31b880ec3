import torch
from torch import nn

from pagoda.model.layers.layernorm import QuantizesForNext, kernels_for


class SiluAndMul(QuantizesForNext, nn.Module):
    """silu(gate) * up, on the gate_up projection's concatenated output (Triton on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        quant_dtype = self.quant_dtype(x[..., :d]) if self._next is not None else None   # (its output's shape)
        return kernels_for(x).silu_and_mul(x, quant_dtype=quant_dtype)
