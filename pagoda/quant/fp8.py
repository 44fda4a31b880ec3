"""FP8 weights (E4M3, W8A16): each linear layer's weight in ``float8_e4m3fn`` with a float32
scale per output row, ``W[n, k] = w[n, k] * weight_scale[n]``; activations stay in the model's
dtype. Half of bf16's bytes.

Two ways in, as in vLLM:
- a checkpoint in vLLM's FP8 format (``quant_method: "fp8"``): ``weight`` in fp8 and a
  per-tensor ``weight_scale`` (fused q/k/v and gate/up layers get one per shard: each fills its
  rows of the per-row scale, so nothing is requantized); a static ``input_scale`` is read and not
  used (activations are not quantized);
- ``quantization="fp8"`` on an unquantized checkpoint: its weights are quantized at load, a
  scale per output row (its largest magnitude over E4M3's largest value, 448).

The matmul dequantizes the weight (``w * scale`` in the model's dtype) and runs a dense matmul:
correct on every device; an FP8 tensor-core path (``torch._scaled_mm``) is not written yet.
"""
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quant.base import QuantMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448


def fp8_config(qc: dict | None) -> bool:
    """Whether the weights come quantized (a checkpoint's config) or are to be quantized at load
    (no config: ``quantization="fp8"`` on an unquantized checkpoint). Checks what is supported."""
    if qc is None:
        return False
    if qc.get("weight_block_size"):
        raise NotImplementedError(f"FP8 checkpoints with block-wise scales (weight_block_size="
                                  f"{qc['weight_block_size']}) are not supported; per-tensor scales are.")
    if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
        raise ValueError(f"Unknown FP8 activation_scheme {qc['activation_scheme']!r}.")
    return True


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scale per row) for ``w (N, K)``."""
    amax = w.float().abs().amax(dim=1).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class Fp8LinearMethod(QuantMethod):
    def __init__(self, serialized: bool):
        self.serialized = serialized

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if not self.serialized:   # the checkpoint's own weight, quantized after loading
            layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            return
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8), requires_grad=False)
        # one scale a row; the checkpoint's per-tensor scales fill their shard's rows
        layer.weight_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        layer.weight_scale.input_dim = None
        layer.input_scale = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        layer.input_scale.input_dim = None
        layer.input_scale.optional = True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            weight, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        elif hasattr(layer, "input_scale"):
            del layer.input_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        w = layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype)[:, None]
        return F.linear(x, w, bias)
