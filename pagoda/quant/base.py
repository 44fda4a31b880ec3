"""The quantization plug-in interface. A linear layer owns a QuantMethod that creates its
parameters, fixes them up after loading, and runs the matmul. Unquantized weights are the
first method; FP8/INT8/GPTQ/AWQ plug in beside it."""
import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _triton_linear():
    from pagoda.kernels import triton_linear   # on first CUDA use: importing triton is slow
    return triton_linear


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the batch-1 Triton kernel on the GPU where it beats cuBLAS."""
    if x.is_cuda:
        out = _triton_linear().linear(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


class QuantMethod:
    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(QuantMethod):
    def create_weights(self, layer, in_features, out_features, dtype):
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype),
                                    requires_grad=False)

    def apply(self, layer, x, bias):
        return dense_linear(x, layer.weight, bias)


PLANNED_METHODS = ("fp8", "w8a8", "gptq", "awq")


def get_quant_method(quantization: str | None) -> QuantMethod:
    if quantization is None:
        return UnquantizedLinearMethod()
    if quantization in PLANNED_METHODS:
        raise NotImplementedError(f"quantization={quantization!r} is not implemented yet; "
                                  "load unquantized (bf16/fp16) weights or a GGUF file.")
    raise ValueError(f"Unknown quantization method {quantization!r}; known: {list(PLANNED_METHODS)}.")
