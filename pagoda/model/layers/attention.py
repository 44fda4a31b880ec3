"""The attention layer and its backends.

The model runner describes the batch once per step in an ``AttentionMetadata`` for each KV cache
group (runner/kv_cache.py; one for most models) and installs them with ``set_forward_context``;
every attention layer then applies the rotary embedding to its new q and k, writes the new K/V
into its paged cache at its group's ``slot_mapping`` and attends through its group's block tables. Backends are the one plug-in point: ``forward(q, k, v, kv_cache,
metadata, scale, rope, k_scale, v_scale, sliding_window, softcap) -> out``, plus ``copy_blocks`` for
the copy-on-write of forked sequences. ``k_scale`` / ``v_scale`` are an FP8 cache's
(``reference.quantize_kv``); ``sliding_window`` (0: none) the layer's window (Mistral-7B-v0.1's:
each query attends to its last ``sliding_window`` positions; blocks before a query's window may
have been given back to the pool, see ``KVCacheManager``: never read unmasked);
``softcap`` (0: none) Gemma 2's cap on the scores (``reference.sdpa``).
"""
import functools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from pagoda.kernels import reference
from pagoda.kernels.reference import Rope

# vLLM's calculate_kv_scales: a scale of the first step's largest |k| / 200 (|v| / 100), leaving
# headroom in FP8's range for later tokens larger than the first step's.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0
MIN_KV_SCALE = 1e-6      # (a layer whose keys were all zero)


@dataclass
class AttentionMetadata:
    """The batch is ordered decodes first: requests ``[0, num_decodes)`` have one query token
    each and occupy tokens ``[0, num_decodes)``; the rest are prefills (whole or chunked).
    ``num_decodes`` is None in a CUDA graph of mixed steps, where it is not known at capture
    (Triton backend only)."""
    num_actual_tokens: int
    num_decodes: int | None
    slot_mapping: torch.Tensor        # (num_tokens,) int64
    query_start_loc: torch.Tensor     # (batch + 1,) int32
    seq_lens: torch.Tensor            # (batch,) int32: context length including this step
    block_tables: torch.Tensor        # (batch, max_blocks) int32
    max_query_len: int
    max_seq_len: int
    max_decode_seq_len: int
    # Torch backend only: the decode (by sliding window) and prefill groups, planned by the first
    # layer for all.
    decode_groups: dict[int, list] | None = None
    decode_order: torch.Tensor | None = None     # the decodes sorted by context length
    prefill_groups: list | None = None


@dataclass
class DecodeGroup:
    """Decodes attended by one padded SDPA call, with what every layer shares precomputed."""
    rows: slice                       # the group's requests among the decodes in decode_order
    block_ids: torch.Tensor           # (len(rows) * blocks,) int64: each request's first blocks
    max_len: int                      # the group's longest context
    mask: torch.Tensor                # (len(rows), 1, 1, max_len) float: 0 in context, -inf past it


@dataclass
class PrefillGroup:
    """Prefills attended by one ``reference.paged_attention`` call."""
    tokens: torch.Tensor              # the group's query tokens in the batch
    query_start_loc: torch.Tensor     # within the group
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int


