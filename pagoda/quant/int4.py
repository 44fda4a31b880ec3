"""GPTQ, AWQ and compressed-tensors' packed weights (W4A16: 4-bit, or 8-bit, integer weights in
groups along the input, each group with a scale and a zero point; activations stay in the model's
dtype). Each format is loaded as it is downloaded (AutoGPTQ's / GPTQModel's, AutoAWQ's and
llm-compressor's ``pack-quantized`` layouts: ``Int4Config.checkpoint_tensors``) and repacked at load
into one layout, so that one dequantization serves them all:

- ``qweight`` int32 ``(K / pack, N)``: packed along the input dim, value j of a word at bits
  ``bits * j`` (GPTQ's own layout; AWQ's is packed along the output dim, its columns
  interleaved; compressed-tensors' is GPTQ's transposed, ``(N, K / pack)``);
- ``scales`` ``(groups, N)`` in the model's dtype;
- ``zeros`` ``(groups, N)`` in the model's dtype: the true zero points (GPTQ's v1 checkpoints
  store them less one; compressed-tensors stores values offset by ``2**(bits - 1)``, so a
  symmetric checkpoint's zero point is that offset, and an asymmetric one stores its own);
- ``g_idx`` int32 ``(K,)``: each input channel's group (act-order permutes them; for the
  others it is ``k // group_size``).

``W[k, n] = (q[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n]``, and the layer computes
``x @ W``. On the GPU, batches of up to ``triton_w4a16.MAX_M`` rows (decode steps) run one
Triton kernel that dequantizes tiles in registers (``pagoda.kernels.triton_w4a16``); larger
batches (prefill, where the matmul's work dwarfs it) and every other device dequantize the whole
weight, then run a dense matmul.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quant.base import QuantMethod, compressed_tensors_group, lazy_parameter, triton_kernels

# AWQ's order of the 8 columns in a packed word: slot i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
NAMES = {"gptq": "GPTQ", "awq": "AWQ", "compressed-tensors": "compressed-tensors pack-quantized", "gguf": "GGUF"}


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor a checkpoint stores for a quantized ``(K, N)`` weight, and where the output
    and input features lie in it (``n_dim`` / ``k_dim``; None: the same for every output, or not
    split along the input) and how many of them one of its elements covers (``n_pack`` /
    ``k_pack``: packed values, or a group's inputs), so that loaders can cut shards of it."""
    shape: tuple[int, ...]
    dtype: torch.dtype | None   # None: the model's
    n_dim: int | None
    n_pack: int
    k_dim: int | None
    k_pack: int
    optional: bool = False


def packed_compressed_tensors(qc: dict | None) -> bool:
    """A compressed-tensors config of packed integer weights (W4A16 / W8A16), not 8-bit ones."""
    return compressed_tensors_group(qc or {})[2] == "pack-quantized"


