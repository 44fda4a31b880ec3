"""A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the router picks ``top_k`` of ``num_experts``
SiLU-gated MLPs for each token and sums their outputs weighted by its softmax.

The experts' weights are stacked, as vLLM's FusedMoE holds them: ``w13_weight (E, 2 * I, H)``
(each expert's gate rows, then its up rows) and ``w2_weight (E, H, I)``. Tensor parallelism
splits every expert's intermediate size I, as the dense MLP's (its gate/up rows and its down
columns), and all-reduces the summed outputs once. With expert parallelism (vLLM's
``enable_expert_parallel``) the ranks share the experts out instead, each holding E / tp whole
experts and summing the outputs of its own: the same all-reduce then adds the ranks' shares.

Block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8's) keep their experts 8-bit: FP8 w13 / w2 and a
float32 ``w13_weight_scale_inv (E, 2 * I / bn, H / bk)`` / ``w2_weight_scale_inv (E, H / bn, I /
bk)``, a scale per block of bn x bk weights, applied to each weight tile as it is converted.
"""
import re

import torch
from torch import nn

from pagoda.distributed.parallel_state import expert_parallel, get_tp_rank, get_tp_size, tp_all_reduce
from pagoda.kernels import reference
from pagoda.model.layers.linear import _divide

# A checkpoint's per-expert tensor, ``...experts.<e>.<name>.weight`` once the model's
# packed_modules_mapping has named gate / up projections gate_up_proj (with their half as the
# shard id) and down projections down_proj: the stacked parameter it fills.
_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_up_proj|down_proj)\.(weight|weight_scale_inv)$")
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def expert_param_name(name: str, shard_id) -> tuple[str, tuple[int, int | None]] | None:
    """(the stacked parameter's name, (expert, half)) for an expert's checkpoint tensor, else None."""
    m = _EXPERT_TENSOR.match(name)
    if m is None:
        return None
    return f"{m[1]}.{_STACKED[m[3]]}_{m[4]}", (int(m[2]), shard_id)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 block: tuple[int, int] | None = None):
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
        self.block = block
        dtype = torch.float8_e4m3fn if block else torch.get_default_dtype()
        shapes = {"w13": (2 * self.intermediate_size, hidden_size), "w2": (hidden_size, self.intermediate_size)}
        params = []
        if block and (self.intermediate_size % block[0] or self.intermediate_size % block[1]):
            raise ValueError(f"Block-wise FP8 experts: {self.intermediate_size} of each expert's intermediate size "
                             f"(this rank's) is not a whole number of the checkpoint's {block[0]} x {block[1]} "
                             "blocks (with tensor parallelism: use enable_expert_parallel, or a smaller "
                             "tensor_parallel_size).")
        for w, (rows, cols) in shapes.items():
            params.append((f"{w}_weight", torch.empty(self.num_local_experts, rows, cols, dtype=dtype), (1, 1)))
            if block:
                scale = torch.empty(self.num_local_experts, -(-rows // block[0]), -(-cols // block[1]))
                params.append((f"{w}_weight_scale_inv", scale.float(), block))
        for name, data, pack in params:
            p = nn.Parameter(data, requires_grad=False)
            p.pack = pack          # (rows, columns) a stored element covers
            # What a whole checkpoint fills: every expert's gate and up halves, and its down weight
            p.shard_ids = ([(e, half) for e in range(num_experts) for half in (0, 1)] if name.startswith("w13")
                           else [(e, None) for e in range(num_experts)])
            p.weight_loader = self.weight_loader
            setattr(self, name, p)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int | None]) -> None:
        """One expert's gate (half 0) or up (half 1) projection ``(I, H)`` into w13, or its down
        projection ``(H, I)`` into w2: this rank's slice of I, or (expert parallelism) the whole
        of its own experts and nothing of the others'."""
        expert, half = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Checkpoint expert {expert} is out of range: the model has {self.num_experts} experts.")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        rows, cols = param.pack      # (a block scale's element covers whole blocks of I)
        if half is None:             # w2 (H, I): this rank's columns of I
            size = self.intermediate_size // cols
            param.data[local].copy_(loaded.narrow(1, self.i_rank * size, size))
        else:                        # w13's gate (0) or up (1) rows of I
            size = self.intermediate_size // rows
            param.data[local].narrow(0, half * size, size).copy_(loaded.narrow(0, self.i_rank * size, size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = reference.select_experts(router_logits, self.top_k, self.renormalize)
        if x.is_cuda:
            from pagoda.kernels.triton_moe import fused_moe
        else:
            fused_moe = reference.fused_moe
        scales = (self.w13_weight_scale_inv, self.w2_weight_scale_inv, self.block) if self.block else None
        out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.expert_map, scales)
        return out if self.tp_size == 1 else tp_all_reduce(out)
