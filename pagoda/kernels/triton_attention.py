"""Triton kernels for paged attention: writing K/V into the paged cache, and causal attention of
a varlen (mixed prefill / chunked-prefill / decode) batch against it. Same semantics and
argument layout as ``pagoda.kernels.reference`` (the oracle the tests compare against).

Design: ONE unified kernel, plus a split-KV (flash-decoding) mode of that same kernel.

- The grid is ``(query tiles, kv heads, kv segments)``. A query tile holds ``BLOCK_Q`` query
  tokens of one request times the ``GROUP = num_heads // num_kv_heads`` query heads that share
  one KV head, i.e. ``BLOCK_M = BLOCK_Q * GROUP`` rows of the ``tl.dot``. Every K/V tile is thus
  loaded once per GQA group and feeds all of its query heads (for decode, GROUP rows of one
  token; for prefill, BLOCK_Q tokens of every head of the group).
- Query tiles are numbered over the whole varlen batch: request ``i`` owns tile slots starting
  at ``query_start_loc[i] // BLOCK_Q + i``; a program finds its request by binary search over
  ``query_start_loc``. The number of slots, ``num_tokens // BLOCK_Q + num_seqs``, is an upper
  bound that depends only on tensor shapes, so the grid never depends on tensor values (CUDA-graph
  capturable, no host sync); slots past a request's last tile exit at once.
- A decode-only batch (``max_query_len == 1``) skips the search (its chain of dependent loads
  delays a program's first K/V load) and launches a 1-D grid, one program per request, KV head
  and segment, in batch order with each request's KV heads side by side. Programs start in grid
  order and the runner orders a batch longest context first, so over ragged contexts the long
  programs start first and the short ones fill the last wave. (In a ``(requests, kv heads)``
  grid the longest requests of the last KV heads started last and ended the kernel.)
- Why unified rather than a prefill kernel + a decode kernel: the engine's steps are mixed
  (chunked prefill rides along with decodes), and one launch with one code path serves them all;
  prefill, chunked prefill over a cached prefix and decode are the same computation (the query
  rows are the last ``q_len`` positions of a ``seq_len`` context, causal), so a second kernel
  would only duplicate the paging, masking and online-softmax code. What does differ between
  decode and prefill is the tile shape, and that is a launch-time choice (``_pick_tiles``, from
  the python int ``max_query_len``): 16 rows for decode (memory-bound: extra rows are wasted
  MMA work and registers), 128 rows for prefill (compute-bound: each K/V tile feeds more query
  rows, and wgmma needs 64-row multiples). A batch takes its longest request's tile, so the
  attention backend launches a mixed step's decodes (first in the batch) and its prefills apart:
  the prefills' launch is the batch from ``query_start_loc[num_decodes]`` on, so
  ``query_start_loc[0]`` may be above 0 (``query`` and ``out`` are still the whole batch's).
- Flash-decoding: with few sequences decoding, ``batch * num_kv_heads`` programs cannot fill
  132 SMs (batch 1 of Llama-3-8B: 8 programs). (The same holds for requests of a few queries:
  speculative decoding's token and drafts, up to ``SPLIT_MAX_QUERY_LEN``.) Then each request's context is split into
  ``NUM_SEGMENTS`` contiguous ranges of KV tiles, one program each; they write unnormalised
  partial outputs with their running max and sum, and a second small kernel merges them
  (log-sum-exp weights). The split factor comes from python ints only (batch shape,
  ``max_seq_len``); each program derives its range from the request's actual ``seq_len`` in the
  kernel, so the result is right for any lengths (pass ``max_seq_len = max_model_len`` when
  capturing a CUDA graph: it only sets how many segments there are).
- A decode launch is one program a (request, KV head) pair, in the batch's longest-first order:
  the GPU hands programs to SMs as they free up, longest first, which keeps the SMs busy to the
  end of ragged launches (on an H100, W1's decode batches read at 96% of the copy rate). Launches
  that shared the work out themselves lost: the balanced launch (equal shares of tiles cut
  across pairs, merged after; thirty-eighth session, -8.5% on W1) and the folded launch (pairs
  from both ends of the order a program, not cut; forty-third session, -5.6% on W1, H100).
- Programmatic dependent launch: the kernel before this one writes nothing it reads but this
  step's new K/V (it is the KV write; for a mixed step's second launch, the decodes' attention,
  which writes only their outputs), and every earlier kernel has completed when this one
  starts. So a program attends to the tiles wholly before its new tokens first and only then
  waits (``pdl_wait``): its first, dependent loads (block table, K/V) overlap the KV write
  instead of following it. On the H200 this took W2 Llama-3-8B batch 64 from 6.60 to 6.35 ms
  a step.
- Rotary embedding: no kernel of its own. The KV write rotates (and, for Qwen3 and Gemma 3,
  RMS-normalises) the new keys before storing them; the attention does the same to its queries as it loads them,
  each at its place in its context. The rotated half is a second, permuted read of the same row.
  This takes one kernel a layer out of every step, and the attention still reads all it needs
  before its PDL wait: the raw queries come from the qkv projection, two kernels back. (On the
  H200 no change to W1 or W2 showed beyond the 2-4% between machines; see BENCHMARKS.md.)
- A sliding window (``sliding_window``, Mistral-7B-v0.1's): a program starts at the tile of its
  first query's window and masks every tile (the window's lower edge moves with each query). A
  constexpr: without a window the kernel is the one it was (the same sm_90 PTX).
- Gemma 2's cap on the scores (``softcap``): ``cap * tanh(s / cap)`` on each tile's scores before
  the mask, tanh from ``exp2``; a constexpr too (0: none, the kernel as it was).
- CUDA graphs of mixed steps do not know at capture which requests are decodes: a launch with
  ``max_query_len = 1`` then skips the requests with more queries, and one with
  ``skip_decodes`` skips the decodes, so the two launches of a mixed step need no
  ``num_decodes``.
- Numerics: K/V tiles in the cache dtype, ``tl.dot`` into fp32, online softmax in fp32 with
  ``exp2`` (scale * log2(e) folded into the scores), P cast to the query dtype for the second
  dot (as flash-attention does). fp32 inputs use exact ("ieee") dots, not tf32.
- An FP8 cache (``reference.quantize_kv``): the KV write divides by the layer's scale and
  clamps; the attention loads one-byte tiles and widens them (exactly) for the dots, with
  ``k_scale`` folded into the score scale and ``v_scale`` into the output. Tensor cores take
  8-bit operands from shared memory only along the dot's reduction axis: K is loaded as K^T
  (head_dim along its rows), and the cache's blocks hold the values as (kv head, dim, token)
  (``reference.value_blocks``), so that P.V reads them along the context. (Stored token-major,
  a value tile was read one byte at a time.) With half-precision queries the dots run in fp16
  (``FP8_Q_DIVISOR``). On the H200 a decode reads at 2.4 TB/s of FP8, 1.2x the bf16 cache's
  speed: the widening and bf16's per-token work bound it, not its reads (BENCHMARKS.md).

Tiles to tune on the GPU are ``TILES`` and ``SPLIT_*`` below (module globals read at each call);
``benchmarks/attention_kernels.py`` measures the defaults and a few alternatives.
"""
import math

