"""A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the router picks ``top_k`` of ``num_experts``
SiLU-gated MLPs for each token and sums their outputs weighted by its softmax.

The experts' weights are stacked, as vLLM's FusedMoE holds them: ``w13_weight (E, 2 * I, H)``
(each expert's gate rows, then its up rows) and ``w2_weight (E, H, I)``. Tensor parallelism
splits every expert's intermediate size I, as the dense MLP's (its gate/up rows and its down
columns), and all-reduces the summed outputs once. With expert parallelism (vLLM's
``enable_expert_parallel``) the ranks share the experts out instead, each holding E / tp whole
experts and summing the outputs of its own: the same all-reduce then adds the ranks' shares.

FP8 experts stay 8-bit: FP8 w13 / w2 and float32 scales that the kernels apply to each weight
tile as they convert it. Block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8's) have a scale per block
of bn x bk weights, ``w13_weight_scale_inv (E, 2 * I / bn, H / bk)`` / ``w2_weight_scale_inv (E,
H / bn, I / bk)``; vLLM's per-tensor FP8 checkpoints, and ``quantization="fp8"`` on a bf16
checkpoint (each expert's rows quantized at load), a scale per row, ``w13_weight_scale (E, 2 * I,
1)`` / ``w2_weight_scale (E, H, 1)``: blocks of one row by the whole input.

GPTQ / AWQ experts (Qwen3-30B-A3B-GPTQ-Int4's, Mixtral's AWQ) stay packed: each expert's tensors
are loaded as the checkpoint lays them out, ``w13_qweight`` holding its gate then its up
columns, and repacked after loading into ``quant.int4``'s layout, ``qweight (E, K / pack, N)``,
``scales`` / ``zeros (E, groups, N)``, the kernels dequantizing their tiles in registers
(``reference.Int4Experts``). Under act-order each of w13's halves keeps its own ``g_idx``.
"""
import re

import torch
from torch import nn

from pagoda.distributed.parallel_state import expert_parallel, get_tp_rank, get_tp_size, tp_all_reduce
from pagoda.kernels import reference
from pagoda.model.layers.linear import _copy, _divide
from pagoda.quant.base import QuantMethod, UnquantizedLinearMethod

