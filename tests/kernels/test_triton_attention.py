"""Triton paged-attention kernels against the torch reference (pagoda.kernels.reference).

Without a CUDA device the kernels run in Triton's CPU interpreter at small shapes (fp32);
with one they run compiled, at full shapes (4,000-token contexts), in bf16 and fp16 (and fp32
once over the cases). Bounds: ||out - ref|| / ||ref|| < 1e-3 (fp32), < 1e-2 (bf16, fp16), the
reference computed in fp32 from the same inputs.
On the GPU: ``pytest tests/kernels/test_triton_attention.py -q``.
"""
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels import triton_attention as ta
from tests.paged_inputs import random_block_tables

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]  # the shape matrix
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}
LONG = 4000 if ON_GPU else 300          # "long context" for decode
PREFILL = 1024 if ON_GPU else 40        # prefill length
# A prefill whose query tiles start past the first K/V tiles (which they attend unmasked) and
# a chunk over a cached prefix that does the same: at least 2-3 KV tiles of 64 tokens
LONG_PREFILL = 2048 + 21 if ON_GPU else 150
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 4
HEADS = [(8, 8), (24, 8), (32, 8)] if ON_GPU else [(2, 2), (6, 2), (8, 2)]


def seed_for(request) -> torch.Generator:
    """A fresh, reproducible stream per test case (seeded by its id)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen):
    """Random query, cache and block tables for a varlen batch. Each request gets distinct
    physical blocks in random order; unused table entries point at random (valid) blocks."""
    tables, num_blocks = random_block_tables(seq_lens, block_size, gen, spare_blocks=4, spare_cols=1)
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    to = dict(device=DEVICE)
    return (query.to(dtype=dtype, **to), kv_cache.to(dtype=dtype, **to),
            tables.to(torch.int32).to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to),
            qsl.to(**to))


def check_attention(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen,
                    num_segments=None, max_seq_len=None, sliding_window=0, softcap=0.0):
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen)
    scale = head_dim ** -0.5
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale,
                                    sliding_window=sliding_window, softcap=softcap)
    out = torch.full_like(query, float("nan"))  # poison: every element must be written
    ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale,
                              max_seq_len or max(seq_lens), max(q_lens), out=out,
                              num_segments=num_segments, sliding_window=sliding_window, softcap=softcap)
    assert not out.isnan().any(), "unwritten (or NaN) output elements"
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    return err


# --------------------------------------------------------------------------------------------
# attention: the shape matrix

CASES = {  # name: (q_lens, seq_lens)
    "decode_ctx1": ([1], [1]),
    "decode_long": ([1, 1, 1], [LONG, 77, LONG - 7]),
    "prefill": ([PREFILL, 37], [PREFILL, 37]),
    "chunked_prefill": ([PREFILL // 2 + 3, 20], [PREFILL + 29, 20 + 45]),
    "long_prefill": ([LONG_PREFILL, 100], [LONG_PREFILL, 70 + 100]),
    "mixed": ([1, 25, 1, 7, 1], [LONG // 2 + 1, 25, 40, 7 + 60, 1]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}")
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention(case, heads, head_dim, block_size, dtype, request):
    q_lens, seq_lens = CASES[case]
    check_attention(q_lens, seq_lens, *heads, head_dim, block_size, dtype, seed_for(request))


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_head_dim_256(case, request):
    """Gemma's heads (256: Gemma 2 / 3; one KV head, GQA 4, as Gemma-3-1B's)."""
    q_lens, seq_lens = CASES[case]
    check_attention(q_lens, seq_lens, 4, 1, 256, 16, DTYPES[0], seed_for(request))


@pytest.mark.skipif(ON_GPU, reason="fp16 is in the GPU matrix already")
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_fp16_cpu(case, request):
    # Half-precision paths (P cast to the value dtype) in the interpreter. Not bf16: triton
    # 3.6's interpreter multiplies bf16 tl.dot operands as their raw uint16 bits.
    q_lens, seq_lens = CASES[case]
    check_attention(q_lens, seq_lens, *HEADS[2], 128, 16, torch.float16, seed_for(request))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="fp32 is the CPU matrix's dtype already")
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_fp32_gpu(case, request):
    q_lens, seq_lens = CASES[case]
    check_attention(q_lens, seq_lens, *HEADS[2], 128, 16, torch.float32, seed_for(request))


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# K/V scales that make the FP8 values span their range (N(0, 1) / 0.02: up to about 250)
KV_SCALES = (0.02, 0.03)


@pytest.mark.parametrize("dtype", [DTYPES[0], torch.float16], ids=str)
@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_fp8_cache(case, fp8, dtype, request):
    """An FP8 cache: the kernel reads the same bytes as the reference, which dequantizes them
    (times k_scale / v_scale) and attends in float32; the kernel widens them to fp16 for half
    queries (FP8_DOTS_F16), to float32 for float32 ones."""
    q_lens, seq_lens = CASES[case]
    gen = seed_for(request)
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[1], 128, 16, torch.float32, gen)
    k_scale, v_scale = KV_SCALES
    cache = reference.quantize_kv_cache(kv_cache, fp8, k_scale, v_scale)
    scale = 128 ** -0.5
    ref = reference.paged_attention(query, cache, tables, seq_lens_t, qsl, scale, k_scale=k_scale, v_scale=v_scale)
    # (the fp8 values are those of K / V to 2-3 bits: against the unquantized attention, far off)
    exact = reference.paged_attention(query, kv_cache, tables, seq_lens_t, qsl, scale)
    assert 1e-3 < rel_err(ref, exact) < 0.2
    out = ta.paged_attention_triton(query.to(dtype), cache, tables, seq_lens_t, qsl, scale, max(seq_lens), max(q_lens),
                                    k_scale=k_scale, v_scale=v_scale)
    err = rel_err(out, ref)
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# --------------------------------------------------------------------------------------------
# attention: flash-decoding split, bounds, strides, padding, stale cache


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["model-dtype cache", "fp8 cache"])
@pytest.mark.parametrize("case", ["decode_ctx1", "decode_long"])
def test_many_decodes_tiles(case, kv_dtype, monkeypatch, request):
    """The one-warp tiles of launches with many decode programs (MANY_DECODES), here for any."""
    monkeypatch.setattr(ta, "MANY_DECODES_PER_SM", 0)
    q_lens, seq_lens = CASES[case]
    gen = seed_for(request)
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[1], 128, 16, DTYPES[0], gen)
    if kv_dtype is not None:
        kv_cache = reference.quantize_kv_cache(kv_cache.float(), kv_dtype)
    ref = reference.paged_attention(query.float(), kv_cache if kv_dtype else kv_cache.float(), tables, seq_lens_t,
                                    qsl, 128 ** -0.5)
    out = ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, 128 ** -0.5, max(seq_lens), 1)
    assert ta._pick_tiles(1, 3, query.dtype, query.device, 1)[1] == ta.MANY_DECODES
    assert rel_err(out, ref) < TOLERANCE[DTYPES[0]]


@pytest.mark.parametrize("num_segments", [1, 2, 16])
def test_split_kv_decode(num_segments, request):
    # 16 segments over 17 tokens (one tile) leaves most segments empty: they must weigh nothing.
    check_attention([1, 1, 1, 1], [LONG, 17, LONG // 2 + 5, 1], *HEADS[2], 128, 16,
                    DTYPES[-1], seed_for(request), num_segments=num_segments)


@pytest.mark.parametrize("num_segments", [1, 4])
def test_decode_launch_of_a_mixed_step(num_segments, request):
    """A mixed step's decode launch, split or not: the decodes' rows attended, the prefills'
    (another launch's) left untouched, by the attention and by the split's merge."""
    gen = seed_for(request)
    q_lens, seq_lens = [1, 9, 1, 1, 4, 1], [LONG, 40, 300, 77, 4, 1]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[1], 64, 16, DTYPES[0], gen)
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, 64 ** -0.5)
    out = torch.full_like(query, float("nan"))
    ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, 64 ** -0.5, LONG, 1, out=out,
                              num_segments=num_segments)
    decode_rows = (qsl[:-1][torch.tensor(q_lens) == 1]).long()
    others = torch.ones(len(query), dtype=torch.bool)
    others[decode_rows.cpu()] = False
    assert out[others.to(DEVICE)].isnan().all(), "a prefill's rows were written by the decode launch"
    assert rel_err(out[decode_rows], ref[decode_rows]) < TOLERANCE[DTYPES[0]]


def test_mixed_graph_launches_of_short_prompts(request):
    """A mixed step's two launches over the whole batch (a CUDA graph's), the decodes' first:
    with prompts as short as a draft run's (a graph of max_num_batched_tokens <= 16) the second
    launch could split, and its merge then overwrote the decodes' rows with its empty partials."""
    gen = seed_for(request)
    q_lens, seq_lens = [1, 5, 1, 3], [LONG, 40, 300, 3]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[1], 64, 16, DTYPES[0], gen)
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, 64 ** -0.5)
    out = torch.full_like(query, float("nan"))
    for max_query_len, skip_decodes in [(1, False), (max(q_lens), True)]:
        ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, 64 ** -0.5, LONG, max_query_len,
                                  out=out, skip_decodes=skip_decodes)
    assert rel_err(out, ref) < TOLERANCE[DTYPES[0]]


