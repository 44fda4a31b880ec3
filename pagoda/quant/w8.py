"""8-bit weights, FP8 (E4M3) or INT8, with a float32 scale per output row:
``W[n, k] = w[n, k] * weight_scale[n]``, or per block of weights. Half of bf16's bytes.

Three ways in, as in vLLM:
- vLLM's FP8 checkpoints (``quant_method: "fp8"``): FP8 ``weight`` and a per-tensor
  ``weight_scale``; fused q/k/v and gate/up layers get one per shard, and each fills its rows of
  the per-row scale, so nothing is requantized. Or, with ``weight_block_size [bn, bk]`` (DeepSeek's
  and Qwen3's FP8 releases), a scale per block of bn x bk weights, ``weight_scale_inv
  (ceil(N / bn), ceil(K / bk))`` (the factor that dequantizes, despite its name), kept as it is:
  ``W[n, k] = w[n, k] * weight_scale_inv[n // bn, k // bk]``;
- compressed-tensors checkpoints (``quant_method: "compressed-tensors"``, llm-compressor's
  output) of symmetric 8-bit weights, INT8 (the W8A8 scheme) or FP8, with per-channel
  ``(N, 1)`` or per-tensor scales, or FP8 with a scale per block (FP8_BLOCK: ``block_structure``,
  the scales named ``weight_scale``), taken as vLLM's block-wise ones;
- ``quantization="fp8"`` on an unquantized checkpoint: its weights quantized at load, a scale
  per row (its largest magnitude over E4M3's largest value, 448).

The matmul, by where it runs (block scales: the W8A16 kernel at up to ``triton_w4a16.MAX_M``
rows on the GPU, each block's scale applied to its tile as it is converted; else dequantized):
- on the GPU at one row (a batch-1 decode step), the weight is read as it is stored and converted
  in registers (``triton_linear``'s slab kernel, its row sums scaled once): half the bytes of bf16;
- on the GPU with half-precision activations and INT8 weights from two rows up, W8A8 on INT8
  tensor cores: each row of x quantized to INT8 over its own scale (dynamic per-token,
  ``triton_ops.per_token_quant``), exact int32 sums, both scales applied to them in the
  kernel's epilogue (``triton_int8_mm``);
- on the GPU with FP8 weights, at up to ``W8A16_MAX_M`` rows (under bf16 activations) or
  ``triton_w4a16.MAX_M`` (under float16), W8A16: the weight converted in registers by the W4A16
  kernel (``w8a16_linear``), the activations as they are;
- on the GPU with bf16 activations and FP8 weights (Ada, Hopper and later) above that, W8A8:
  each row of x quantized to FP8 the same way, then FP8 tensor cores with both scales applied to
  the float32 result (``torch._scaled_mm``, row-wise scales). A checkpoint's static
  ``input_scale`` is read and not used: a scale per token fits each token's range at least as
  well as one for all;
- elsewhere (CPUs, float32 activations, FP8 weights under float16 over ``triton_w4a16.MAX_M``
  rows) the weight is dequantized (``w * scale`` in the model's dtype) for a dense matmul.

Where W8A8 runs, the RMSNorm or SiLU-and-mul kernel that computes the matmul's input writes its
rows already quantized (``input_quant`` tells it the dtype; ``layernorm.QuantizesForNext``): no
launch of its own for the quantization, and one write and read of the rows fewer. Only o_proj,
after the attention, quantizes its own input.
"""
import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels.reference import QuantizedInput, dequantize_blocks
from pagoda.quant.base import QuantMethod, compressed_tensors_group, lazy_parameter, triton_kernels

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max   # 448
# Batches of FP8 weights under bf16 activations up to this many rows take the W8A16 kernel,
# larger ones W8A8. Measured on the H200 (BENCHMARKS.md, fifteenth session; Llama-3-8B's four
# decode matrices): W8A16 145-148 us at 2-8 rows against W8A8's 152-154, even at 16, then
# W8A8 ahead (32 rows: 149 against 187; 64: 144 against 213). W2 Llama-3-8B batch 64: 5.98 ms a
# step with W8A8, 8.36 with W8A16.
W8A16_MAX_M = 8


