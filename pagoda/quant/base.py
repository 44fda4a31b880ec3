"""The quantization plug-in interface. A linear layer owns a QuantMethod that creates its
parameters, fixes them up after loading, and runs the matmul. Unquantized weights are the
first method, packed integers (GPTQ / AWQ / compressed-tensors pack-quantized, ``int4.py``) and
8-bit FP8/INT8 (``w8.py``) the others. Which one a model gets: ``resolve_quantization`` (and,
for layers a quantized checkpoint stores unquantized, ``model.loader.leave_unquantized``)."""
import functools
import importlib

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def triton_kernels(module: str):
    """``pagoda.kernels.<module>``, imported on first CUDA use: importing triton is slow, and it
    fixes for the whole process whether kernels run compiled or in the CPU interpreter."""
    return importlib.import_module(f"pagoda.kernels.{module}")


# float32 matmuls of this many rows on the CPU run as ``(weight @ x.T).T``: for ``x @ weight.T``
# at 2-64 rows MKL's sgemm reads the weight at a third to two thirds of the rate it reaches the
# other way round (the development machine, cold weights: SmolLM2's LM head at 2 rows 28.0 ->
# 9.2 ms, at 24 rows 76.7 -> 44.4, its gate_up at 2 rows 1.96 -> 0.69 ms; one row is a
# matrix-vector product either way, and at 64 rows only the LM head still gains).
CPU_TRANSPOSED_ROWS = (2, 64)


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through the batch-1 Triton kernel on the GPU where it beats cuBLAS, and
    transposed on the CPU where that reads the weight faster."""
    if x.is_cuda:
        out = triton_kernels("triton_linear").linear(x, weight, bias)
        if out is not None:
            return out
    elif (x.dim() == 2 and CPU_TRANSPOSED_ROWS[0] <= x.shape[0] <= CPU_TRANSPOSED_ROWS[1]
          and x.dtype == weight.dtype == torch.float32):
        out = torch.mm(weight, x.t()).t().contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, weight, bias)


def lazy_parameter(shape: tuple, dtype: torch.dtype) -> nn.Parameter:
    """A parameter that takes no memory until the loader puts its first tensor in (it lives on
    the meta device till then; ``model.loader.materialize`` gives it memory on the device the
    model is built on), for what ``process_weights_after_loading`` replaces: GGUF's decomposed
    blocks, weights quantized at load. The loader processes each layer once it is whole, so one
    layer's are held at a time, not the model's."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    p.load_device = torch.get_default_device()
    return p


class QuantMethod:
    # Whether ``input_quant`` can ever name a dtype: the layers before a matmul ask it only then
    # (no Python work a forward for the methods that never quantize their input)
    quantizes_input = False

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype) -> None:
        raise NotImplementedError

    def input_quant(self, layer: nn.Module, x: torch.Tensor) -> torch.dtype | None:
        """The dtype ``apply`` quantizes x's rows to, per token, before its matmul (W8A8), if it
        does: the kernel that computes x may then hand them over quantized
        (``reference.QuantizedInput``), which ``apply`` takes in x's place."""
        return None

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


INT4_METHODS = ("gptq", "awq")
# "fp8" also quantizes an unquantized checkpoint at load ("online"), as in vLLM
METHODS = INT4_METHODS + ("fp8", "compressed-tensors", "gguf")
PLANNED_METHODS = ("bitsandbytes",)
# vLLM's names for its faster kernels of the same checkpoints; W8A8 checkpoints are compressed-tensors
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "w8a8": "compressed-tensors"}


def _known(name: str, from_checkpoint: bool = False) -> str:
    """The method's canonical name, or the error for one pagoda does not load (a checkpoint's
    method it does not know is unsupported; a requested one, a typo)."""
    name = ALIASES.get(name.lower(), name.lower())
    if name in METHODS:
        return name
    if name in PLANNED_METHODS:
        whose = " (the checkpoint's)" if from_checkpoint else ""
        raise NotImplementedError(f"quantization={name!r}{whose} is not implemented yet; load a GPTQ, AWQ, FP8 "
                                  "or compressed-tensors 8-bit checkpoint, unquantized (bf16/fp16) weights or a "
                                  "GGUF file.")
    if from_checkpoint:
        raise NotImplementedError(f"The checkpoint is quantized with {name!r}, which pagoda does not load; "
                                  f"supported: {list(METHODS)}.")
    raise ValueError(f"Unknown quantization method {name!r}; known: {list(METHODS + PLANNED_METHODS)}.")


def compressed_tensors_group(qc: dict) -> tuple[dict, dict, str | None]:
    """A compressed-tensors config's one config group: (the group, its ``weights`` scheme, its
    format: the group's own, else the config's). pagoda reads one group of every Linear."""
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise NotImplementedError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                                  "supported; one group of 8-bit or packed integer weights is.")
    group = groups[0]
    return group, group.get("weights") or {}, group.get("format") or qc.get("format")


def check_quantization_name(quantization: str | None) -> None:
    """Fail on a bad ``quantization`` argument before anything is loaded."""
    if quantization is not None:
        _known(quantization)


def resolve_quantization(requested: str | None, checkpoint_config: dict | None, path: str
                         ) -> tuple[str | None, dict | None]:
    """(method, the checkpoint's quantization config) from the user's ``quantization`` and what
    the checkpoint says. As in vLLM, a quantized checkpoint is loaded as such unasked, and a
    named method must match it."""
    found = None
    if checkpoint_config is not None:
        found = _known(str(checkpoint_config.get("quant_method", "")), from_checkpoint=True)
    if requested is None:
        return found, checkpoint_config
    requested = _known(requested)
    if found is None and requested == "fp8":
        return requested, None             # quantized at load
    if requested == "gguf":                # (a GGUF file's own block types, kept packed)
        if not path.endswith(".gguf"):
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized weights; {path} is no .gguf file.")
        return requested, None
    if found is None:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way, but {path} has no "
                         "quantization config (config.json's 'quantization_config' or a quantize_config.json).")
    if found != requested:
        raise ValueError(f"quantization={requested!r} does not match the checkpoint's {found!r} ({path}); "
                         "leave quantization unset to load the checkpoint as it is.")
    return found, checkpoint_config


def get_quant_method(quantization: str | None, checkpoint_config: dict | None = None) -> QuantMethod:
    if quantization is None:
        return UnquantizedLinearMethod()
    name = _known(quantization)
    from pagoda.quant.int4 import GGUFLinearMethod, Int4Config, Int4LinearMethod, packed_compressed_tensors
    if name == "gguf":
        return GGUFLinearMethod()
    if name == "fp8" or (name == "compressed-tensors" and not packed_compressed_tensors(checkpoint_config)):
        from pagoda.quant.w8 import W8LinearMethod, block_scale_name, block_size, weight_dtype
        return W8LinearMethod(weight_dtype(name, checkpoint_config), block_size(name, checkpoint_config),
                              block_scale_name(name))
    return Int4LinearMethod(Int4Config.from_checkpoint(name, checkpoint_config or {}))