# A checkpoint's per-expert tensor, ``...experts.<e>.<name>.weight`` once the model's
# packed_modules_mapping has named gate / up projections gate_up_proj (with their half as the
# shard id) and down projections down_proj: the stacked parameter it fills.
_EXPERT_TENSOR = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_up_proj|down_proj)\."
    r"(weight|weight_scale_inv|weight_scale|input_scale|qweight|qzeros|scales|g_idx)$")
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
        self.fp8, self.block = fp8_experts(None if self.int4 else quant)
        if self.fp8 == "online" or self.int4:     # (the loader calls quant_method once all is loaded)
            self.quant_method = _AfterLoading()
        i, h = self.intermediate_size, hidden_size
        if self.int4:
            self._add_int4(i, h, ep)
            return
        if self.block and (i % self.block[0] or i % self.block[1]):
            raise ValueError(f"Block-wise FP8 experts: {i} of each expert's intermediate size (this rank's) is not "
                             f"a whole number of the checkpoint's {self.block[0]} x {self.block[1]} blocks (with "
                             "tensor parallelism: use enable_expert_parallel, or a smaller tensor_parallel_size).")
        dtype = torch.float8_e4m3fn if self.fp8 == "checkpoint" else torch.get_default_dtype()
        self._add("w13_weight", (2 * i, h), dtype, 0)
        self._add("w2_weight", (h, i), dtype, 1)
        if self.fp8 == "checkpoint" and self.block:
            bn, bk = self.block
            self._add("w13_weight_scale_inv", (2 * i // bn, -(-h // bk)), torch.float32, 0)
            self._add("w2_weight_scale_inv", (-(-h // bn), i // bk), torch.float32, 1)
        elif self.fp8 == "checkpoint":
            self._add("w13_weight_scale", (2 * i, 1), torch.float32, 0)
            self._add("w2_weight_scale", (h, 1), torch.float32, None)
            for w in ("w13", "w2"):     # (a static activation scale: read, not used, as the dense layers')
                self._add(f"{w}_input_scale", (), torch.float32, None).optional = True

    def _add_int4(self, i: int, h: int, ep: bool) -> None:
        """GPTQ / AWQ experts' tensors as the checkpoint holds them (``quant.int4``'s module
        docstring): w13's input is H, its outputs the gate's and the up's I; w2's input is I."""
        c = self.int4
        self.group_sizes = {w: k if c.group_size == -1 else c.group_size for w, k in (("w13", h), ("w2", i))}
        gh, gi = -(-h // self.group_sizes["w13"]), -(-i // self.group_sizes["w2"])
        split = self.tp_size > 1 and not ep      # (each rank holds a slice of every expert's I)
        if h % c.pack or i % c.pack or (c.method == "awq" and (h % gh or i % gi)):
            raise ValueError(f"{c.method.upper()} experts of hidden size {h} and intermediate size {i} (this rank's) "
                             f"do not hold whole words of {c.pack} values and whole groups of {c.group_size}.")
        if split and (c.desc_act or (c.group_size != -1 and i % c.group_size)):
            raise ValueError(f"{c.method.upper()} experts{' with act-order (desc_act)' if c.desc_act else ''} in "
                             f"groups of {c.group_size} do not split over tensor_parallel_size={self.tp_size} (an "
                             f"intermediate slice of {i} per rank): use enable_expert_parallel, or a smaller "
                             "tensor_parallel_size.")
        per_channel = c.group_size == -1
        if c.method == "gptq":
            self._add("w13_qweight", (h // c.pack, 2 * i), torch.int32, 1)
            self._add("w2_qweight", (i // c.pack, h), torch.int32, 0)
            for w, k, i_dim in (("w13", (2, h), None), ("w2", (i,), 0)):   # (w13's: a row per half)
                self._add(f"{w}_g_idx", k, torch.int32, i_dim).optional = not c.desc_act
        else:
            self._add("w13_qweight", (h, 2 * i // c.pack), torch.int32, 1)
            self._add("w2_qweight", (i, h // c.pack), torch.int32, 0)
        dtype = torch.get_default_dtype()
        self._add("w13_qzeros", (gh, 2 * i // c.pack), torch.int32, 1)
        self._add("w13_scales", (gh, 2 * i), dtype, 1)
        self._add("w2_qzeros", (gi, h // c.pack), torch.int32, None if per_channel else 0)
        self._add("w2_scales", (gi, h), dtype, None if per_channel else 0)

    def _add(self, name: str, shape: tuple, dtype: torch.dtype, i_dim: int | None) -> nn.Parameter:
        """A stacked parameter (an expert a row). ``i_dim``: its dimension along I (the rows of
        w13, the columns of w2, or what stands for them: packed words, groups); None: I is not one
        of its dimensions."""
        p = nn.Parameter(torch.empty(self.num_local_experts, *shape, dtype=dtype), requires_grad=False)
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
        """((w13's scales, their block), (w2's, theirs)) for FP8 experts (a row scale: a block of
        one row by the whole input), else None."""
        if not self.fp8:
            return None
        if self.block:
            return (self.w13_weight_scale_inv, self.block), (self.w2_weight_scale_inv, self.block)
        return ((self.w13_weight_scale, (1, self.w13_weight.shape[2])),
                (self.w2_weight_scale, (1, self.w2_weight.shape[2])))

    def repack_int4(self) -> None:
        """GPTQ / AWQ experts as loaded -> ``quant.int4``'s layout (``Int4Config.repack``, every
        expert at once): act-order g_idx checked and kept ``(E, halves, K)``, else dropped."""
        c = self.int4
        for w in ("w13", "w2"):
            qweight, qzeros, scales = (getattr(self, f"{w}_{t}").data for t in ("qweight", "qzeros", "scales"))
            e, groups, n = scales.shape
            qweight, zeros = c.repack(qweight.flatten(0, 1), qzeros.flatten(0, 1))
            g_idx = self._parameters.pop(f"{w}_g_idx", None)
            if g_idx is not None and c.desc_act:
                g_idx = g_idx.data.view(e, -1, qweight.shape[0] // e * c.pack)
                c.check_g_idx(g_idx, groups, "an expert's")
            del self._parameters[f"{w}_qzeros"]
            setattr(self, f"{w}_qweight", nn.Parameter(qweight.view(e, -1, n), requires_grad=False))
            setattr(self, f"{w}_zeros", nn.Parameter(zeros.view(e, groups, n).to(scales.dtype), requires_grad=False))
            setattr(self, f"{w}_g_idx", g_idx if c.desc_act else None)

    def experts(self) -> tuple:
        """(w13, w2) as the kernels take them: stacked tensors, or ``reference.Int4Experts``."""
        if not self.int4:
            return self.w13_weight, self.w2_weight
        return tuple(reference.Int4Experts(getattr(self, f"{w}_qweight"), getattr(self, f"{w}_scales"),
                                           getattr(self, f"{w}_zeros"), getattr(self, f"{w}_g_idx"), self.int4.bits,
                                           self.group_sizes[w]) for w in ("w13", "w2"))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagoda.kernels.triton_moe import fused_moe, select_experts
        else:
            fused_moe, select_experts = reference.fused_moe, reference.select_experts
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(x, *self.experts(), topk_weights, topk_ids, self.expert_map, self.scales())
        return out if self.tp_size == 1 else tp_all_reduce(out)


def fp8_experts(quant: QuantMethod | None) -> tuple[str | None, tuple[int, int] | None]:
    """How a mixture of experts under ``quant`` (not GPTQ / AWQ) holds its experts: ("checkpoint",
    its FP8 blocks or None for a scale a row), ("online", None) for bf16 experts to quantize at
    load, or (None, None): unquantized. Other quantizations are refused by name."""
    from pagoda.quant.w8 import FP8, W8LinearMethod
    if quant is None or isinstance(quant, UnquantizedLinearMethod):
        return None, None
    if isinstance(quant, W8LinearMethod) and quant.dtype in (FP8, None):
        return ("checkpoint" if quant.dtype == FP8 else "online"), quant.block
    raise ValueError("Quantized mixture-of-experts checkpoints are supported in FP8 (vLLM's per-tensor, block-wise "
                     "as Qwen3-30B-A3B-FP8, or quantization='fp8' at load) and GPTQ / AWQ, not 8-bit integer (W8A8) "
                     "yet; use one of those or the bf16 / fp16 checkpoint.")


class _AfterLoading(QuantMethod):
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.repack_int4() if layer.int4 else layer.quantize_rows()
