"""8-bit weights, FP8 (E4M3) or INT8, with a float32 scale per output row:
``W[n, k] = w[n, k] * weight_scale[n]``. Half of bf16's bytes; activations stay in the model's
dtype (W8A16: a checkpoint's activation scales are read and not used).

Three ways in, as in vLLM:
- vLLM's FP8 checkpoints (``quant_method: "fp8"``): FP8 ``weight`` and a per-tensor
  ``weight_scale``; fused q/k/v and gate/up layers get one per shard, and each fills its rows of
  the per-row scale, so nothing is requantized;
- compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, llm-compressor's
  output) of symmetric 8-bit weights, INT8 (the W8A8 scheme) or FP8, with per-channel
  ``(N, 1)`` or per-tensor scales;
- ``quantization="fp8"`` on an unquantized checkpoint: its weights quantized at load, a scale
  per row (its largest magnitude over E4M3's largest value, 448).

The matmul dequantizes the weight (``w * scale`` in the model's dtype) and runs a dense matmul:
correct on every device; 8-bit tensor-core paths (``torch._scaled_mm``) are not written yet.
"""
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quant.base import QuantMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448


def weight_dtype(method: str, qc: dict | None) -> torch.dtype | None:
    """The checkpoint's 8-bit weight dtype, or None for weights to quantize at load (``fp8`` on
    an unquantized checkpoint). Checks that the scheme is one this loader reads."""
    if qc is None:
        return None
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise NotImplementedError(f"FP8 checkpoints with block-wise scales (weight_block_size="
                                      f"{qc['weight_block_size']}) are not supported; per-tensor scales are.")
        return FP8
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized") or len(groups) != 1:
        raise NotImplementedError(f"compressed-tensors checkpoints of format {fmt!r} with {len(groups)} config "
                                  "groups are not supported; one group of 8-bit weights (int- or float-quantized) is.")
    group, weights = groups[0], groups[0].get("weights") or {}
    scheme = (weights.get("num_bits"), weights.get("symmetric", True), weights.get("strategy"))
    if scheme not in ((8, True, "channel"), (8, True, "tensor")) or "Linear" not in group.get("targets", []):
        raise NotImplementedError(f"compressed-tensors weights {weights} targeting {group.get('targets')} are "
                                  "not supported; symmetric 8-bit weights of every Linear, per channel or per "
                                  "tensor, are.")
    ignored = [name for name in qc.get("ignore", []) if name != "lm_head"]   # (the LM head is never quantized)
    if ignored:
        raise NotImplementedError(f"compressed-tensors checkpoints that leave layers unquantized ({ignored}) are "
                                  "not supported.")
    return torch.int8 if weights.get("type") == "int" else FP8


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale ``(N, 1)``) for ``w (N, K)``, a scale per row."""
    amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    # (a tensor divisor: over a python float, CUDA multiplies by its reciprocal, which rounds
    # differently from the CPU's division and gave a GPU model other scales than its CPU twin)
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class W8LinearMethod(QuantMethod):
    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype      # the checkpoint's weight dtype; None: quantize at load

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.dtype or dtype),
                                    requires_grad=False)
        if self.dtype is None:   # the checkpoint's own weight, quantized after loading
            return
        # A scale a row ((N, 1), as compressed-tensors stores per-channel scales); a per-tensor
        # scale fills its shard's rows. Activation scales are read and not used (optional).
        for name in ("weight_scale", "input_scale"):
            p = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32), requires_grad=False)
            p.input_dim, p.optional = None, name == "input_scale"
            setattr(layer, name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.dtype is None:
            weight, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        else:
            del layer.input_scale

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype), bias)
