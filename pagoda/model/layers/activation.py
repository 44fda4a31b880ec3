import torch
from torch import nn

from pagoda.model.layers.layernorm import QuantizesForNext, kernels_for


class SiluAndMul(QuantizesForNext, nn.Module):
    """silu(gate) * up, on the gate_up projection's concatenated output (Triton on CUDA)."""
    kernel = "silu_and_mul"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        quant_dtype = self.quant_dtype(x[..., :d]) if self._next is not None else None   # (its output's shape)
        return getattr(kernels_for(x), self.kernel)(x, quant_dtype=quant_dtype)


class GeluTanhAndMul(SiluAndMul):
    """gelu(gate) * up with GELU's tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    kernel = "gelu_tanh_and_mul"


ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def act_and_mul(name: str) -> SiluAndMul:
    """The gated MLP's activation layer for config.json's ``hidden_act``."""
    try:
        return ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"MLP activation {name!r} is not supported (supported: {sorted(ACTIVATIONS)}).") from None