def weight_dtype(method: str, qc: dict | None) -> torch.dtype | None:
    """The checkpoint's 8-bit weight dtype, or None for weights to quantize at load (``fp8`` on
    an unquantized checkpoint). Checks that the scheme is one this loader reads."""
    if qc is None:
        return None
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"An FP8 checkpoint's weight_block_size must be two positive integers [block_n, "
                             f"block_k], got {block!r}.")
        if block is not None and qc.get("activation_scheme", "dynamic") != "dynamic":
            raise NotImplementedError(f"FP8 checkpoints with block-wise scales and activation_scheme="
                                      f"{qc['activation_scheme']!r} are not supported (vLLM's neither): "
                                      "block-wise checkpoints quantize activations dynamically.")
        return FP8
    group, weights, fmt = compressed_tensors_group(qc)
    if fmt not in ("int-quantized", "float-quantized", "naive-quantized"):
        raise NotImplementedError(f"compressed-tensors checkpoints of format {fmt!r} are not supported; 8-bit "
                                  "weights (int- or float-quantized) or packed integer weights (pack-quantized) are.")
    scheme = (weights.get("num_bits"), weights.get("symmetric", True), weights.get("strategy"))
    block = weights.get("block_structure")
    blocks = scheme == (8, True, "block") and weights.get("type") == "float" and block is not None and len(block) == 2 \
        and all(isinstance(b, int) and b > 0 for b in block)
    if (scheme not in ((8, True, "channel"), (8, True, "tensor")) and not blocks) \
            or "Linear" not in group.get("targets", []):
        raise NotImplementedError(f"compressed-tensors weights {weights} targeting {group.get('targets')} are "
                                  "not supported; symmetric 8-bit weights of every Linear, per channel or per "
                                  "tensor (or FP8 in blocks), are.")
    return torch.int8 if weights.get("type") == "int" else FP8


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, float32 scale ``(N, 1)``) for ``w (N, K)``, a scale per row."""
    amax = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    # (a tensor divisor: over a python float, CUDA multiplies by its reciprocal, which rounds
    # differently from the CPU's division and gave a GPU model other scales than its CPU twin)
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def block_size(method: str, qc: dict | None) -> tuple[int, int] | None:
    """An FP8 checkpoint's (block_n, block_k) of weights that share a scale, if it has blocks:
    vLLM's ``weight_block_size``, or compressed-tensors' ``block_structure`` (FP8_BLOCK)."""
    if method == "fp8":
        block = (qc or {}).get("weight_block_size")
    else:
        weights = compressed_tensors_group(qc)[1]
        block = weights.get("block_structure") if weights.get("strategy") == "block" else None
    return None if block is None else tuple(block)


def block_scale_name(method: str) -> str:
    """What a block-wise checkpoint calls its scales: ``weight_scale_inv`` (DeepSeek's and vLLM's
    name, a dequantizing factor despite it), or compressed-tensors' ``weight_scale``."""
    return "weight_scale_inv" if method == "fp8" else "weight_scale"