WINDOW = 1000 if ON_GPU else 37     # (not a multiple of a block or a tile)


@pytest.mark.parametrize("case", ["decode_long", "prefill", "chunked_prefill", "long_prefill", "mixed"])
def test_sliding_window(case, request):
    """Mistral-7B-v0.1's sliding window: each query attends to its last WINDOW positions only."""
    check_attention(*CASES[case], *HEADS[1], 64, 16, DTYPES[0], seed_for(request), sliding_window=WINDOW)


@pytest.mark.parametrize("num_segments", [2, 8])
def test_sliding_window_split_kv(num_segments, request):
    # segments over the window alone, some empty (a context shorter than the window, or of one tile)
    check_attention([1, 1, 1, 1], [LONG, 17, WINDOW + 3, 1], *HEADS[2], 128, 16, DTYPES[-1], seed_for(request),
                    num_segments=num_segments, sliding_window=WINDOW)


@pytest.mark.parametrize("case", ["decode_long", "prefill", "chunked_prefill", "mixed"])
def test_softcap(case, request):
    """Gemma 2's tanh cap on the scores (here 1.0, which the random scores often pass), with its
    sliding window on too."""
    check_attention(*CASES[case], *HEADS[1], 64, 16, DTYPES[0], seed_for(request), softcap=1.0)
    check_attention(*CASES[case], *HEADS[1], 64, 16, DTYPES[0], seed_for(request), softcap=1.0,
                    sliding_window=WINDOW)


