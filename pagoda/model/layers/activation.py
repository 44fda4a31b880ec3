import torch
from torch import nn

from pagoda.model.layers.layernorm import kernels_for


class SiluAndMul(nn.Module):
    """silu(gate) * up, on the gate_up projection's concatenated output (Triton on CUDA)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels_for(x).silu_and_mul(x)
