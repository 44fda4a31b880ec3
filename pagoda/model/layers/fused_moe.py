"""A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the router picks ``top_k`` of ``num_experts``
SiLU-gated MLPs for each token and sums their outputs weighted by its softmax.

The experts' weights are stacked, as vLLM's FusedMoE holds them: ``w13_weight (E, 2 * I, H)``
(each expert's gate rows, then its up rows) and ``w2_weight (E, H, I)``. Tensor parallelism
splits every expert's intermediate size I, as the dense MLP's (its gate/up rows and its down
columns), and all-reduces the summed outputs once. With expert parallelism (vLLM's
``enable_expert_parallel``) the ranks share the experts out instead, each holding E / tp whole
experts and summing the outputs of its own: the same all-reduce then adds the ranks' shares.

8-bit experts stay 8-bit: FP8 or INT8 w13 / w2 and float32 scales that the kernels apply to each
weight tile as they convert it. Block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8's) have a scale per
block of bn x bk weights, ``w13_weight_scale_inv (E, 2 * I / bn, H / bk)`` / ``w2_weight_scale_inv
(E, H / bn, I / bk)``; vLLM's per-tensor FP8 checkpoints, compressed-tensors' FP8 and INT8 (W8A8)
ones, and ``quantization="fp8"`` on a bf16 checkpoint (each expert's rows quantized at load), a
scale per row, ``w13_weight_scale (E, 2 * I, 1)`` / ``w2_weight_scale (E, H, 1)``: blocks of one
row by the whole input. (INT8 experts run as W8A16: activations stay in the model's dtype.)

GPTQ / AWQ / compressed-tensors pack-quantized experts (Qwen3-30B-A3B-GPTQ-Int4's, Mixtral's AWQ)
and a GGUF file's (``quantization="gguf"``) stay packed: each expert's tensors are loaded as the
checkpoint lays them out (``Int4Config.checkpoint_tensors``; w13's hold its gate then its up
columns; GGUF's as ``gguf_quants.decompose``'s parts), and repacked after loading into
``quant.int4``'s layout, ``qweight (E, K / pack, N)``, ``scales`` / ``zeros (E, groups, N)``, the
kernels dequantizing their tiles in registers (``reference.Int4Experts``). Under act-order each
of w13's halves keeps its own ``g_idx``. GGUF's w13 and w2 each take 4 or 8 bits and groups of
16 or 32 as their block types allow (``int4.repack_gguf``), their zero points with fractions.
"""
import re

import torch
from torch import nn

from pagoda.distributed.parallel_state import expert_parallel, get_tp_rank, get_tp_size, tp_all_reduce
from pagoda.kernels import reference
from pagoda.model.layers.linear import _copy, _divide
from pagoda.quant.base import QuantMethod, UnquantizedLinearMethod, lazy_parameter