def test_softcap_split_kv(request):
    check_attention([1, 1, 1], [LONG, 17, 1], *HEADS[2], 128, 16, DTYPES[-1], seed_for(request), num_segments=4,
                    softcap=1.0)


def test_split_kv_chosen_for_few_long_decodes(monkeypatch):
    dev = torch.device(DEVICE)
    assert ta._pick_num_segments(8, 1, 4000, dev) > 1          # batch 1, 8 KV heads
    assert ta._pick_num_segments(8 * 256, 1, 4000, dev) == 1   # batch 256 fills the chip
    assert ta._pick_num_segments(8 * 16, 1, 4000, dev) > 1     # batch 16: fewer programs than SMs
    assert ta._pick_num_segments(8 * 32, 1, 4000, dev) == 2    # batch 32: under two per SM
    assert ta._pick_num_segments(8 * 40, 1, 4000, dev) == 1    # batch 40: two per SM already
    assert ta._pick_num_segments(8, 64, 4000, dev) == 1        # a prefill
    assert ta._pick_num_segments(8, 5, 4000, dev) > 1          # a token and 4 drafts
    assert ta._pick_num_segments(8 * 16, 5, 4000, dev) > 1     # 16 of them: under one program an SM
    assert ta._pick_num_segments(8 * 32, 5, 4000, dev) == 1    # 32: their programs fill the chip
    assert ta._pick_num_segments(8, 1, 100, dev) == 1          # too short to split
    monkeypatch.setattr(ta, "SPLIT_BELOW_PROGRAMS_PER_SM", 4)
    monkeypatch.setattr(ta, "SPLIT_PROGRAMS_PER_SM", 4)
    assert ta._pick_num_segments(8 * 40, 1, 4000, dev) == 2    # now under the threshold