@dataclass(frozen=True)
class Int4Config:
    method: str             # "gptq", "awq" or "compressed-tensors"
    bits: int
    group_size: int         # -1: one group over the whole input (per-channel)
    desc_act: bool = False  # act-order: g_idx permuted
    zeros_minus_one: bool = False   # GPTQ v1 checkpoints store each zero point less one
    symmetric: bool = False         # compressed-tensors: no zero points stored (each is the offset)

    @classmethod
    def from_checkpoint(cls, method: str, qc: dict) -> "Int4Config":
        """From a checkpoint's quantization config (config.json's ``quantization_config`` or a
        ``quantize_config.json``), checking what this loader supports."""
        if method == "awq":
            bits = qc.get("bits", qc.get("w_bit", 4))
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ checkpoints of version {version!r} are not supported; only 'gemm' "
                                 "(AutoAWQ's default) is.")
            if not qc.get("zero_point", True):
                raise ValueError("AWQ checkpoints without zero points are not supported.")
            group = qc.get("group_size", qc.get("q_group_size", 128))
            config = cls("awq", bits, group)
        elif method == "compressed-tensors":
            config = cls._from_compressed_tensors(qc)
        else:
            bits = qc.get("bits", 4)
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; expected 'gptq' or 'gptq_v2'.")
            config = cls("gptq", bits, qc.get("group_size", 128), bool(qc.get("desc_act", False)),
                         zeros_minus_one=fmt == "gptq")
        supported = (4,) if method == "awq" else (4, 8)
        if config.bits not in supported:
            raise ValueError(f"{config.name} checkpoints of {config.bits} bits are not supported; "
                             f"supported: {supported}.")
        return config

    @classmethod
    def _from_compressed_tensors(cls, qc: dict) -> "Int4Config":
        """llm-compressor's W4A16 / W8A16 schemes: one group of integer weights packed in int32
        words, in groups along the input or a scale a row, activations unquantized."""
        group, w, _ = compressed_tensors_group(qc)
        strategy = w.get("strategy")
        if (w.get("type", "int") != "int" or strategy not in ("group", "channel") or group.get("input_activations")
                or "Linear" not in group.get("targets", [])):
            raise NotImplementedError(
                f"compressed-tensors pack-quantized weights {w} with input activations "
                f"{group.get('input_activations')} targeting {group.get('targets')} are not supported; integer "
                "weights of every Linear in groups or per channel, activations unquantized (W4A16 / W8A16), are.")
        group_size = w.get("group_size") if strategy == "group" else -1
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise ValueError(f"A compressed-tensors group strategy needs a positive group_size, got {group_size!r}.")
        return cls("compressed-tensors", w.get("num_bits"), group_size, desc_act=w.get("actorder") == "group",
                   symmetric=bool(w.get("symmetric", True)))

    @property
    def pack(self) -> int:
        return 32 // self.bits

    @property
    def name(self) -> str:
        return NAMES[self.method]

    @property
    def act_order(self) -> str:
        """For messages: " with act-order (its config key)", or "" without."""
        return f" with act-order ({'actorder' if self.method == 'compressed-tensors' else 'desc_act'})" \
            if self.desc_act else ""

    def checkpoint_tensors(self, k: int, n: int) -> dict[str, CheckpointTensor]:
        """What the checkpoint stores for a ``(K, N)`` weight (a tensor-parallel rank's slice:
        groups, when the input is split, are whole), by the format's names."""
        p, group = self.pack, k if self.group_size == -1 else self.group_size
        groups, k_groups = -(-k // group), None if self.group_size == -1 else 0   # (per channel: not split)
        t = CheckpointTensor
        if self.method == "gguf":   # (gguf_quants.decompose's parts: a byte a weight, a scale and zero a group)
            return {"gguf_q": t((n, k), torch.uint8, 0, 1, 1, 1), "gguf_scale": t((n, groups), None, 0, 1, 1, group),
                    "gguf_zero": t((n, groups), None, 0, 1, 1, group)}
        if self.method == "compressed-tensors":      # (N, K) tensors: GPTQ's transposed
            out = {"weight_packed": t((n, k // p), torch.int32, 0, 1, 1, p),
                   "weight_scale": t((n, groups), None, 0, 1, None if k_groups is None else 1, group)}
            if not self.symmetric:
                out["weight_zero_point"] = t((n // p, groups), torch.int32, 0, p, out["weight_scale"].k_dim, group)
            out["weight_g_idx"] = t((k,), torch.int32, None, 1, 0, 1, optional=not self.desc_act)
            return out
        if self.method == "gptq":
            out = {"qweight": t((k // p, n), torch.int32, 1, 1, 0, p),
                   "g_idx": t((k,), torch.int32, None, 1, 0, 1, optional=not self.desc_act)}
        else:
            out = {"qweight": t((k, n // p), torch.int32, 1, p, 0, 1)}
        out["qzeros"] = t((groups, n // p), torch.int32, 1, p, k_groups, group)
        out["scales"] = t((groups, n), None, 1, 1, k_groups, group)
        return out

    def repack(self, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                          torch.Tensor | None]:
        """A layer's checkpoint tensors (``checkpoint_tensors``' names; several experts' stacked
        along a first dimension) -> pagoda's layout (module docstring): ``(qweight (..., K / pack,
        N), scales (..., groups, N), zeros (..., groups, N)`` in the scales' dtype``, g_idx)``,
        g_idx the act-order one (checked), else None (groups by the rule)."""
        if self.method == "compressed-tensors":
            qweight = t["weight_packed"].transpose(-1, -2).contiguous()
            scales = t["weight_scale"].transpose(-1, -2).contiguous()
            if self.symmetric:
                zeros = torch.full_like(scales, 1 << (self.bits - 1))
            else:   # (packed along N, as GPTQ packs inputs)
                zp = t["weight_zero_point"]
                zeros = unpack_rows(zp.flatten(0, -2), self.bits).view(*zp.shape[:-2], -1, zp.shape[-1])
                zeros = zeros.transpose(-1, -2).to(scales.dtype).contiguous()
            g_idx = t["weight_g_idx"]
        else:
            order = AWQ_ORDER if self.method == "awq" else None
            qweight, scales, n = t["qweight"], t["scales"], t["scales"].shape[-1]
            zeros = unpack_cols(t["qzeros"].flatten(0, -2), self.bits, order) + int(self.zeros_minus_one)
            zeros = zeros.view(scales.shape).to(scales.dtype)
            if self.method == "awq":
                words = pack_rows(unpack_cols(qweight.flatten(0, -2), self.bits, order), self.bits)
                qweight = words.view(*qweight.shape[:-2], -1, n)
            g_idx = t.get("g_idx")
        if not self.desc_act:
            return qweight, scales, zeros, None
        groups = scales.shape[-2]
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"Corrupt {self.name} checkpoint: a g_idx entry is outside its layer's {groups} groups.")
        return qweight, scales, zeros, g_idx


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``(R, C)`` holding ``32 / bits`` values a word, value j at bits ``bits * j`` ->
    int32 ``(R * 32 / bits, C)``, row ``r * pack + j`` from word ``r``'s value j."""
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 ``(R, C)`` packed along columns -> int32 ``(R, C * 32 / bits)``; slot i of word c
    holds column ``c * pack + order[i]`` (``order`` None: ``i``)."""
    values = unpack_rows(packed.t().contiguous(), bits).t()          # (R, C * pack), slot order
    if order is not None:
        pack = 32 // bits
        inverse = torch.tensor(order, device=packed.device).argsort()   # column j sits in slot inverse[j]
        values = values.reshape(values.shape[0], -1, pack)[:, :, inverse].reshape(values.shape[0], -1)
    return values.contiguous()


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``unpack_rows``."""
    pack = 32 // bits
    v = values.to(torch.int64).reshape(-1, pack, values.shape[1])
    shifts = torch.arange(0, 32, bits, device=values.device, dtype=torch.int64)
    words = (v << shifts[None, :, None]).sum(1)
    return (words - (words >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32)   # two's complement


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor,
               bits: int) -> torch.Tensor:
    """The ``(K, N)`` weight in the scales' dtype, from the repacked layout (module docstring)."""
    q = unpack_rows(qweight, bits).to(scales.dtype)
    g = g_idx.long()
    return (q - zeros[g]) * scales[g]


class Int4LinearMethod(QuantMethod):
    """Creates each linear layer's tensors as the checkpoint holds them (the layer's weight
    loaders narrow them along ``output_dim`` / ``input_dim``, in units of their packing), then
    repacks them (``process_weights_after_loading``)."""
    int_zeros = True    # the zero points are integers (the kernels subtract them exactly)

    def __init__(self, config: Int4Config):
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        c = self.config
        k, n = in_features, out_features
        group = k if c.group_size == -1 else c.group_size
        # (GPTQ's and compressed-tensors' last group may be partial; AutoAWQ requires whole groups)
        if (c.method == "awq" and k % group) or k % c.pack or n % c.pack:
            raise ValueError(f"A {k} x {n} linear layer cannot hold {c.name} weights in groups of {group} packed "
                             f"{c.pack} a word.")
        if getattr(layer, "tp_size", 1) > 1 and (k % group or c.desc_act):
            # (a rank's slice of the input must hold whole groups, in the checkpoint's order)
            raise ValueError(f"{c.name} weights in groups of {group}{c.act_order} "
                             f"do not split over tensor_parallel_size={layer.tp_size} (a {k}-wide input slice per "
                             "rank); use a smaller tensor_parallel_size or a checkpoint without act-order.")
        layer.group_size = group
        for name, spec in c.checkpoint_tensors(k, n).items():
            # (GGUF's parts, a byte a weight, are repacked to half of it: allocated as they load)
            p = lazy_parameter(spec.shape, spec.dtype or dtype) if c.method == "gguf" else \
                nn.Parameter(torch.empty(spec.shape, dtype=spec.dtype or dtype), requires_grad=False)
            p.output_dim, p.output_pack, p.input_dim, p.input_pack = spec.n_dim, spec.n_pack, spec.k_dim, spec.k_pack
            p.optional = spec.optional
            setattr(layer, name, p)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        c = self.config
        k = layer.in_features
        loaded = {name: layer._parameters.pop(name).data for name in c.checkpoint_tensors(k, layer.out_features)}
        qweight, scales, zeros, g_idx = c.repack(loaded)
        if g_idx is None:   # by the rule (GPTQ checkpoints store a g_idx even without act-order; the others none)
            g_idx = torch.arange(k, dtype=torch.int32, device=qweight.device) // layer.group_size
        layer.bits = c.bits
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("g_idx", g_idx)):
            setattr(layer, name, nn.Parameter(t, requires_grad=False))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        group_size = None if self.config.desc_act else layer.group_size
        weights = layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.bits
        if not x.is_cuda:
            return F.linear(x, dequantize(*weights).t(), bias)
        w4a16 = triton_kernels("triton_w4a16")
        if w4a16.use_w4a16(x, w4a16.PACKED_MAX_M):   # decode batches: dequantized in registers
            return w4a16.w4a16_linear(x, *weights, bias, group_size, self.int_zeros)
        # larger ones: the dense weight written once, for cuBLAS
        return F.linear(x, w4a16.dequantize(*weights, group_size, x.dtype, self.int_zeros), bias)


class GGUFLinearMethod(Int4LinearMethod):
    """A GGUF file's block types kept packed (``quantization="gguf"``): each layer loads
    ``gguf_quants.decompose``'s parts of its tensors (a byte a weight; a scale and a float zero
    point a group of 16, in the model's dtype) and repacks them into the layout above: 4-bit
    words where every value fits in 4 bits (Q2_K, Q3_K, Q4_K, Q4_0, Q4_1), else 8-bit (Q5, Q6_K,
    Q8_0, or a fused layer with one such part), in groups of 32 where the scales and zeros of
    each pair of groups are equal (the 32-value blocks and sub-blocks), else of 16. The zero
    points of the types with a minimum (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) have fractions."""
    int_zeros = False

    def __init__(self):
        from pagoda.model.gguf_quants import GROUP
        super().__init__(Int4Config("gguf", 8, GROUP))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale, zero = (layer._parameters.pop(name).data for name in ("gguf_q", "gguf_scale", "gguf_zero"))
        qweight, scales, zeros, layer.bits, layer.group_size = repack_gguf(q, scale, zero, self.config.group_size)
        g_idx = torch.arange(q.shape[1], dtype=torch.int32, device=q.device) // layer.group_size
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros), ("g_idx", g_idx)):
            setattr(layer, name, nn.Parameter(t, requires_grad=False))


def repack_gguf(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """``gguf_quants.decompose``'s parts of a ``(..., N, K)`` weight (a linear layer's, or stacked
    experts': one layout for all of them), ``q`` a byte a weight, ``scale`` / ``zero (..., N, K /
    group)`` -> ``(qweight (..., K / pack, N), scales, zeros (..., groups, N), bits, group)`` in
    the module docstring's layout: 4-bit words where every value fits in 4 bits, else 8-bit; the
    groups doubled where the scales and zeros of each pair are equal."""
    bits = 4 if int(q.max()) < 16 else 8
    if scale.shape[-1] % 2 == 0 and torch.equal(scale[..., 0::2], scale[..., 1::2]) \
            and torch.equal(zero[..., 0::2], zero[..., 1::2]):
        scale, zero, group = scale[..., 0::2], zero[..., 0::2], 2 * group
    *lead, n, k = q.shape
    # (an expert at a time: pack_rows' int64 values of a whole stack would be 8 bytes a weight)
    words = torch.stack([pack_rows(w.t(), bits) for w in q.reshape(-1, n, k)]).view(*lead, k * bits // 32, n)
    return words, scale.transpose(-1, -2).contiguous(), zero.transpose(-1, -2).contiguous(), bits, group