# A checkpoint's per-expert tensor, ``...experts.<e>.<name>.weight`` once the model's
# packed_modules_mapping has named gate / up projections gate_up_proj (with their half as the
# shard id) and down projections down_proj: the stacked parameter it fills.
_EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_up_proj|down_proj)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale|qweight|qzeros|scales|g_idx|weight_packed|weight_zero_point|"
    r"weight_g_idx|gguf_q|gguf_scale|gguf_zero)$")
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def expert_param_name(name: str, shard_id) -> tuple[str, tuple[int, int | None]] | None:
    """(the stacked parameter's name, (expert, half)) for an expert's checkpoint tensor, else None."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    return f"{m[1]}.{_STACKED[m[3]]}_{m[4]}", (int(m[2]), shard_id)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 quant: QuantMethod | None = None):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        ep = expert_parallel() and self.tp_size > 1
        # This rank's experts (global ids first_expert...) and the slice of each one's I it holds
        self.num_local_experts = _divide(num_experts, self.tp_size) if ep else num_experts
        self.first_expert = self.tp_rank * self.num_local_experts if ep else 0
        self.intermediate_size = intermediate_size if ep else _divide(intermediate_size, self.tp_size)
        self.i_rank = 0 if ep else self.tp_rank
        expert_map = None
        if ep:      # a global expert id's index here, -1 for another rank's
            expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
            expert_map[self.first_expert:self.first_expert + self.num_local_experts] = torch.arange(
                self.num_local_experts, dtype=torch.int32)
        self.register_buffer("expert_map", expert_map, persistent=False)
        from pagoda.quant.int4 import Int4LinearMethod
        self.int4 = quant.config if isinstance(quant, Int4LinearMethod) else None
        self.int_zeros = getattr(quant, "int_zeros", True)
        self.w8, self.block = w8_experts(None if self.int4 else quant)
        if self.w8 == "online" or self.int4:     # (the loader calls quant_method once all is loaded)
            self.quant_method = _AfterLoading()
        i, h = self.intermediate_size, hidden_size
        if self.int4:
            self._add_int4(i, h, ep)
            return
        if self.block and (i % self.block[0] or i % self.block[1]):
            raise ValueError(f"Block-wise FP8 experts: {i} of each expert's intermediate size (this rank's) is not "
                             f"a whole number of the checkpoint's {self.block[0]} x {self.block[1]} blocks (with "
                             "tensor parallelism: use enable_expert_parallel, or a smaller tensor_parallel_size).")
        dtype = quant.dtype if self.w8 == "checkpoint" else torch.get_default_dtype()
        self._add("w13_weight", (2 * i, h), dtype, 0)
        self._add("w2_weight", (h, i), dtype, 1)
        if self.w8 == "checkpoint" and self.block:
            bn, bk = self.block
            scales = (self._add("w13_weight_scale_inv", (2 * i // bn, -(-h // bk)), torch.float32, 0),
                      self._add("w2_weight_scale_inv", (-(-h // bn), i // bk), torch.float32, 1))
            if quant.scale_name != "weight_scale_inv":     # (the loader's alias: checkpoint_aliases)
                for w, p in zip(("w13", "w2"), scales):
                    p.checkpoint_name = f"{w}_{quant.scale_name}"
        elif self.w8 == "checkpoint":
            self._add("w13_weight_scale", (2 * i, 1), torch.float32, 0)
            self._add("w2_weight_scale", (h, 1), torch.float32, None)
            for w in ("w13", "w2"):     # (a static activation scale: read, not used, as the dense layers')
                self._add(f"{w}_input_scale", (), torch.float32, None).optional = True

    def _add_int4(self, i: int, h: int, ep: bool) -> None:
        """GPTQ / AWQ / compressed-tensors experts' tensors as the checkpoint holds them
        (``Int4Config.checkpoint_tensors``): w13's input is H, its outputs the gate's and the up's
        I; w2's input is I."""
        c = self.int4
        self.int4_dims = {"w13": (h, 2 * i), "w2": (i, h)}     # (K, N)
        self.group_sizes = {w: k if c.group_size == -1 else c.group_size for w, (k, _) in self.int4_dims.items()}
        self.int4_bits = dict.fromkeys(self.int4_dims, c.bits)     # (GGUF's: each w its own, once repacked)
        split = self.tp_size > 1 and not ep      # (each rank holds a slice of every expert's I)
        whole_groups = h % self.group_sizes["w13"] == 0 and i % self.group_sizes["w2"] == 0
        if h % c.pack or i % c.pack or (c.method == "awq" and not whole_groups):
            raise ValueError(f"{c.name} experts of hidden size {h} and intermediate size {i} (this rank's) do not "
                             f"hold whole words of {c.pack} values and whole groups of {c.group_size}.")
        if split and (c.desc_act or (c.group_size != -1 and i % c.group_size)):
            raise ValueError(f"{c.name} experts{c.act_order} in groups of {c.group_size} "
                             f"do not split over tensor_parallel_size={self.tp_size} (an intermediate slice of {i} "
                             "per rank): use enable_expert_parallel, or a smaller tensor_parallel_size.")
        for w, (k, n) in self.int4_dims.items():
            for name, spec in c.checkpoint_tensors(k, n).items():
                # I is w13's output (its gate's, then its up's) and w2's input
                shape, i_dim = spec.shape, spec.n_dim if w == "w13" else spec.k_dim
                if w == "w13" and spec.n_dim is None:     # (act-order g_idx: a row per half)
                    shape, i_dim = (2, *shape), None
                self._add(f"{w}_{name}", shape, spec.dtype or torch.get_default_dtype(), i_dim).optional = spec.optional

    def _add(self, name: str, shape: tuple, dtype: torch.dtype, i_dim: int | None) -> nn.Parameter:
        """A stacked parameter (an expert a row). ``i_dim``: its dimension along I (the rows of
        w13, the columns of w2, or what stands for them: packed words, groups); None: I is not one
        of its dimensions."""
        shape = (self.num_local_experts, *shape)
        # (what process_weights_after_loading replaces, bf16 experts to quantize and GGUF's parts:
        # given memory as they load)
        p = lazy_parameter(shape, dtype) if self.w8 == "online" or getattr(self.int4, "method", None) == "gguf" \
            else nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        p.i_dim = i_dim
        # What a whole checkpoint fills: every expert's gate and up halves, and its down weight
        p.shard_ids = ([(e, half) for e in range(self.num_experts) for half in (0, 1)] if name.startswith("w13")
                       else [(e, None) for e in range(self.num_experts)])
        setattr(self, name, p)
        return p

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        """One expert's gate (half 0) or up (half 1) projection (or its scales, ...) into w13, or
        its down projection into w2: this rank's slice of I, or (expert parallelism) the whole of
        its own experts and nothing of the others'. A one-element scale (per tensor) fills its
        rows; w13's act-order g_idx has a row per half."""
        expert, half = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Checkpoint expert {expert} is out of range: the model has {self.num_experts} experts.")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts or param.dim() == 1:    # (another rank's; an input scale)
            return
        target = param.data[local]
        if param.i_dim is not None:
            size = target.shape[param.i_dim] // (1 if half is None else 2)
            if half is not None:           # w13's gate or up part of I
                target = target.narrow(param.i_dim, half * size, size)
            if loaded.numel() > 1:
                loaded = loaded.narrow(param.i_dim, self.i_rank * size, size)
        elif half is not None:             # (w13's act-order g_idx)
            target = target[half]
        _copy(target, loaded)

    def quantize_rows(self) -> None:
        """quantization="fp8": each expert's rows as FP8 over a scale of their own (``quant.w8``'s)."""
        from pagoda.quant.w8 import quantize_rows
        for w in ("w13", "w2"):
            weight = getattr(self, f"{w}_weight")
            q, scale = quantize_rows(weight.data.flatten(0, 1))
            setattr(self, f"{w}_weight", nn.Parameter(q.view(weight.shape), requires_grad=False))
            setattr(self, f"{w}_weight_scale", nn.Parameter(scale.view(*weight.shape[:2], 1), requires_grad=False))

    def scales(self) -> tuple | None:
        """((w13's scales, their block), (w2's, theirs)) for 8-bit experts (a row scale: a block of
        one row by the whole input), else None."""
        if not self.w8:
            return None
        if self.block:
            return (self.w13_weight_scale_inv, self.block), (self.w2_weight_scale_inv, self.block)
        return ((self.w13_weight_scale, (1, self.w13_weight.shape[2])),
                (self.w2_weight_scale, (1, self.w2_weight.shape[2])))

    def repack_int4(self) -> None:
        """The experts' tensors as loaded -> ``quant.int4``'s layout (``Int4Config.repack``, every
        expert at once; GGUF's parts by ``repack_gguf``, which picks w13's and w2's bits and
        groups): an act-order g_idx kept ``(E, halves, K)``, else none."""
        from pagoda.quant.int4 import repack_gguf
        c = self.int4
        for w, (k, n) in self.int4_dims.items():
            loaded = {name: self._parameters.pop(f"{w}_{name}").data for name in c.checkpoint_tensors(k, n)}
            if c.method == "gguf":
                qweight, scales, zeros, self.int4_bits[w], self.group_sizes[w] = repack_gguf(
                    *loaded.values(), c.group_size)
                g_idx = None
            else:
                qweight, scales, zeros, g_idx = c.repack(loaded)
            for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
                setattr(self, f"{w}_{name}", nn.Parameter(t, requires_grad=False))
            setattr(self, f"{w}_g_idx", None if g_idx is None else g_idx.view(self.num_local_experts, -1, k))

    def experts(self) -> tuple:
        """(w13, w2) as the kernels take them: stacked tensors, or ``reference.Int4Experts``."""
        if not self.int4:
            return self.w13_weight, self.w2_weight
        return tuple(reference.Int4Experts(getattr(self, f"{w}_qweight"), getattr(self, f"{w}_scales"),
                                           getattr(self, f"{w}_zeros"), getattr(self, f"{w}_g_idx"), self.int4_bits[w],
                                           self.group_sizes[w], self.int_zeros) for w in ("w13", "w2"))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagoda.kernels.triton_moe import fused_moe, select_experts
        else:
            fused_moe, select_experts = reference.fused_moe, reference.select_experts
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(x, *self.experts(), topk_weights, topk_ids, self.expert_map, self.scales())
        return out if self.tp_size == 1 else tp_all_reduce(out)


def w8_experts(quant: QuantMethod | None) -> tuple[str | None, tuple[int, int] | None]:
    """How a mixture of experts under ``quant`` (not packed integers) holds its experts:
    ("checkpoint", its FP8 blocks or None for a scale a row): the checkpoint's FP8 or INT8
    weights; ("online", None): bf16 experts to quantize to FP8 at load; (None, None): unquantized."""
    if quant is None or isinstance(quant, UnquantizedLinearMethod):
        return None, None
    return ("online" if quant.dtype is None else "checkpoint"), quant.block


class _AfterLoading(QuantMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.int4:
            layer.repack_int4()
        else:
            layer.quantize_rows()