def test_split_kv_for_drafts(request):
    # Speculative decoding's verification: a few queries a request (the last one a decode), the
    # split chosen by itself; and forced over a context of one tile (segments left empty).
    check_attention([5, 3, 1], [LONG, 40, LONG // 2], *HEADS[2], 128, 16, DTYPES[-1], seed_for(request))
    check_attention([9, 2], [17, LONG], *HEADS[1], 64, 16, DTYPES[0], seed_for(request), num_segments=8)


def test_upper_bound_max_seq_len(request):
    # A CUDA graph is captured with max_seq_len = max_model_len; actual contexts are shorter.
    check_attention([1, 1], [LONG // 3, 9], *HEADS[1], 64, 16, DTYPES[0], seed_for(request),
                    max_seq_len=4 * LONG)


def test_padding_requests(request):
    # CUDA-graph padded decode batches: requests with no query tokens contribute nothing.
    check_attention([1, 0, 1, 0], [50, 0, 21, 0], *HEADS[2], 64, 16, DTYPES[0], seed_for(request))


@pytest.mark.parametrize("num_segments", [1, 4])
def test_sub_batches_from_a_later_request(num_segments, request):
    # The backend's mixed step: the decodes (first) in one launch, the requests after them in
    # another, whose query_start_loc starts above 0; together they write every row once. Then
    # the decodes of a batch that starts with a prefill: the rows before them stay untouched,
    # split and merged or not.
    gen = seed_for(request)
    nd = 40   # more decodes than a prefill tile's query tokens: whole tile slots precede the prefills
    q_lens = [1] * nd + [PREFILL // 2 + 3, 7]
    seq_lens = [LONG, 33, 17] + [5 + i for i in range(nd - 3)] + [PREFILL + 29, 7 + 60]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[2], 128, 16, DTYPES[-1], gen)
    scale = 128 ** -0.5
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    out = torch.full_like(query, float("nan"))
    ta.paged_attention_triton(query[:nd], kv_cache, tables[:nd], seq_lens_t[:nd], qsl[:nd + 1], scale, LONG, 1,
                              out=out[:nd], num_segments=num_segments)
    assert not out[:nd].isnan().any() and out[nd:].isnan().all()
    ta.paged_attention_triton(query, kv_cache, tables[nd:], seq_lens_t[nd:], qsl[nd:], scale, max(seq_lens),
                              max(q_lens), out=out)
    assert not out.isnan().any() and rel_err(out, ref) < TOLERANCE[DTYPES[-1]]

    q_lens, seq_lens = [PREFILL // 2, 1, 1], [PREFILL, LONG, 40]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[2], 128, 16, DTYPES[-1], gen)
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    out = torch.full_like(query, float("nan"))
    ta.paged_attention_triton(query, kv_cache, tables[1:], seq_lens_t[1:], qsl[1:], scale, LONG, 1, out=out,
                              num_segments=num_segments)
    first = q_lens[0]
    assert out[:first].isnan().all(), "rows of no request were written"
    assert rel_err(out[first:], ref[first:]) < TOLERANCE[DTYPES[-1]]


def test_strided_views_and_default_out(request):
    gen = seed_for(request)
    num_heads, num_kv_heads, head_dim = HEADS[2][0], HEADS[2][1], 64
    q_lens, seq_lens = [3, 1, 12], [3, LONG, 40]
    _, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, num_heads, num_kv_heads,
                                                       head_dim, 16, DTYPES[0], gen)
    # query as a slice of a fused qkv projection; out as a slice of a wider buffer
    qkv = torch.randn(sum(q_lens), num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    query = qkv.to(DEVICE, DTYPES[0])[:, :num_heads]
    scale = head_dim ** -0.5
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    buf = torch.full((sum(q_lens), num_heads + 3, head_dim), float("nan"), device=DEVICE,
                     dtype=DTYPES[0])
    ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale, max(seq_lens),
                              max(q_lens), out=buf[:, 1:num_heads + 1])
    assert rel_err(buf[:, 1:num_heads + 1], ref) < TOLERANCE[query.dtype]
    assert buf[:, 0].isnan().all() and buf[:, num_heads + 1:].isnan().all()  # nothing else written
    out = ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale)  # no hints
    assert out.shape == query.shape and rel_err(out, ref) < TOLERANCE[query.dtype]


def test_stale_cache_slots_are_never_read(request):
    # Slots past each request's length (the tail of its last block, unused blocks) hold garbage
    # in a real cache; NaN there must not reach the output.
    gen = seed_for(request)
    q_lens, seq_lens = [1, 5, 1], [LONG - 3, 21, 30]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, *HEADS[1], 64, 16,
                                                          DTYPES[0], gen)
    scale = 64 ** -0.5
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    live = torch.zeros(kv_cache.shape[1] * 16, dtype=torch.bool, device=DEVICE)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n, device=DEVICE)
        live[tables[i, pos // 16].long() * 16 + pos % 16] = True
    kv_cache.view(2, -1, *kv_cache.shape[3:])[:, ~live] = float("nan")
    for num_segments in (None, 4):
        out = torch.full_like(query, float("nan"))
        ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale, max(seq_lens),
                                  max(q_lens), out=out, num_segments=num_segments)
        assert not out.isnan().any() and rel_err(out, ref) < TOLERANCE[query.dtype]


# --------------------------------------------------------------------------------------------
# KV cache write


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (3, 128, 32), (8, 128, 16)])
def test_write_kv_cache(num_kv_heads, head_dim, block_size, slot_dtype, dtype, request):
    gen = seed_for(request)
    num_blocks, num_tokens = 9, 37
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # key/value as slices of a fused qkv projection (strided), in float32: the write casts them
    qkv = torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    # distinct slots, never the cache's last one (see below)
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens
    kv_cache, key, value, slots = (kv_cache.to(DEVICE, dtype), key.to(DEVICE), value.to(DEVICE),
                                   slots.to(DEVICE, slot_dtype))

    # The reference indexes with the slots as given, so a -1 would write the cache's LAST slot
    # (python negative indexing): give it only the valid tokens. The Triton kernel gets them
    # all and must skip the -1s, leaving every other slot untouched (the last one included).
    expected = kv_cache.clone()
    valid = slots >= 0
    reference.write_kv_cache(key[valid], value[valid], expected, slots[valid])
    ta.write_kv_cache_triton(key, value, kv_cache, slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("fp8", FP8, ids=str)
@pytest.mark.parametrize("kv_dtype", DTYPES[:1] + [torch.bfloat16] * (not ON_GPU), ids=str)
def test_write_kv_cache_fp8(kv_dtype, fp8, request):
    """New K/V divided by their scales, clamped to the format's range and rounded to nearest
    even, as the reference does it: the same bytes. Values beyond the range saturate (a plain
    cast would give NaN)."""
    gen = seed_for(request)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 16, 4, 128, 40
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(kv_dtype) for _ in range(2))
    key[0, 0, :4] = torch.tensor([1e4, -1e4, 1e6, -1e6]).to(kv_dtype)   # beyond E4M3's 448 * k_scale
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    kv_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=fp8)
    key, value, slots, kv_cache = key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), kv_cache.to(DEVICE)
    expected = kv_cache.clone()
    reference.write_kv_cache(key, value, expected, slots, *KV_SCALES)
    ta.write_kv_cache_triton(key, value, kv_cache, slots, None, *KV_SCALES)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    written = kv_cache[0].view(-1, num_kv_heads, head_dim)[slots].float() * KV_SCALES[0]
    assert written.isfinite().all()
    assert written[0, 0, 0] == torch.finfo(fp8).max * KV_SCALES[0] == -written[0, 0, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 64, 16), (8, 128, 32)])