import torch
import triton
import triton.language as tl

from pagoda.kernels.reference import Rope, is_fp8
from pagoda.kernels.triton_utils import fix_interpreter_bugs, num_sms, pdl_launch, pdl_wait

# Tile shapes (Hopper defaults), keyed by BLOCK_M: the number of (query token, query head) rows
# per program. BLOCK_M is chosen per call to hold the longest request's queries of one GQA group
# (16 for decode, up to 128 for prefill); TILE_N is the number of context tokens per K/V tile
# (a multiple of 16; a tile may span several cache blocks, each token is addressed through the
# block table). Checked by compiling for sm_90 (ptxas -v): no spills at any of these in
# bf16/fp16, wgmma from BLOCK_M 64 up. Decode is capped at 128 registers, 4 programs per SM
# (ptxas would take up to 148 with the rotary, and fit 3).
TILES = {  # BLOCK_M: dict(TILE_N, num_warps, num_stages[, maxnreg])
    16: dict(TILE_N=64, num_warps=4, num_stages=3, maxnreg=128),
    32: dict(TILE_N=64, num_warps=4, num_stages=3),
    64: dict(TILE_N=64, num_warps=4, num_stages=3),
    # prefill: 128-token K/V tiles (the twenty-second session's sweep, BENCHMARKS.md)
    128: dict(TILE_N=128, num_warps=8, num_stages=3),
}
# A K/V tile of TILE_N tokens holds at most this many elements (its stages must fit in shared
# memory at head dims over 128)
MAX_TILE_ELEMENTS = 128 * 128
# Decode launches of many programs (W1's largest batches) in one-warp programs of 32-token tiles:
# no cross-warp reductions in a tile, and up to 16 programs an SM. On the H200 (BENCHMARKS.md,
# nineteenth session) batch 256 read 2-3% faster from a bf16 cache and 13-16% from an FP8 one,
# batch 128 (8 programs an SM) 11-10% slower.
MANY_DECODES = dict(TILE_N=32, num_warps=1, num_stages=3)
MANY_DECODES_PER_SM = 12
# FP8 cache, half-precision queries: the dots run in fp16, into which E4M3 / E5M2 widen in one
# instruction per pair (to bf16 they took three: the decode kernel was bound by them, not by
# its reads). The queries are divided by this on the way in (fp16 ends at 65,504).
FP8_Q_DIVISOR = tl.constexpr(256.0)
# On the GPU, fp32 inputs (a test dtype, not a serving one) use exact FMA dots, which spill at
# large tiles. (Not applied in the CPU interpreter, so that its tests cover the large tiles.)
MAX_BLOCK_M_CUDA = {torch.float32: 16}