class W8LinearMethod(QuantMethod):
    def __init__(self, dtype: torch.dtype | None, block: tuple[int, int] | None = None,
                 scale_name: str = "weight_scale_inv"):
        self.dtype = dtype      # the checkpoint's weight dtype; None: quantize at load
        self.block = block      # weights that share a scale (block-wise FP8), else a scale a row
        self.scale_name = scale_name    # (the block scales' name in the checkpoint; held as weight_scale_inv)
        self.quantizes_input = block is None   # (block scales: W8A16 or dequantized, never W8A8)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        if self.dtype is None:   # the checkpoint's own weight, quantized after loading
            layer.weight = lazy_parameter((out_features, in_features), dtype)
            return
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=self.dtype), requires_grad=False)
        if self.block is not None:
            bn, bk = self.block
            if getattr(layer, "tp_size", 1) > 1 and in_features % bk:
                raise ValueError(f"Block-wise FP8: a tensor-parallel shard of {in_features} input features is not "
                                 f"a whole number of the checkpoint's {bk}-wide blocks; use a tensor_parallel_size "
                                 "whose shards fall on block boundaries.")
            p = nn.Parameter(torch.empty(-(-out_features // bn), -(-in_features // bk), dtype=torch.float32),
                             requires_grad=False)
            # (split with the weight, in blocks: _narrow_output divides by output_pack)
            p.output_pack, p.input_pack = bn, bk
            if self.scale_name != "weight_scale_inv":
                p.checkpoint_name = self.scale_name
            layer.weight_scale_inv = p
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
        elif self.block is None:
            del layer.input_scale

    def path(self, layer: nn.Module, x: torch.Tensor) -> str:
        """Which matmul runs ``x`` (module docstring; from shapes only, the same at CUDA-graph
        capture and replay): "w8a16" or "dense" with block scales, else "slab", "int8", "w8a16",
        "fp8" (W8A8 on FP8 tensor cores) or "dense"."""
        if self.block is not None:
            return "w8a16" if x.is_cuda and triton_kernels("triton_w4a16").use_w4a16(x) else "dense"
        if not x.is_cuda:
            return "dense"
        if triton_kernels("triton_linear").use_small_m_linear(x, layer.weight):
            return "slab"
        if use_int8_mm(x, layer.weight):
            return "int8"
        tensor_cores = use_scaled_mm(x, layer.weight)
        if triton_kernels("triton_w4a16").use_w4a16(x) and not (tensor_cores and x.shape[0] > W8A16_MAX_M):
            return "w8a16"
        return "fp8" if tensor_cores else "dense"

    def input_quant(self, layer: nn.Module, x: torch.Tensor) -> torch.dtype | None:
        return {"int8": torch.int8, "fp8": FP8}.get(self.path(layer, x))

    def apply(self, layer: nn.Module, x, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, QuantizedInput):   # (rows the kernel before quantized, as input_quant asked)
            path = "int8" if x.q.dtype == torch.int8 else "fp8"
        else:
            path = self.path(layer, x)
        if path == "int8":
            return int8_linear(x, layer.weight, layer.weight_scale, bias)
        if path == "fp8":
            return fp8_linear(x, layer.weight, layer.weight_scale, bias)
        if path == "slab":
            return triton_kernels("triton_linear").small_m_linear(x, layer.weight, bias, layer.weight_scale)
        if self.block is not None:
            if path == "w8a16":
                return triton_kernels("triton_w4a16").w8a16_linear(x, layer.weight, layer.weight_scale_inv, bias,
                                                                   self.block)
            return F.linear(x, dequantize_blocks(layer.weight, layer.weight_scale_inv, self.block, x.dtype), bias)
        if path == "w8a16":
            return triton_kernels("triton_w4a16").w8a16_linear(x, layer.weight, layer.weight_scale, bias)
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale.to(x.dtype), bias)


@functools.cache
def _fp8_tensor_cores(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def use_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` runs this matmul (from shapes only: the same choice at CUDA-graph
    capture and replay). Row-wise scaled ``torch._scaled_mm`` writes only bf16, and wants K and N
    in multiples of 16."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and x.dtype == torch.bfloat16 and weight.dtype == FP8
            and x.stride(1) == 1 and x.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0
            and _fp8_tensor_cores(torch.cuda.current_device() if x.device.index is None else x.device.index))


def quantized_input(x, dtype: torch.dtype) -> QuantizedInput:
    """``x``'s rows quantized per token to ``dtype``, unless the kernel before did it already."""
    if isinstance(x, QuantizedInput):
        return x
    from pagoda.kernels.triton_ops import per_token_quant
    return QuantizedInput(*per_token_quant(x, dtype), x.dtype)


def fp8_linear(x, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 on FP8 tensor cores: ``reference.scaled_mm`` of x quantized per token (``x``: the
    activations, or their ``QuantizedInput``)."""
    x = quantized_input(x, FP8)
    return torch._scaled_mm(x.q, weight.t(), scale_a=x.scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=x.dtype)


def use_int8_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``int8_linear`` runs this matmul (from shapes only): INT8 weights under half-precision
    activations (the caller sends one row to the slab kernel first)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] > 0 and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == torch.int8 and x.stride(1) == 1)


def int8_linear(x, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A8 on INT8 tensor cores: ``reference.scaled_mm`` of x quantized per token to INT8 (or its
    ``QuantizedInput``), its sums exact in int32, scaled in float32 and rounded once, in one kernel."""
    from pagoda.kernels.triton_int8_mm import int8_mm
    x = quantized_input(x, torch.int8)
    return int8_mm(x.q, x.scale, weight, weight_scale, bias, x.dtype)