def test_copy_blocks(num_kv_heads, head_dim, block_size, dtype, request):
    gen = seed_for(request)
    num_blocks = 64 if ON_GPU else 12
    caches = [torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
              for _ in range(3)]
    # Distinct blocks, as the engine's are; strided views, as a transposed (src, dst) list gives.
    pairs = torch.randperm(num_blocks, generator=gen)[:10].view(5, 2).to(DEVICE)
    src, dst = pairs.T
    expected = [c.clone() for c in caches]
    reference.copy_blocks(expected, src, dst)
    ta.copy_blocks_triton(caches, src, dst)
    for got, exp in zip(caches, expected):
        assert torch.equal(got, exp)
    assert torch.equal(caches[0][:, dst[0]], caches[0][:, src[0]])


# --------------------------------------------------------------------------------------------
# GPU only: no host sync, CUDA-graph capture of a decode batch


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_decode_cuda_graph_and_no_sync(request):
    gen = seed_for(request)
    num_heads, num_kv_heads, head_dim, batch = 32, 8, 128, 8
    seq_lens = [LONG, 1, 700, 2049, 16, 33, 3999, 512]
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(
        [1] * batch, seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, gen)
    scale = head_dim ** -0.5
    out = torch.empty_like(query)
    slot = (tables[:, 0].long() * 16)  # write one token per request, as a decode step does
    key, value = torch.randn_like(query[:, :num_kv_heads]), torch.randn_like(query[:, :num_kv_heads])

    def step():
        ta.write_kv_cache_triton(key, value, kv_cache, slot)
        ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale,
                                  max_seq_len=LONG, max_query_len=1, out=out)

    step()  # compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the call raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # Replay with new values in the same buffers: different lengths and queries.
    seq_lens_t.copy_(torch.tensor([5, LONG, 1, 300, 2500, 17, 64, 1000], dtype=torch.int32))
    query.copy_(torch.randn(query.shape, generator=gen).to(query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    assert not out.isnan().any() and rel_err(out, ref) < TOLERANCE[torch.bfloat16]


# --------------------------------------------------------------------------------------------
# Rotary embedding (and Qwen3's or Gemma 3's per-head q/k norms), applied by the KV write to the keys and by
# the attention to the queries as they read them: against reference.rotary_embedding first.

EPS = 1e-6


def rope_inputs(num_tokens, head_dim, norm, dtype, gen, scaling=None, pos_dtype=torch.int64, rotary_dim=None):
    from pagoda.model.layers.rotary import RotaryEmbedding
    max_pos = 2 * LONG
    table = RotaryEmbedding(head_dim, max_pos, 1e6 if head_dim == 128 else 1e4, scaling, rotary_dim).cos_sin_cache
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen, dtype=pos_dtype)
    # (Gemma's weights are offsets from 1: around 0)
    w_q, w_k = (torch.randn(2, head_dim, generator=gen) * 0.2 + (norm == "qwen3")).to(DEVICE, dtype) if norm \
        else (None, None)
    return reference.Rope(positions.to(DEVICE), table.to(DEVICE), w_q, w_k, EPS, norm == "gemma")


def rotated(rope, q, k):
    """The torch path: (q, k) rotated (and normed) by the reference, in the inputs' dtype."""
    return reference.rotary_embedding(rope.positions.long(), q.flatten(1), k.flatten(1), rope.cos_sin_cache,
                                      q.shape[-1], rope.q_norm_weight, rope.k_norm_weight, rope.eps, rope.norm_unit_offset)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"], ids=["rope", "norm+rope", "gemma-norm+rope"])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 128), (8, 128)])
def test_write_kv_cache_rotates_keys(num_kv_heads, head_dim, norm, dtype, request):
    gen = seed_for(request)
    num_blocks, block_size, num_tokens = 9, 16, 37
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    # keys and values as strided slices of a fused qkv output, in the cache's dtype
    qkv = (torch.randn(num_tokens, 4 + 2 * num_kv_heads, head_dim, generator=gen) * 2 + 0.3).to(DEVICE, dtype)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]
    slots = torch.randperm(num_blocks * block_size - 1, generator=gen)[:num_tokens].to(DEVICE)
    slots[::5] = -1
    rope = rope_inputs(num_tokens, head_dim, norm, dtype, gen, pos_dtype=torch.int32 if norm else torch.int64)
    qkv_before = qkv.clone()
    expected = kv_cache.clone()
    valid = slots >= 0
    rot_k = rotated(rope, key, key)[1].view_as(key)
    reference.write_kv_cache(rot_k[valid], value[valid], expected, slots[valid])
    ta.write_kv_cache_triton(key, value, kv_cache, slots, rope)
    assert torch.equal(kv_cache[1], expected[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(kv_cache[0], expected[0]) < tol
    assert torch.equal(qkv, qkv_before), "the keys themselves must be left unchanged"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [None, "qwen3", "gemma"], ids=["rope", "norm+rope", "gemma-norm+rope"])
@pytest.mark.parametrize("case", ["decode_long", "prefill", "mixed"])
def test_paged_attention_rotates_queries(case, norm, dtype, request):
    gen = seed_for(request)
    q_lens, seq_lens = CASES[case]
    num_heads, num_kv_heads = HEADS[1]
    head_dim = 128
    query, kv_cache, tables, seq_lens_t, qsl = make_batch(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, gen)
    # Llama-3's frequency scaling: the kernel takes any cos/sin table
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 512}
    rope = rope_inputs(sum(q_lens), head_dim, norm, dtype, gen, scaling)
    # the kernel rotates each query at its place in its context (what the runner's positions
    # are), not at rope.positions: those are the reference's, and poison for the kernel
    places = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]).to(DEVICE)
    rope_ref, rope = rope._replace(positions=places), rope._replace(positions=places * 0 - 10**6)
    scale = head_dim ** -0.5
    q_rot = rotated(rope_ref, query, query[:, :1])[0].view_as(query)
    ref = reference.paged_attention(q_rot.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
    query_before = query.clone()
    out = ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale, max(seq_lens), max(q_lens),
                                    rope=rope)
    assert torch.equal(query, query_before), "the queries themselves must be left unchanged"
    assert rel_err(out, ref) < TOLERANCE[dtype]
    # and not merely close to attention without rotary
    assert rel_err(out, reference.paged_attention(query.float(), kv_cache.float(), tables, seq_lens_t, qsl,
                                                  scale)) > 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("norm", [None, "qwen3"], ids=["rope", "norm+rope"])