# Flash-decoding: split the context when fewer than SPLIT_BELOW_PROGRAMS_PER_SM * num_SMs
# programs would run, into enough segments for about SPLIT_PROGRAMS_PER_SM * num_SMs programs
# (at most SPLIT_MAX_SEGMENTS, of at least SPLIT_MIN_TOKENS tokens each). Measured on the H200
# (BENCHMARKS.md, eleventh session; Qwen3-0.6B heads, 1,536-token contexts, in a CUDA graph):
# at batch 24 (192 programs) two segments took 53 us against 66 for one, at batch 32 (256)
# 65 against 70; at batch 40 (320) one segment was faster, 79 against 94.
SPLIT_BELOW_PROGRAMS_PER_SM = 2
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_MAX_SEGMENTS = 64
SPLIT_MIN_TOKENS = 128
# Requests of up to this many queries split too: speculative decoding's verification steps (a
# token and its drafts), whose one query tile a request would otherwise read a long context alone
# (H200, twenty-fifth session, Llama-3-8B heads, 5 queries: batch 1 over 8,192 tokens 236 -> 30
# us, batch 8 242 -> 113). Their programs do more work than a decode's: they split only below
# one program an SM (batch 32 over 2,048 tokens, two segments: 93 -> 120 us).
SPLIT_MAX_QUERY_LEN = 16
SPLIT_BELOW_PROGRAMS_PER_SM_QUERIES = 1


fix_interpreter_bugs()


def _rope_args(rope: Rope | None, of: str, head_dim: int, dummy: torch.Tensor) -> dict:
    """A kernel's rotary arguments for the queries (``of="q"``) or the keys (``"k"``): the
    cos/sin table and that side's norm weight, dummy pointers without ``rope``."""
    if rope is None:
        return dict(cos_sin_ptr=dummy, norm_ptr=dummy, stride_cs=0, eps=0.0, HAS_ROPE=False, HAS_NORM=False,
                    NORM_UNIT_OFFSET=False, ROTARY_DIM=head_dim)
    norm_weight = rope.q_norm_weight if of == "q" else rope.k_norm_weight
    cache = rope.cos_sin_cache
    # (the table's width is the rotary embedding's: less than head_dim where it turns part of
    # each head only, Phi-4-mini's)
    rotary_dim = cache.shape[-1]
    assert rotary_dim <= head_dim and cache.stride(-1) == 1 and rotary_dim % 2 == 0
    assert norm_weight is None or (norm_weight.shape == (head_dim,) and norm_weight.is_contiguous())
    return dict(cos_sin_ptr=cache, norm_ptr=dummy if norm_weight is None else norm_weight,
                stride_cs=cache.stride(0), eps=rope.eps, HAS_ROPE=True, HAS_NORM=norm_weight is not None,
                NORM_UNIT_OFFSET=rope.norm_unit_offset, ROTARY_DIM=rotary_dim)


