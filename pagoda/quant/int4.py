"""GPTQ and AWQ weights (W4A16: 4-bit integer weights in groups along the input, each group with
a scale and a zero point; activations stay in the model's dtype). Both formats are loaded as
they are downloaded (AutoGPTQ's / GPTQModel's and AutoAWQ's layouts) and repacked at load into
one layout, so that one dequantization serves both:

- ``qweight`` int32 ``(K / pack, N)``: packed along the input dim, value j of a word at bits
  ``bits * j`` (GPTQ's own layout; AWQ's is packed along the output dim, its columns
  interleaved, and is repacked);
- ``scales`` ``(groups, N)`` in the model's dtype;
- ``zeros`` ``(groups, N)`` in the model's dtype: the true zero points (GPTQ's v1 checkpoints
  store them less one);
- ``g_idx`` int32 ``(K,)``: each input channel's group (GPTQ's act-order permutes them; for the
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

from pagoda.quant.base import QuantMethod, triton_kernels

# AWQ's order of the 8 columns in a packed word: slot i holds column AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Int4Config:
    method: str             # "gptq" or "awq"
    bits: int
    group_size: int         # -1: one group over the whole input (per-channel)
    desc_act: bool = False  # GPTQ act-order: g_idx permuted
    zeros_minus_one: bool = False   # GPTQ v1 checkpoints store each zero point less one

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
        else:
            bits = qc.get("bits", 4)
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; expected 'gptq' or 'gptq_v2'.")
            config = cls("gptq", bits, qc.get("group_size", 128), bool(qc.get("desc_act", False)),
                         zeros_minus_one=fmt == "gptq")
        supported = (4,) if method == "awq" else (4, 8)
        if config.bits not in supported:
            raise ValueError(f"{method.upper()} checkpoints of {config.bits} bits are not supported; "
                             f"supported: {supported}.")
        return config

    @property
    def pack(self) -> int:
        return 32 // self.bits

    def repack(self, qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A checkpoint's ``qweight`` and ``qzeros`` (one layer's, or several stacked along their
        rows) -> pagoda's layout (module docstring): words packed along K, and the true zero
        points, int32 ``(groups, N)``."""
        order = AWQ_ORDER if self.method == "awq" else None
        zeros = unpack_cols(qzeros, self.bits, order) + int(self.zeros_minus_one)
        if self.method == "awq":
            qweight = pack_rows(unpack_cols(qweight, self.bits, order), self.bits)
        return qweight, zeros

    def check_g_idx(self, g_idx: torch.Tensor, groups: int, whose: str) -> None:
        """An act-order checkpoint's own group map must stay within its ``groups``."""
        if bool(((g_idx < 0) | (g_idx >= groups)).any()):
            raise ValueError(f"Corrupt {self.method.upper()} checkpoint: {whose} g_idx entry is outside its {groups} "
                             "groups.")


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

    def __init__(self, config: Int4Config):
        self.config = config

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        c = self.config
        k, n = in_features, out_features
        group = k if c.group_size == -1 else c.group_size
        # (GPTQ's last group may be partial; AutoAWQ requires whole groups)
        if (c.method == "awq" and k % group) or k % c.pack or n % c.pack:
            raise ValueError(f"A {k} x {n} linear layer cannot hold {c.method.upper()} weights in groups of "
                             f"{group} packed {c.pack} a word.")
        if getattr(layer, "tp_size", 1) > 1 and (k % group or c.desc_act):
            # (a rank's slice of the input must hold whole groups, in the checkpoint's order)
            raise ValueError(f"{c.method.upper()} weights in groups of {group}{' with act-order (desc_act)' if c.desc_act else ''} "
                             f"do not split over tensor_parallel_size={layer.tp_size} (a {k}-wide input slice per "
                             "rank); use a smaller tensor_parallel_size or a checkpoint without act-order.")
        groups = -(-k // group)
        layer.group_size = group
        per_channel = c.group_size == -1     # one group per rank's slice: not split along the input

        def param(shape, dt, output_dim, output_pack, input_dim, input_pack):
            p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
            p.output_dim, p.output_pack, p.input_dim, p.input_pack = output_dim, output_pack, input_dim, input_pack
            return p

        if c.method == "gptq":
            layer.qweight = param((k // c.pack, n), torch.int32, 1, 1, 0, c.pack)
            layer.g_idx = param((k,), torch.int32, None, 1, 0, 1)
        else:
            layer.qweight = param((k, n // c.pack), torch.int32, 1, c.pack, 0, 1)
        layer.qzeros = param((groups, n // c.pack), torch.int32, 1, c.pack, None if per_channel else 0, group)
        layer.scales = param((groups, n), dtype, 1, 1, None if per_channel else 0, group)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        c = self.config
        qweight, zeros = c.repack(layer.qweight.data, layer.qzeros.data)
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        if c.desc_act:   # the checkpoint's own group map: check it
            c.check_g_idx(layer.g_idx, layer.scales.shape[0], "a layer's")
        else:   # by the rule (GPTQ checkpoints store a g_idx even without act-order; AWQ none)
            k = layer.qweight.shape[0] * c.pack
            layer.g_idx = nn.Parameter(torch.arange(k, dtype=torch.int32, device=layer.qweight.device)
                                       // layer.group_size, requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(layer.scales.dtype), requires_grad=False)
        del layer.qzeros

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and (w4a16 := triton_kernels("triton_w4a16")).use_w4a16(x):
            # decode batches on the GPU: dequantized in registers
            return w4a16.w4a16_linear(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.config.bits,
                                      bias, None if self.config.desc_act else layer.group_size)
        w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.g_idx, self.config.bits)
        return F.linear(x, w.t(), bias)