def test_partial_rotary(norm, request):
    """Phi-4-mini's partial rotary embedding (its LongRoPE table turning 96 of each head's 128
    dimensions, the rest passing unrotated), in the KV write and in every launch that rotates
    queries: a mixed step (prefill tiles and the decodes' launch) and split-KV decodes."""
    gen = seed_for(request)
    num_heads, num_kv_heads = HEADS[1]
    head_dim, rotary_dim, dtype = 128, 96, DTYPES[0]
    scaling = {"rope_type": "longrope", "short_factor": [1.0 + i / 48 for i in range(48)],
               "long_factor": [1.0 + i for i in range(48)], "factor": 32.0, "original_max_position_embeddings": 64}
    # the KV write
    num_tokens, num_blocks = 37, 9
    kv_cache = torch.randn(2, num_blocks, 16, num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = (torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=gen) + 0.3).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens].to(DEVICE)
    rope = rope_inputs(num_tokens, head_dim, norm, dtype, gen, scaling, rotary_dim=rotary_dim)
    assert rope.cos_sin_cache.shape[-1] == rotary_dim
    expected = kv_cache.clone()
    rot_k = rotated(rope, key, key)[1].view_as(key)
    reference.write_kv_cache(rot_k, value, expected, slots)
    ta.write_kv_cache_triton(key, value, kv_cache, slots, rope)
    assert rel_err(kv_cache[0], expected[0]) < TOLERANCE[dtype]
    if norm is None:   # (the dimensions past the rotary ones exactly as given)
        written = kv_cache[0].flatten(0, 1)[slots.long()]
        assert torch.equal(written[..., rotary_dim:], key[..., rotary_dim:])
    # the queries, in each launch
    for (q_lens, seq_lens), kw in [(CASES["mixed"], {}), (CASES["decode_long"], dict(num_segments=4))]:
        query, kv_cache, tables, seq_lens_t, qsl = make_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim,
                                                              16, dtype, gen)
        rope = rope_inputs(sum(q_lens), head_dim, norm, dtype, gen, scaling, rotary_dim=rotary_dim)
        places = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)]).to(DEVICE)
        q_rot = rotated(rope._replace(positions=places), query, query[:, :1])[0].view_as(query)
        scale = head_dim ** -0.5
        ref = reference.paged_attention(q_rot.float(), kv_cache.float(), tables, seq_lens_t, qsl, scale)
        out = ta.paged_attention_triton(query, kv_cache, tables, seq_lens_t, qsl, scale, max(seq_lens), max(q_lens),
                                        rope=rope._replace(positions=places * 0 - 10**6), **kw)
        assert rel_err(out, ref) < TOLERANCE[dtype], kw
        # (and not the whole head rotated: the table's frequencies over 128 dimensions)
        whole = rope_inputs(sum(q_lens), head_dim, norm, dtype, gen, None)._replace(positions=places)
        wrong = rotated(whole._replace(q_norm_weight=rope.q_norm_weight, k_norm_weight=rope.k_norm_weight),
                        query, query[:, :1])[0].view_as(query)
        assert rel_err(out, reference.paged_attention(wrong.float(), kv_cache.float(), tables, seq_lens_t, qsl,
                                                      scale)) > 10 * TOLERANCE[dtype]