@triton.jit
def _load_heads(ptr, row_off, row_valid, pos, cos_sin_ptr, stride_cs, norm_ptr, eps,
                HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, HAS_ROPE: tl.constexpr,
                HAS_NORM: tl.constexpr, NORM_UNIT_OFFSET: tl.constexpr, ROTARY_DIM: tl.constexpr):
    """Rows of head vectors ``ptr + row_off[r] + d``, with rotary at positions ``pos[r]`` if
    HAS_ROPE (each head RMS-normalised first if HAS_NORM; Gemma's norm if NORM_UNIT_OFFSET). The
    rotated half is a second, permuted read of the same row (``d -> d +- ROTARY_DIM / 2``; the
    dimensions from ROTARY_DIM on, where it is less than HEAD_DIM, pass unrotated). The
    roundings are those of the torch path: normalised back to the dtype, times the weight back to
    the dtype (Gemma's: times 1 + w in float32, then back), the rotation in float32 rounded once."""
    d = tl.arange(0, HEAD_DIM_P)
    mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(ptr + row_off[:, None] + d[None, :], mask=mask, other=0.0)
    if HAS_ROPE:
        # every load first, then the arithmetic: the loads are then in flight together
        HALF: tl.constexpr = ROTARY_DIM // 2
        first = d < HALF
        if ROTARY_DIM == HEAD_DIM:
            partner = tl.where(first, d + HALF, d - HALF)
            turned = mask
        else:
            partner = tl.where(first, d + HALF, tl.where(d < ROTARY_DIM, d - HALF, d))
            turned = mask & (d < ROTARY_DIM)[None, :]
        xp = tl.load(ptr + row_off[:, None] + partner[None, :], mask=mask, other=0.0)
        cs = cos_sin_ptr + pos.to(tl.int64)[:, None] * stride_cs + tl.where(first, d, d - HALF)[None, :]
        cos = tl.load(cs, mask=turned, other=0.0)
        sin = tl.load(cs + HALF, mask=turned, other=0.0)
        xf, xpf = x.to(tl.float32), xp.to(tl.float32)
        if HAS_NORM:
            w = tl.load(norm_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
            wp = tl.load(norm_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
            rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
            if NORM_UNIT_OFFSET:
                xf = (xf * rstd * (1.0 + w)).to(x.dtype).to(tl.float32)
                xpf = (xpf * rstd * (1.0 + wp)).to(x.dtype).to(tl.float32)
            else:
                xf = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
                xpf = ((xpf * rstd).to(x.dtype).to(tl.float32) * wp).to(x.dtype).to(tl.float32)
        # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin
        x = xf * cos + xpf * tl.where(first[None, :], -sin, sin)
        if ROTARY_DIM != HEAD_DIM:
            x = tl.where((d < ROTARY_DIM)[None, :], x, xf)
        x = x.to(xp.dtype)
    return x


# --------------------------------------------------------------------------------------------
# KV cache write
# --------------------------------------------------------------------------------------------

@triton.jit
def _write_kv_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           pos_ptr, cos_sin_ptr, norm_ptr, stride_cs, eps, k_inv_scale, v_inv_scale,
                           stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cslot, stride_chead,
                           NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEADS_P: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                           BLOCK_SIZE: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
                           FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr, NORM_UNIT_OFFSET: tl.constexpr,
                           ROTARY_DIM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    # (the slot mapping is a step input, written before the previous kernel started)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (CUDA-graph batches): nothing to write
        return
    pdl_wait(USE_PDL)
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)[None, :]
    heads = offs_h < NUM_KV_HEADS
    mask = heads[:, None] & (offs_d < HEAD_DIM)
    pos = 0
    if HAS_ROPE:
        pos = tl.load(pos_ptr + token)
    k = _load_heads(key_ptr, token * stride_kt + offs_h * stride_kh, heads, pos + 0 * offs_h, cos_sin_ptr,
                    stride_cs, norm_ptr, eps, HEAD_DIM, HEAD_DIM_P, HAS_ROPE, HAS_NORM, NORM_UNIT_OFFSET,
                    ROTARY_DIM)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d, mask=mask)
    if FP8_MAX > 0:  # (reference.quantize_kv)
        k = tl.minimum(tl.maximum(k.to(tl.float32) * k_inv_scale, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * v_inv_scale, -FP8_MAX), FP8_MAX)
    dst = slot * stride_cslot + offs_h[:, None] * stride_chead + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if v_cache_ptr.dtype.element_ty.primitive_bitwidth == 8:   # a block's values as (head, dim, token)
        offset = slot % BLOCK_SIZE
        dst = (slot - offset) * stride_cslot + offs_h[:, None] * stride_chead * BLOCK_SIZE + offs_d * BLOCK_SIZE + offset
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, rope: Rope | None = None,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new K/V ``(num_tokens, num_kv_heads, head_dim)`` into ``kv_cache`` at
    ``slot_mapping`` (int32 or int64), the keys rotated (and k-normed) by ``rope`` if given
    (``key`` itself is left unchanged), quantized with ``k_scale`` / ``v_scale`` into an FP8
    cache. A slot of -1 is skipped (padding tokens). K/V may be strided views (e.g. slices of a
    fused qkv output) as long as ``head_dim`` is contiguous."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape[0] == num_tokens
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.is_contiguous()
    if num_tokens == 0:
        return
    assert rope is None or (rope.positions.shape[0] >= num_tokens and rope.positions.is_contiguous())
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # A slot index addresses (block, offset) of the flattened (num_blocks * block_size) axis.
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        stride_kt=key.stride(0), stride_kh=key.stride(1), stride_vt=value.stride(0), stride_vh=value.stride(1),
        stride_cslot=k_cache.stride(1), stride_chead=k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=kv_cache.shape[2],
        HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM_P=triton.next_power_of_2(head_dim),
        pos_ptr=key if rope is None else rope.positions, k_inv_scale=1.0 / k_scale, v_inv_scale=1.0 / v_scale,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if is_fp8(kv_cache.dtype) else 0.0,
        **_rope_args(rope, "k", head_dim, key), **pdl_launch(key.device),
        num_warps=4)


@triton.jit
def _copy_blocks_kernel(cache_ptr, src_ptr, dst_ptr, num_blocks, block_numel, BLOCK: tl.constexpr):
    # Program (pair, k-or-v, chunk): one BLOCK-element chunk of one block of K or V.
    pair, kv, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = kv * num_blocks
    src = (tl.load(src_ptr + pair).to(tl.int64) + base) * block_numel
    dst = (tl.load(dst_ptr + pair).to(tl.int64) + base) * block_numel
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    tl.store(cache_ptr + dst + offs, tl.load(cache_ptr + src + offs, mask=mask), mask=mask)


