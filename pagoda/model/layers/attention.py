"""The attention layer and its backends.

The model runner describes the batch once per step in an ``AttentionMetadata`` and installs it
with ``set_forward_context``; every attention layer then writes its new K/V into its own
paged cache at ``slot_mapping`` and attends through the block tables. Backends are the one
plug-in point: ``forward(q, k, v, kv_cache, metadata) -> out``, plus ``copy_blocks`` for the
copy-on-write of forked sequences.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import reference


@dataclass
class AttentionMetadata:
    """The batch is ordered decodes first: requests ``[0, num_decodes)`` have one query token
    each and occupy tokens ``[0, num_decodes)``; the rest are prefills (whole or chunked)."""
    num_actual_tokens: int
    num_decodes: int
    slot_mapping: torch.Tensor        # (num_tokens,) int64
    query_start_loc: torch.Tensor     # (batch + 1,) int32
    seq_lens: torch.Tensor            # (batch,) int32: context length including this step
    block_tables: torch.Tensor        # (batch, max_blocks) int32
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int
    # Torch backend only: the decode groups, planned by the first layer for all the others.
    decode_groups: list | None = None


@dataclass
class DecodeGroup:
    """Decodes attended by one padded SDPA call, with what every layer shares precomputed."""
    rows: torch.Tensor | slice        # the group's requests (= their query tokens) in the batch
    block_ids: torch.Tensor           # (len(rows) * blocks,) int64: each request's first blocks
    max_len: int                      # the group's longest context
    mask: torch.Tensor                # (len(rows), 1, 1, max_len) float: 0 in context, -inf past it


class TorchAttentionBackend:
    """Torch kernels; used on CPU. Prefills go through the reference as one padded group.
    Decodes, which are most of the attention time, are split into groups of similar context
    length (the gather copies each context padded to its group's longest), each small enough
    (DECODE_GROUP_BYTES of gathered K/V) for that copy to still be in the L3 cache when SDPA
    reads it back. What all layers share (block ids, masks) is planned once per step. A
    256-decode step of SmolLM2 (contexts 65-335) went from 1,180 to 955 ms of forward against
    four groups through the reference."""

    DECODE_GROUP_BYTES = 8 << 20

    @staticmethod
    def forward(q, k, v, kv_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
        n = md.num_actual_tokens
        reference.write_kv_cache(k[:n], v[:n], kv_cache, md.slot_mapping[:n])
        out = torch.empty_like(q)
        nd = md.num_decodes
        for group in TorchAttentionBackend._decode_groups(md, kv_cache):
            out[group.rows] = TorchAttentionBackend._decode(q[group.rows], kv_cache, group, scale)
        if nd < md.seq_lens.shape[0]:
            out[nd:n] = reference.paged_attention(
                q[nd:n], kv_cache, md.block_tables[nd:], md.seq_lens[nd:], md.query_start_loc[nd:] - nd,
                scale, max_seq_len=md.max_seq_len, max_query_len=md.max_query_len)
        return out

    @staticmethod
    def _decode(q, kv_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
        """``reference.paged_attention`` for one query token per request. With one query, the
        query heads that share a KV head are that head's query rows (GQA without expanding K/V)
        and every row has the same mask."""
        b, num_heads, head_dim = q.shape
        k, v = reference.gather_blocks(kv_cache, group.block_ids, b, group.max_len)
        num_kv_heads = k.shape[2]
        out = F.scaled_dot_product_attention(
            q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k.transpose(1, 2),
            v.transpose(1, 2), attn_mask=group.mask, scale=scale)
        return out.view(b, num_heads, head_dim)

    @staticmethod
    def _decode_groups(md: AttentionMetadata, kv_cache: torch.Tensor) -> list[DecodeGroup]:
        """The decodes sorted by context length and cut into groups; planned once per step (the
        tensors live on the CPU: no syncs)."""
        if md.decode_groups is None:
            nd = md.num_decodes
            token_bytes = kv_cache[:, 0, 0].numel() * kv_cache.element_size()     # K and V of a token
            num_groups = min(nd, -(-nd * md.max_decode_seq_len * token_bytes
                                   // TorchAttentionBackend.DECODE_GROUP_BYTES))
            if num_groups <= 1:
                groups = [slice(0, nd)] if nd else []
            else:
                groups = torch.argsort(md.seq_lens[:nd]).tensor_split(num_groups)
            md.decode_groups = [TorchAttentionBackend._plan(md, rows, kv_cache) for rows in groups]
        return md.decode_groups

    @staticmethod
    def _plan(md: AttentionMetadata, rows, kv_cache: torch.Tensor) -> DecodeGroup:
        seq_lens = md.seq_lens[rows]
        max_len = int(seq_lens.max())
        num_blocks = -(-max_len // kv_cache.shape[2])
        block_ids = md.block_tables[rows, :num_blocks].reshape(-1).long()
        past = torch.arange(max_len, device=seq_lens.device)[None, :] >= seq_lens[:, None]
        mask = torch.zeros(past.shape, dtype=kv_cache.dtype, device=seq_lens.device).masked_fill_(past, float("-inf"))
        return DecodeGroup(rows, block_ids, max_len, mask[:, None, None, :])

    copy_blocks = staticmethod(reference.copy_blocks)


class TritonAttentionBackend:
    """The GPU path: Triton kernels that read K/V straight from the paged cache."""

    @staticmethod
    def forward(q, k, v, kv_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
        from pagoda.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
        n = md.num_actual_tokens
        write_kv_cache_triton(k, v, kv_cache, md.slot_mapping)
        out = torch.empty_like(q)
        paged_attention_triton(q[:n], kv_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                               md.max_seq_len, md.max_query_len, out=out[:n])
        return out

    @staticmethod
    def copy_blocks(kv_caches, src, dst) -> None:
        from pagoda.kernels.triton_attention import copy_blocks_triton
        copy_blocks_triton(kv_caches, src, dst)


def get_attention_backend(device: torch.device):
    return TritonAttentionBackend if device.type == "cuda" else TorchAttentionBackend


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata | None
    backend: type


_FORWARD_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None, backend=TorchAttentionBackend):
    global _FORWARD_CONTEXT
    prev, _FORWARD_CONTEXT = _FORWARD_CONTEXT, ForwardContext(attn_metadata, backend)
    try:
        yield
    finally:
        _FORWARD_CONTEXT = prev


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.kv_cache = torch.tensor([])   # bound by the model runner

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = _FORWARD_CONTEXT
        if ctx.attn_metadata is None:      # memory-profiling run: no cache yet
            return torch.empty_like(q)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = ctx.backend.forward(q, k, v, self.kv_cache, ctx.attn_metadata, self.scale)
        return out.view(-1, self.num_heads * self.head_dim)