class TorchAttentionBackend:
    """Torch kernels; used on CPU. Both kinds of request are attended in groups of similar
    length, since each padded SDPA call pads its group to the longest; what every layer shares
    (block ids, masks, token indices) is planned by the first layer of the step.

    - Prefills go through the reference in up to PREFILL_GROUPS groups (it computes the whole
      padded query x context square): an 8,192-token step of 49 prompts (64-256 tokens) of
      SmolLM2 ran its forward in 15.2 s instead of 17.1 s as one group.
    - Decodes, most of the attention time, take a fast path (``_decode``) in groups small
      enough (DECODE_GROUP_BYTES of gathered K/V) for the gathered copy to still be in the L3
      cache when SDPA reads it back: a 256-decode step (contexts 65-335) ran its forward in
      766 ms instead of 975 ms with four groups through the reference.
    """

    DECODE_GROUP_BYTES = 8 << 20
    PREFILL_GROUPS = 8

    @staticmethod
    def forward(q, k, v, kv_cache, md: AttentionMetadata, scale: float, rope: Rope | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        n = md.num_actual_tokens
        if rope is not None:
            q, k = reference.rotary_embedding(rope.positions, q, k, rope.cos_sin_cache, q.shape[-1],
                                              rope.q_norm_weight, rope.k_norm_weight, rope.eps, rope.norm_unit_offset)
        reference.write_kv_cache(k[:n], v[:n], kv_cache, md.slot_mapping[:n], k_scale, v_scale)
        out = torch.empty_like(q)
        nd = md.num_decodes
        groups = TorchAttentionBackend._decode_groups(md, kv_cache, q.dtype, sliding_window)
        if groups:
            # In context-length order each group is a slice: one gather of the queries and one
            # scatter of the outputs per layer, whatever the number of groups.
            order = md.decode_order
            q_sorted = q[:nd] if order is None else q.index_select(0, order)
            out_sorted = torch.empty_like(q_sorted)
            for g in groups:
                out_sorted[g.rows] = TorchAttentionBackend._decode(q_sorted[g.rows], kv_cache, g, scale,
                                                                   k_scale, v_scale, softcap)
            if order is None:
                out[:nd] = out_sorted
            else:
                out.index_copy_(0, order, out_sorted)
        for g in TorchAttentionBackend._prefill_groups(md):
            out[g.tokens] = reference.paged_attention(q[g.tokens], kv_cache, g.block_tables, g.seq_lens,
                                                      g.query_start_loc, scale, g.max_seq_len, g.max_query_len,
                                                      k_scale, v_scale, sliding_window, softcap)
        return out

    @staticmethod
    def _decode(q, kv_cache, group: DecodeGroup, scale: float, k_scale: float, v_scale: float,
                softcap: float) -> torch.Tensor:
        """``reference.paged_attention`` for one query token per request. With one query, the
        query heads that share a KV head are that head's query rows (GQA without expanding K/V)
        and every row has the same mask."""
        b, num_heads, head_dim = q.shape
        k, v = reference.gather_blocks(kv_cache, group.block_ids, b, group.max_len)
        k, v = reference.dequantize_kv(k, k_scale, q.dtype), reference.dequantize_kv(v, v_scale, q.dtype)
        num_kv_heads = k.shape[2]
        out = reference.sdpa(q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim), k.transpose(1, 2),
                             v.transpose(1, 2), group.mask, scale, softcap)
        return out.reshape(b, num_heads, head_dim)   # (SDPA on CUDA may return it strided)

    @staticmethod
    def _decode_groups(md: AttentionMetadata, kv_cache: torch.Tensor, dtype: torch.dtype,
                       sliding_window: int) -> list[DecodeGroup]:
        """The decodes sorted by context length and cut into groups; planned once per step and
        sliding window (the tensors live on the CPU: no syncs)."""
        if md.decode_groups is None:
            md.decode_groups = {}
        if sliding_window not in md.decode_groups:
            nd = md.num_decodes
            token_bytes = kv_cache[:, 0, 0].numel() * kv_cache.element_size()     # K and V of a token
            num_groups = min(nd, max(1, -(-nd * md.max_decode_seq_len * token_bytes
                                          // TorchAttentionBackend.DECODE_GROUP_BYTES)))
            seq_lens, tables = md.seq_lens[:nd], md.block_tables[:nd]
            if num_groups > 1:
                md.decode_order = torch.argsort(seq_lens)
                seq_lens, tables = seq_lens[md.decode_order], tables[md.decode_order]
            bounds = [i * nd // num_groups for i in range(num_groups + 1)] if nd else []
            md.decode_groups[sliding_window] = [
                TorchAttentionBackend._plan(slice(lo, hi), seq_lens[lo:hi], tables[lo:hi], kv_cache, dtype,
                                            sliding_window) for lo, hi in zip(bounds, bounds[1:])]
        return md.decode_groups[sliding_window]

    @staticmethod
    def _plan(rows: slice, seq_lens, block_tables, kv_cache: torch.Tensor, dtype: torch.dtype,
              sliding_window: int) -> DecodeGroup:
        max_len = int(seq_lens.max())
        num_blocks = -(-max_len // kv_cache.shape[2])
        block_ids = block_tables[:, :num_blocks].reshape(-1).long()
        pos = torch.arange(max_len, device=seq_lens.device)[None, :]
        past = pos >= seq_lens[:, None]
        if sliding_window:      # (the query sits at seq_len - 1)
            past |= pos < seq_lens[:, None] - sliding_window
        mask = torch.zeros(past.shape, dtype=dtype, device=seq_lens.device)
        return DecodeGroup(rows, block_ids, max_len, mask.masked_fill_(past, float("-inf"))[:, None, None, :])

    @staticmethod
    def _prefill_groups(md: AttentionMetadata) -> list[PrefillGroup]:
        """The prefills sorted by context length and cut into groups, with their query tokens
        gathered and their query_start_loc rebased; planned once per step."""
        if md.prefill_groups is None:
            nd, batch = md.num_decodes, md.seq_lens.shape[0]
            md.prefill_groups = []
            if nd < batch:
                order = torch.argsort(md.seq_lens[nd:]) + nd
                for rows in order.tensor_split(min(batch - nd, TorchAttentionBackend.PREFILL_GROUPS)):
                    starts = md.query_start_loc[rows]
                    q_lens = md.query_start_loc[rows + 1] - starts
                    qsl = torch.zeros(len(rows) + 1, dtype=starts.dtype, device=rows.device)
                    torch.cumsum(q_lens, 0, out=qsl[1:])
                    tokens = (torch.arange(int(qsl[-1]), device=rows.device)
                              + torch.repeat_interleave(starts - qsl[:-1], q_lens))
                    md.prefill_groups.append(PrefillGroup(tokens, qsl, md.seq_lens[rows], md.block_tables[rows],
                                                          int(q_lens.max()), int(md.seq_lens[rows].max())))
        return md.prefill_groups

    copy_blocks = staticmethod(reference.copy_blocks)


class TritonAttentionBackend:
    """The GPU path: Triton kernels that read K/V straight from the paged cache. The rotary
    embedding has no kernel of its own: the KV write rotates the keys, the attention the queries."""

    @staticmethod
    def forward(q, k, v, kv_cache, md: AttentionMetadata, scale: float, rope: Rope | None = None,
                k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int = 0,
                softcap: float = 0.0) -> torch.Tensor:
        from pagoda.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
        n, nd = md.num_actual_tokens, md.num_decodes
        write_kv_cache_triton(k, v, kv_cache, md.slot_mapping, rope, k_scale, v_scale)
        attend = functools.partial(paged_attention_triton, kv_cache=kv_cache, scale=scale, rope=rope,
                                   k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                                   softcap=softcap)
        out = torch.empty_like(q)
        if nd is None:   # a mixed-step graph: the decodes (wherever they are), then the rest
            attend(q[:n], block_tables=md.block_tables, seq_lens=md.seq_lens, query_start_loc=md.query_start_loc,
                   max_seq_len=md.max_decode_seq_len, max_query_len=1, out=out[:n])
            attend(q[:n], block_tables=md.block_tables, seq_lens=md.seq_lens, query_start_loc=md.query_start_loc,
                   max_seq_len=md.max_seq_len, max_query_len=md.max_query_len, out=out[:n], skip_decodes=True)
            return out
        # A mixed step's decodes apart, in decode tiles (one launch would run them in the
        # prefills' 128-row tiles); then the rest of the batch, from request `first` on.
        first = nd if nd < md.seq_lens.shape[0] else 0
        if first:
            attend(q[:nd], block_tables=md.block_tables[:nd], seq_lens=md.seq_lens[:nd],
                   query_start_loc=md.query_start_loc[:nd + 1], max_seq_len=md.max_decode_seq_len, max_query_len=1,
                   out=out[:nd])
        attend(q[:n], block_tables=md.block_tables[first:], seq_lens=md.seq_lens[first:],
               query_start_loc=md.query_start_loc[first:], max_seq_len=md.max_seq_len,
               max_query_len=md.max_query_len, out=out[:n])
        return out

    @staticmethod
    def copy_blocks(kv_caches, src, dst) -> None:
        from pagoda.kernels.triton_attention import copy_blocks_triton
        copy_blocks_triton(kv_caches, src, dst)


def get_attention_backend(device: torch.device):
    return TritonAttentionBackend if device.type == "cuda" else TorchAttentionBackend


@dataclass
class ForwardContext:
    # The batch as each KV cache group's layers see it (their own block tables and slots), or
    # one for all groups (steps that read and write only the null block: warm-ups, tests)
    attn_metadata: list[AttentionMetadata] | AttentionMetadata | None
    backend: type


_FORWARD_CONTEXT: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: list[AttentionMetadata] | AttentionMetadata | None,
                        backend=TorchAttentionBackend):
    global _FORWARD_CONTEXT
    prev, _FORWARD_CONTEXT = _FORWARD_CONTEXT, ForwardContext(attn_metadata, backend)
    try:
        yield
    finally:
        _FORWARD_CONTEXT = prev


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int, sliding_window: int = 0,
                 softcap: float = 0.0):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window     # (0: the whole context)
        self.softcap = softcap                   # (0: none)
        self.kv_cache = torch.tensor([])   # bound by the model runner (runner/kv_cache.py)
        self.kv_group = 0                  # the KV cache group whose block tables it follows
        # An FP8 cache's scales (vLLM's k_scale / v_scale): the checkpoint's, if it has them
        # (loader.load_weights), else 1.0; other caches ignore them. With calculate_kv_scales the
        # runner sets calibrate_next for the first step, whose keys and values set them.
        self.k_scale = self.v_scale = 1.0
        self.calibrate_next = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None = None
                ) -> torch.Tensor:
        """New q, k, v (tokens, heads * head_dim), before the rotary embedding ``rope``, which
        the backend applies (on the GPU inside its kernels, leaving q and k unchanged)."""
        ctx = _FORWARD_CONTEXT
        md = ctx.attn_metadata
        if md is None:      # memory-profiling run: no cache yet
            return torch.empty_like(q)
        if isinstance(md, list):
            md = md[self.kv_group]
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.calibrate_next:
            n = md.num_actual_tokens
            self._calibrate(q[:n], k[:n], v[:n], rope and rope._replace(positions=rope.positions[:n]))
        out = ctx.backend.forward(q, k, v, self.kv_cache, md, self.scale, rope,
                                  self.k_scale, self.v_scale, self.sliding_window, self.softcap)
        return out.view(-1, self.num_heads * self.head_dim)

    def _calibrate(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None) -> None:
        """k_scale / v_scale from this step's keys (as the cache stores them: normed and rotated)
        and values, as vLLM computes them: the largest magnitude over K_SCALE_RANGE (V_...)."""
        if rope is not None:
            _, k = reference.rotary_embedding(rope.positions, q.flatten(1), k.flatten(1), rope.cos_sin_cache,
                                              self.head_dim, rope.q_norm_weight, rope.k_norm_weight, rope.eps,
                                              rope.norm_unit_offset)
        self.k_scale = max(k.abs().max().item() / K_SCALE_RANGE, MIN_KV_SCALE)
        self.v_scale = max(v.abs().max().item() / V_SCALE_RANGE, MIN_KV_SCALE)
        self.calibrate_next = False