def copy_blocks_triton(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (K and V) in every layer's cache: one launch per
    layer, no temporary."""
    if src.numel() == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()      # the kernel indexes them densely
    _, num_blocks, *block_shape = kv_caches[0].shape
    block_numel = math.prod(block_shape)
    BLOCK = min(4096, triton.next_power_of_2(block_numel))
    grid = (src.numel(), 2, triton.cdiv(block_numel, BLOCK))
    for cache in kv_caches:
        assert cache.is_contiguous()
        _copy_blocks_kernel[grid](cache, src, dst, num_blocks, block_numel, BLOCK=BLOCK)


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------

@triton.jit
def _find_request(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest request i whose first tile slot ``query_start_loc[i] // BLOCK_Q + i`` is <= q_tile
    (the slots are strictly increasing in i, so binary search)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_slot = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_slot <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table, t, kv_end, q_pos, kv_head, m_i, l_i, acc, qk_scale,
                 stride_kb, stride_ks, stride_kh, offs_d, d_valid,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 MASKED: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    """One K/V tile of TILE_N context tokens into the online softmax (m_i, l_i, acc). A tile
    wholly before every query of the program, and before kv_end, needs no mask (MASKED=False):
    its loads and scores then skip the predicates and the select. (With a sliding WINDOW every
    tile is masked: a query attends to positions (q_pos - WINDOW, q_pos].)"""
    offs_n = t * TILE_N + tl.arange(0, TILE_N)
    # Each context token through the block table: (physical block, offset in block).
    if MASKED:
        n_valid = offs_n < kv_end
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
    else:
        block = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
    kv_off = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    # (pointers as base + row offset + column: an int64 offset tensor of the tile would cost
    # registers)
    ONE_BYTE: tl.constexpr = v_cache_ptr.dtype.element_ty.primitive_bitwidth == 8
    if ONE_BYTE:
        # K read as K^T and V from (head, dim, token) blocks: both tiles along the dots'
        # reduction axis, which 8-bit operands need (triton_attention's docstring)
        kt_ptrs = k_cache_ptr + kv_off[None, :] + offs_d[:, None]
        v_off = block * stride_kb + kv_head * stride_kh * BLOCK_SIZE + offs_n % BLOCK_SIZE
        v_ptrs = v_cache_ptr + v_off[:, None] + offs_d[None, :] * BLOCK_SIZE
        if MASKED:
            kt = tl.load(kt_ptrs, mask=d_valid[:, None] & n_valid[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_valid[None, :], other=0.0)
        else:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
    else:
        k_ptrs = k_cache_ptr + kv_off[:, None] + offs_d[None, :]
        v_ptrs = v_cache_ptr + kv_off[:, None] + offs_d[None, :]
        if MASKED:
            # Masked loads return 0, never stale cache contents (which may be NaN).
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        kt = tl.trans(k)

    s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if SOFTCAP > 0:   # Gemma 2's cap * tanh(s / cap), in s's log2 units (SOFTCAP: the cap times log2 e)
        s = SOFTCAP * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 * 1.4426950408889634 / SOFTCAP)) + 1.0))
    if MASKED:
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if WINDOW > 0:
            allowed &= offs_n[None, :] > q_pos[:, None] - WINDOW
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with nothing allowed yet keep m = -inf; subtract 0 there so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


# Not specialized on the values that change every step (Triton would compile a variant for
# each of: equal to 1, divisible by 16, neither), nor on the alignment of the per-request
# metadata, which a mixed step passes from request `first` on (16-byte aligned or not with
# `first`): a cold compile inside a run costs about a second.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        part_acc_ptr, part_m_ptr, part_l_ptr,       # flash-decoding scratch (NUM_SEGMENTS > 1)
        block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        qk_scale, v_scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh, stride_bt,
        cos_sin_ptr, norm_ptr, stride_cs, eps,   # rotary of the queries (Rope)
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr, LOOP_STAGES: tl.constexpr,
        DECODE: tl.constexpr, SKIP_DECODES: tl.constexpr, HAS_ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
        FP8_DOTS_F16: tl.constexpr, USE_PDL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
        NORM_UNIT_OFFSET: tl.constexpr, ROTARY_DIM: tl.constexpr):
    # (pdl_wait comes after the tiles of the old context: see the K/V loops)
    if DECODE:
        # At most one query token per request: no search (its dependent loads are most of a
        # short context's start-up). A 1-D grid in batch order, a request's KV heads and
        # segments next to each other: programs start in grid order, so a batch ordered longest
        # context first starts its longest programs first and its shortest fill the last wave.
        NUM_KV_HEADS: tl.constexpr = NUM_HEADS // GROUP
        pid = tl.program_id(0)
        segment = pid % NUM_SEGMENTS
        kv_head = (pid // NUM_SEGMENTS) % NUM_KV_HEADS
        seq = pid // (NUM_SEGMENTS * NUM_KV_HEADS)
        local_tile = 0
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    else:
        q_tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        segment = tl.program_id(2)
        # (-1 for the slots before the first request's when query_start_loc[0] > 0)
        seq = tl.maximum(_find_request(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q), 0)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        local_tile = q_tile - (q_start // BLOCK_Q + seq)
    # (loaded before the exit test, in parallel with query_start_loc: one dependent load fewer
    # before the first K/V tile; seq is a valid request index in every program)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A spare slot of the grid, or a request with no query; a request with several queries in a
    # decode launch, or a decode in a launch that skips them: another launch attends to those.
    skip = (local_tile < 0) | (local_tile * BLOCK_Q >= q_len)
    if DECODE:
        skip |= q_len > 1
    if SKIP_DECODES:
        skip |= q_len == 1
    if skip:
        # At least one program of every launch must wait (triton_utils): in a mixed-step graph
        # with no decodes, every program of the decode launch skips.
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            pdl_wait(USE_PDL)
        return
    context_len = seq_len - q_len  # tokens already in the cache before this step's queries

    # Row r of the tile: query token local_tile * BLOCK_Q + r // GROUP, head r % GROUP of the group.
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = local_tile * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = context_len + q_idx  # position of the query in its sequence (causal limit)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    # The raw q is the qkv projection's output, two kernels back: safe before the wait. Its
    # rotary position is q_pos (a request's positions are its context's last ones), not a load
    # of the positions: that would be one more dependent load before the first K/V tile.
    q = _load_heads(q_ptr, token * stride_qt + head * stride_qh, row_valid, q_pos, cos_sin_ptr,
                    stride_cs, norm_ptr, eps, HEAD_DIM, HEAD_DIM_P, HAS_ROPE, HAS_NORM, NORM_UNIT_OFFSET,
                    ROTARY_DIM)
    if FP8_DOTS_F16:  # the dots in fp16, q / 256 so that it cannot overflow (qk_scale * 256)
        q = (q.to(tl.float32) * (1.0 / FP8_Q_DIVISOR)).to(tl.float16)

    # Context range of this tile: up to its last query's position (causal), split into segments.
    kv_end = tl.minimum(seq_len, context_len + tl.minimum((local_tile + 1) * BLOCK_Q, q_len))
    num_tiles = tl.cdiv(kv_end, TILE_N)
    if WINDOW > 0:   # from the tile of the first query's earliest position in its window
        tile_start = tl.maximum(context_len + local_tile * BLOCK_Q - WINDOW + 1, 0) // TILE_N
    else:
        tile_start = 0
    tiles_per_segment = tl.cdiv(num_tiles - tile_start, NUM_SEGMENTS)
    tile_lo = tile_start + segment * tiles_per_segment
    tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    EDGES: tl.constexpr = (HEAD_DIM != HEAD_DIM_P) or (WINDOW > 0)   # masks in the tiles otherwise unmasked

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp2
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # The tiles wholly before this step's new tokens, before waiting for the previous kernel
    # (PDL): that kernel writes only the new tokens' K/V (write_kv_cache_triton), and everything
    # else this kernel reads was written by kernels that had completed before it could start.
    # So the attention's first loads overlap that kernel instead of following it. tl.range with
    # num_stages: the kernel-level num_stages does not pipeline these loops, whose loads are
    # indirect (block table -> K/V); without it each tile's loads wait in turn.
    tile_mid = tl.minimum(tl.maximum(context_len // TILE_N, tile_lo), tile_hi)
    # Those tiles are also wholly before every query of the tile (causal) and before kv_end: no
    # masks (when HEAD_DIM is a power of two; the padded columns of another need theirs).
    for t in tl.range(tile_lo, tile_mid, num_stages=LOOP_STAGES):
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, t, kv_end, q_pos, kv_head, m_i, l_i,
                                     acc, qk_scale, stride_kb, stride_ks, stride_kh, offs_d, d_valid,
                                     BLOCK_SIZE, TILE_N, DOT_PRECISION, EDGES, WINDOW, SOFTCAP)
    pdl_wait(USE_PDL)
    if DECODE:  # the new token's tile, the last, if this segment has it: no second loop body
        if tile_mid < tile_hi:
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, tile_mid, kv_end, q_pos, kv_head,
                                         m_i, l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh, offs_d,
                                         d_valid, BLOCK_SIZE, TILE_N, DOT_PRECISION, True, WINDOW, SOFTCAP)
    else:
        # The new tokens' tiles: those wholly at or before the tile's first query are before every
        # query of the tile (causal) and before kv_end, so unmasked too; only the diagonal's are
        # masked (one or two a program, where every tile was masked before).
        tile_diag = tl.minimum(tl.maximum((context_len + local_tile * BLOCK_Q + 1) // TILE_N, tile_mid), tile_hi)
        for t in tl.range(tile_mid, tile_diag, num_stages=LOOP_STAGES):
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, t, kv_end, q_pos, kv_head, m_i,
                                         l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh, offs_d, d_valid,
                                         BLOCK_SIZE, TILE_N, DOT_PRECISION, EDGES, WINDOW, SOFTCAP)
        for t in tl.range(tile_diag, tile_hi, num_stages=LOOP_STAGES):
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table, t, kv_end, q_pos, kv_head, m_i,
                                         l_i, acc, qk_scale, stride_kb, stride_ks, stride_kh, offs_d, d_valid,
                                         BLOCK_SIZE, TILE_N, DOT_PRECISION, True, WINDOW, SOFTCAP)

    acc *= v_scale
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])
    else:
        # Partials, contiguous (num_tokens, num_heads, NUM_SEGMENTS[, HEAD_DIM_P]); an empty
        # segment writes m = -inf, l = 0, acc = 0 and weighs nothing in the merge.
        part = (token * NUM_HEADS + head) * NUM_SEGMENTS + segment
        tl.store(part_m_ptr + part, m_i, mask=row_valid)
        tl.store(part_l_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], acc,
                 mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["query_start_loc_ptr"])
def _merge_segments_kernel(out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, query_start_loc_ptr,
                           num_seqs, stride_ot, stride_oh,
                           NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_P: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DECODE: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """The segments' partial outputs of a row and head, weighed by their sums. A program a row
    (a request's query), or with ``DECODE`` a request, which is merged only if it has one query:
    the decode launch of a mixed step wrote no partials for the others. Rows of no request
    (padding, or before query_start_loc[0]) are left untouched. (The query ranges are step
    inputs: read before waiting for the attention kernel.)"""
    head = tl.program_id(1)
    if DECODE:
        token = tl.load(query_start_loc_ptr + tl.program_id(0))
        if tl.load(query_start_loc_ptr + tl.program_id(0) + 1) - token != 1:
            return
    else:
        token = tl.program_id(0)
        if (token < tl.load(query_start_loc_ptr)) | (token >= tl.load(query_start_loc_ptr + num_seqs)):
            return
    pdl_wait(USE_PDL)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    part = (token.to(tl.int64) * NUM_HEADS + head) * NUM_SEGMENTS + offs_s
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :])
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty segments -> 0
    out = tl.sum(acc * w[:, None], 0) / tl.maximum(tl.sum(l * w, 0), 1e-30)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _pick_tiles(max_query_len: int, group: int, dtype: torch.dtype, device: torch.device,
                num_programs: int) -> tuple[int, dict]:
    """BLOCK_M and its launch parameters, from python ints: enough rows for the longest
    request's queries of one GQA group, at least 16 (tl.dot) and at least one whole group."""
    rows = triton.next_power_of_2(max_query_len * group)
    cap = MAX_BLOCK_M_CUDA.get(dtype, max(TILES)) if device.type == "cuda" else max(TILES)
    block_m = max(min(rows, cap), min(TILES), triton.next_power_of_2(group))
    if block_m == min(TILES) and max_query_len == 1 and num_programs >= MANY_DECODES_PER_SM * num_sms(device):
        return block_m, dict(MANY_DECODES)
    return block_m, dict(TILES[min(block_m, max(TILES))])


def _pick_num_segments(num_programs: int, max_query_len: int, max_seq_len: int,
                       device: torch.device) -> int:
    """Flash-decoding split factor (a power of two) from python ints only."""
    target = SPLIT_PROGRAMS_PER_SM * num_sms(device)
    below = SPLIT_BELOW_PROGRAMS_PER_SM if max_query_len == 1 else SPLIT_BELOW_PROGRAMS_PER_SM_QUERIES
    if max_query_len > SPLIT_MAX_QUERY_LEN or num_programs >= below * num_sms(device):
        return 1
    want = triton.next_power_of_2(triton.cdiv(target, num_programs))
    fit = max(1, max_seq_len // SPLIT_MIN_TOKENS)  # don't cut segments shorter than this
    return max(1, min(want, SPLIT_MAX_SEGMENTS, 1 << (fit.bit_length() - 1)))


def paged_attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                           max_seq_len: int | None = None, max_query_len: int | None = None,
                           out: torch.Tensor | None = None,
                           num_segments: int | None = None, rope: Rope | None = None,
                           skip_decodes: bool = False, k_scale: float = 1.0, v_scale: float = 1.0,
                           sliding_window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a varlen batch against its paged context; same contract as
    ``reference.paged_attention``. ``query``: ``(num_tokens, num_heads, head_dim)`` (strided
    views fine, head_dim contiguous); ``kv_cache``: ``(2, num_blocks, block_size, num_kv_heads,
    head_dim)``; ``block_tables`` int32 ``(batch, max_blocks)``; ``seq_lens`` int32 ``(batch,)``;
    ``query_start_loc`` int32 ``(batch + 1,)``; it may start above 0, for the requests of a larger
    batch from that token on (``query`` and ``out`` still that batch's: other rows untouched).
    ``max_seq_len`` / ``max_query_len`` are python ints
    (upper bounds are fine); when given, the call makes no host sync and its grid depends only on
    them and on shapes (CUDA-graph capturable). Writes into ``out`` if given (rows past
    ``query_start_loc[-1]`` are left untouched) and returns it. ``num_segments`` forces the
    flash-decoding split factor (a power of two; tests and tuning), otherwise chosen here.
    ``rope``: rotary embedding (and q norm) applied to the queries as they are read (``query``
    itself is left unchanged), each at its place in its context: ``seq_len - q_len + i`` for
    the request's i-th query, which is what the runner's positions are (``rope.positions`` is
    not read here). ``k_scale`` / ``v_scale``: an FP8 cache's (``reference.quantize_kv``).
    ``sliding_window`` (0: none): each query attends to its last ``sliding_window`` positions.
    ``softcap`` (0: none): the scores capped to ``softcap * tanh(score / softcap)`` (Gemma 2's).

    One batch of decodes and longer requests in any order can be attended by two launches, each
    leaving the other's requests alone (a CUDA graph of mixed steps, where which requests are
    decodes is not known at capture): ``max_query_len=1`` attends only the requests with one
    query, ``skip_decodes=True`` only the others.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    assert num_heads == group * num_kv_heads and kv_cache.shape[4] == head_dim
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1
    if max_seq_len is None:  # host syncs; pass them in on the hot path
        max_seq_len = int(seq_lens.max())
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    decode = max_query_len == 1
    if skip_decodes:
        # The second of a mixed graph's launches: the merge of a split one would write every row
        # of the batch, the decodes' that the first launch wrote among them (its grid is the
        # tokens, not knowing which requests they belong to). Such launches split only where the
        # graph's prompts are of a few tokens at most (SPLIT_MAX_QUERY_LEN).
        num_segments = 1
    elif num_segments is None:
        # (for decode, each request has one query tile per KV head)
        num_segments = _pick_num_segments(num_seqs * num_kv_heads, max_query_len,
                                          min(max_seq_len, sliding_window or max_seq_len), query.device)
    assert num_segments >= 1 and num_segments & (num_segments - 1) == 0
    block_m, tiles = _pick_tiles(max_query_len, group, query.dtype, query.device, num_seqs * num_kv_heads)
    head_dim_p = triton.next_power_of_2(head_dim)
    tiles["TILE_N"] = _cap_tile_n(tiles["TILE_N"], head_dim_p)
    block_q = block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    dots_f16 = is_fp8(kv_cache.dtype) and query.dtype != torch.float32
    if dots_f16:
        k_scale *= FP8_Q_DIVISOR.value
    if num_segments > 1:
        part_m = torch.empty(num_tokens, num_heads, num_segments, device=query.device,
                             dtype=torch.float32)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_segments, head_dim_p,
                               device=query.device, dtype=torch.float32)
    else:
        part_m = part_l = part_acc = out  # unused

    if decode:   # one tile per request, KV head and segment, flattened in batch order
        grid = (num_seqs * num_kv_heads * num_segments,)
    else:        # query tile slots: an upper bound, from shapes only
        grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_segments)
    _paged_attention_kernel[grid](
        query, k_cache, v_cache, out, part_acc, part_m, part_l,
        block_tables, seq_lens, query_start_loc,
        scale * k_scale * math.log2(math.e), v_scale, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        **_rope_args(rope, "q", head_dim, query),
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q,
        NUM_SEGMENTS=num_segments,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        LOOP_STAGES=tiles["num_stages"], DECODE=decode, SKIP_DECODES=skip_decodes, FP8_DOTS_F16=dots_f16,
        WINDOW=sliding_window, SOFTCAP=softcap * math.log2(math.e), **tiles, **pdl_launch(query.device))
    if num_segments > 1:
        _merge_segments_kernel[(num_seqs if decode else num_tokens, num_heads)](
            out, part_acc, part_m, part_l, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
            NUM_SEGMENTS=num_segments, DECODE=decode, num_warps=4, **pdl_launch(out.device))
    return out


def _cap_tile_n(tile_n: int, head_dim_p: int) -> int:
    """TILE_N at most MAX_TILE_ELEMENTS // head_dim_p tokens (head dims over 128), at least 16."""
    return min(tile_n, max(16, MAX_TILE_ELEMENTS // head_dim_p))
