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
    # Torch backend only: the decodes split by context length, computed by the first layer.
    decode_groups: list | None = None


class TorchAttentionBackend:
    """Reference kernels; used on CPU. Prefills are one padded group, so a long prefill does
    not pad hundreds of decodes to its length; decodes are DECODE_GROUPS groups of similar
    context length, since the reference copies every request's context padded to its group's
    longest (a quarter of the copying at batch 256 with mixed lengths: 35 -> 22 ms a layer)."""

    DECODE_GROUPS = 4

    @staticmethod
    def forward(q, k, v, kv_cache, md: AttentionMetadata, scale: float) -> torch.Tensor:
        n = md.num_actual_tokens
        reference.write_kv_cache(k[:n], v[:n], kv_cache, md.slot_mapping[:n])
        out = torch.empty_like(q)
        nd = md.num_decodes
        for idx, qsl, max_len in TorchAttentionBackend._decode_groups(md):
            out[idx] = reference.paged_attention(q[idx], kv_cache, md.block_tables[idx], md.seq_lens[idx],
                                                 qsl, scale, max_seq_len=max_len, max_query_len=1)
        if nd < md.seq_lens.shape[0]:
            out[nd:n] = reference.paged_attention(
                q[nd:n], kv_cache, md.block_tables[nd:], md.seq_lens[nd:], md.query_start_loc[nd:] - nd,
                scale, max_seq_len=md.max_seq_len, max_query_len=md.max_query_len)
        return out

    @staticmethod
    def _decode_groups(md: AttentionMetadata) -> list:
        """(request indices, query_start_loc, longest context) per group of decodes, sorted by
        context length; computed once per step (the tensors live on the CPU: no syncs)."""
        if md.decode_groups is None:
            nd = md.num_decodes
            if nd < 4 * TorchAttentionBackend.DECODE_GROUPS:
                groups = [slice(0, nd)] if nd else []
            else:
                groups = torch.argsort(md.seq_lens[:nd]).tensor_split(TorchAttentionBackend.DECODE_GROUPS)
            md.decode_groups = [(idx, md.query_start_loc[:len(md.seq_lens[idx]) + 1], int(md.seq_lens[idx].max()))
                                for idx in groups]
        return md.decode_groups

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
