"""The LoRA adapters of one linear layer, applied to a batch whose tokens use different ones.

The layer holds ``max_loras`` slots of ``max_lora_rank`` columns per slice (3 for the fused q/k/v,
2 for gate/up, else 1): A stacked as ``(slots * slices * rank, in)``, B as ``(out, slots * slices
* rank)``, zero where a slot's adapter is smaller or absent. A step is then two matmuls whatever
the mix of adapters, the second keeping each token's row of the first's result only in its own
slot's columns:

    xa = x @ A^T;   out += (xa masked by the token's slot) @ B^T

(the step's token slots, -1 for no adapter, are a buffer the runner writes and every layer
reads; the masked product is ``lora_expand``: one Triton kernel on the GPU, its torch reference
elsewhere). B of a fused layer is block diagonal: slice i's columns feed only slice i's output
rows. The shapes depend only on the batch's token count, so CUDA graphs capture it; the extra
work is ``2 * slots * slices * rank * (in + out)`` FLOPs a token.

Tensor parallelism: a column-parallel layer keeps A whole and the rank's rows of B (cut by the
layer's own weight_loader, as its weight's rows are); a row-parallel layer keeps the rank's
columns of A and B whole, and adds its term before the all-reduce, which sums the ranks' parts
of ``x @ A^T`` through B (B is linear).
"""
import functools

import torch

from pagoda.kernels import reference
from pagoda.quant.base import dense_linear


class LoRALinear:
    def __init__(self, layer, shard_ids: tuple, max_loras: int, max_rank: int, token_slots: torch.Tensor,
                 dtype: torch.dtype, row_parallel: bool):
        # (``layer`` itself is not kept: it holds this object, and the engine's gc.freeze() would
        # keep such a cycle alive after the engine is dropped; set_slot is given it.)
        self.shard_ids, self.row_parallel = shard_ids, row_parallel
        self.rank = max_rank
        self.width = len(shard_ids) * max_rank            # a slot's columns
        self.token_slots = token_slots                     # (max tokens,), the runner's
        device = token_slots.device
        self.expand = _triton_lora().lora_expand if device.type == "cuda" else reference.lora_expand
        self.a = torch.zeros(max_loras, self.width, layer.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(layer.out_features, max_loras, self.width, dtype=dtype, device=device)
        self.a_2d = self.a.view(-1, layer.in_features)        # (slots * width, in)
        self.b_2d = self.b.view(layer.out_features, -1)       # (out, slots * width)

    def set_slot(self, layer, slot: int, slices: list | None) -> None:
        """Load one adapter's (A, scaled B) per slice (None: none for that slice) into ``slot`` of
        ``layer`` (the linear layer this adapts)."""
        self.a[slot].zero_()
        self.b[:, slot].zero_()
        for i, (ab, shard_id) in enumerate(zip(slices or (), self.shard_ids)):
            if ab is None:
                continue
            a, b = ab
            cols = slice(i * self.rank, i * self.rank + a.shape[0])
            a_slot, b_slot = self.a[slot, cols], self.b[:, slot, cols]
            if self.row_parallel:
                layer.weight_loader(a_slot, a.to(a_slot.device))         # this rank's input columns
                b_slot.copy_(b)
            else:
                a_slot.copy_(a)
                layer.weight_loader(b_slot, b.to(b_slot.device), shard_id)  # this rank's output rows

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's base output for ``x``) plus each token's adapter term, in place."""
        n = x.shape[0]
        xa = dense_linear(x.reshape(n, -1), self.a_2d)
        self.expand(xa, self.b_2d, self.token_slots[:n], self.width, out.view(n, -1))
        return out


@functools.cache
def _triton_lora():
    from pagoda.kernels import triton_lora    # (Triton only where there is a GPU)
    return triton_lora
