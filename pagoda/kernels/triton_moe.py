"""A mixture of experts' MLPs in Triton: ``reference.fused_moe`` (same arguments and result)
without a host sync, so that decode steps of MoE models run in CUDA graphs.

The reference takes the experts one by one over the tokens that chose them, which needs each
expert's token count on the host. Here (vLLM's fused-MoE plan) every (token, slot) pair is
sorted by its expert on the device, each expert's run padded to a multiple of the tile's rows
(``moe_align``); the grid has the most tiles any routing can need, and a tile past the last
expert's run returns at once. Each tile multiplies its pairs' rows by its expert's weight
tile: once through w13 (the rows of x), then, after SiLU-and-mul, through w2 (the pairs' own
rows), weighting each pair's output by its routing weight; the top_k outputs of a token are
summed last, in a fixed order (no atomics: the same result every run).
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels import reference
from pagoda.kernels.triton_w4a16 import _packed_tile, dequantize_experts
from pagoda.kernels.triton_utils import fix_interpreter_bugs, pdl_launch, pdl_wait

fix_interpreter_bugs()


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.select_experts`` in one launch (a token a program)."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        _select_experts_kernel[(tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                          TOP_K=top_k, RENORMALIZE=renormalize,
                                          E_POW2=triton.next_power_of_2(num_experts),
                                          K_POW2=triton.next_power_of_2(top_k), num_warps=1,
                                          **pdl_launch(router_logits.device))
    return weights, ids


@triton.jit
def _select_experts_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride, TOP_K: tl.constexpr,
                           RENORMALIZE: tl.constexpr, E_POW2: tl.constexpr, K_POW2: tl.constexpr,
                           USE_PDL: tl.constexpr):
    """The softmax over one token's experts in float32, then its TOP_K largest, largest first."""
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_POW2)
    p = tl.load(logits_ptr + token * stride + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(p - tl.max(p, 0))
    p = p / tl.sum(p, 0)
    slot = tl.arange(0, K_POW2)
    weights = tl.zeros((K_POW2,), dtype=tl.float32)
    ids = tl.zeros((K_POW2,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.argmax(p, 0)
        weights = tl.where(slot == k, tl.max(p, 0), weights)
        ids = tl.where(slot == k, best.to(tl.int64), ids)
        p = tl.where(e == best, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + token * TOP_K + slot, weights, mask=slot < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slot, ids, mask=slot < TOP_K)


# One program aligns up to this many pairs (decode batches): a step's ~20 small torch launches
# for the alignment cost more than the matmuls at a few tokens. Above, the torch version.
ALIGN_MAX_PAIRS = 4096


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.moe_align`` (the same tensors), in one launch for decode batches."""
    n = topk_ids.numel()
    n_pow2, e_pow2 = triton.next_power_of_2(n), triton.next_power_of_2(num_experts + 1)
    if n > ALIGN_MAX_PAIRS or e_pow2 > 1024:
        return reference.moe_align(topk_ids, num_experts, block_m)
    num_blocks = reference.moe_align_blocks(n, num_experts, block_m)
    pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_experts = torch.empty(num_blocks, dtype=torch.int32, device=topk_ids.device)
    _moe_align_kernel[(1,)](topk_ids.contiguous(), pairs, block_experts, n, num_experts, num_blocks, N_POW2=n_pow2,
                            E_POW2=e_pow2, BLOCK_M=block_m, BLOCKS_CHUNK=max(1, 4096 // e_pow2), num_warps=4,
                            **pdl_launch(topk_ids.device))
    return pairs, block_experts


@triton.jit(do_not_specialize=["n", "num_blocks"])
def _moe_align_kernel(ids_ptr, pairs_ptr, block_experts_ptr, n, num_experts, num_blocks, N_POW2: tl.constexpr,
                      E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCKS_CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """The pairs sorted by (expert, pair) in registers; each pair's place is its expert's padded
    start plus its rank among the expert's pairs (its sorted position less the expert's first)."""
    pdl_wait(USE_PDL)
    i = tl.arange(0, N_POW2)
    e = tl.load(ids_ptr + i, mask=i < n, other=-1).to(tl.int32)
    e = tl.where(e < 0, num_experts, e)     # another rank's experts, lanes past n: a last bin, left out
    bins = tl.arange(0, E_POW2)
    counts = tl.histogram(e, E_POW2)
    padded = tl.where(bins < num_experts, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    first = tl.cumsum(counts, 0) - counts
    key = tl.sort(e * N_POW2 + i)
    expert, pair = key // N_POW2, key % N_POW2
    dest = tl.gather(ends - padded, expert, 0) + i - tl.gather(first, expert, 0)
    for s in range(0, num_blocks * BLOCK_M, N_POW2):        # padding everywhere first ...
        tl.store(pairs_ptr + s + i, n, mask=s + i < num_blocks * BLOCK_M)
    tl.debug_barrier()                                       # (the program's own stores, in order)
    tl.store(pairs_ptr + dest, pair, mask=expert < num_experts)   # ... then the pairs
    # each block's expert: how many experts' padded runs end at or before its start
    for b0 in range(0, num_blocks, BLOCKS_CHUNK):
        b = b0 + tl.arange(0, BLOCKS_CHUNK)
        done = (ends[None, :] <= b[:, None] * BLOCK_M) & (bins < num_experts)[None, :]
        tl.store(block_experts_ptr + b, tl.sum(done.to(tl.int32), 1), mask=b < num_blocks)


# Packed experts are dequantized whole, then multiplied as dense ones, from this many tokens:
# each of a large batch's row tiles would otherwise unpack its expert's words again. On an H100
# (Qwen3-30B-A3B's layer, GPTQ, the thirty-third session) the packed kernel took 1,292 us at 2,048
# tokens against 1,415 this way, then 2,024 against 1,801 at 4,096 and 6,910 against 4,520 at
# 16,384. (Above runner.cuda_graph.MAX_MIXED_CAPTURE: the transient dense weights are never in
# a graph.)
DEQUANTIZE_FROM_TOKENS = 4096


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_matmul_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_experts_ptr, pair_weights_ptr, s_ptr, z_ptr, g_ptr,
                       num_pairs, num_experts, N, K, stride_a, stride_we, stride_w1, stride_c, stride_se, stride_s1,
                       stride_ge, group_n, group_k, n_per_g_idx, ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr,
                       BLOCK_SCALED: tl.constexpr, INT_BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                       WHOLE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       TRANSPOSED: tl.constexpr, DOT_PRECISION: tl.constexpr, INT_ZEROS: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """``c[p] = a[p // ROWS_PER_A] @ w[expert].T`` (times the pair's weight if WEIGHTED) for
    the pairs of one block and BLOCK_N of the N output columns. ``w``: a dense ``(E, N, K)``
    (``stride_w1``: its rows'); BLOCK_SCALED: FP8 (its bytes) or INT8, each group_n x group_k block of it
    scaled by ``s[expert, n // group_n, k // group_k]`` as its tiles are converted (WHOLE_K: a
    tile lies in one column of blocks); INT_BITS: GPTQ / AWQ words ``(E, K / pack, N)``
    (``stride_w1``: a row of words'), ``(q - z) * s`` of each input's group (``z`` / ``s``
    ``(E, groups, N)``): ``k // group_k``, whole tiles of one group if WHOLE_K; HAS_G_IDX: read
    from ``g[expert, n // n_per_g_idx, k]``, each half of w13 its own under act-order; INT_ZEROS
    off: zero points with fractions (GGUF's).
    TRANSPOSED: ``c^T`` accumulated, the converted weight tile the dot's A operand (as the dense
    W4A16 kernel does: its shared-memory stores 16 bytes wide, not 2)."""
    pdl_wait(USE_PDL)       # (every program, the tiles past the last expert's run too)
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = (pairs // ROWS_PER_A).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_valid = offs_n < N
    a_ptrs = a_ptr + rows[:, None] * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we
    if INT_BITS:
        PACK: tl.constexpr = 32 // INT_BITS
        w_ptrs += tl.arange(0, BLOCK_K // PACK)[:, None] * stride_w1 + offs_n[None, :]
    else:
        w_ptrs += offs_n[None, :].to(tl.int64) * stride_w1 + offs_k[:, None]
    if TRANSPOSED:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_valid[None, :], other=0.0)
        if INT_BITS:
            w = _packed_tile(w_ptrs, s_ptr, z_ptr, g_ptr, expert, k0, K, offs_n, n_valid, stride_se, stride_s1,
                             stride_ge, group_k, n_per_g_idx, INT_BITS, HAS_G_IDX, WHOLE_K, BLOCK_K, BLOCK_N,
                             INT_ZEROS).to(a.dtype)
        else:
            w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0)
        if BLOCK_SCALED:
            s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // group_n)[None, :] * stride_s1
            if WHOLE_K:
                s = tl.load(s_ptrs + k0 // group_k, mask=n_valid[None, :], other=0.0)
            else:
                s = tl.load(s_ptrs + ((k0 + offs_k) // group_k)[:, None], mask=k_valid[:, None] & n_valid[None, :],
                            other=0.0)
            if w_ptr.dtype.element_ty == tl.int8:      # (INT8 experts; FP8's come as their bytes)
                w = (w.to(tl.float32) * s).to(a.dtype)
            else:
                w = (w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(a.dtype)
        if TRANSPOSED:
            acc += tl.dot(tl.trans(w), tl.trans(a), input_precision=DOT_PRECISION)
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if INT_BITS:
            w_ptrs += (BLOCK_K // PACK) * stride_w1
        else:
            w_ptrs += BLOCK_K
    if TRANSPOSED:
        acc = tl.trans(acc)
    if WEIGHTED:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


def default_tiles(num_pairs: int, num_experts: int, itemsize: int = 2, packed: bool = False) -> dict:
    """Tiles of about the pairs an expert gets (at a decode batch few; in a prefill many). Wide
    tiles of 8 warps once experts get 64 pairs or more: 1.2-1.5x on an H100 at 2,048-16,384
    tokens of Qwen3-30B-A3B's layer. Below, narrow and deep ones (32 columns, K steps of 128):
    twice the programs to stream the few experts' weights, 16% faster at one token, 2-3% at 8-256
    (in CUDA graphs; benchmarks/moe_kernels.py --sweep). Packed (GPTQ / AWQ) experts, whose
    unpacking bounds them, take 64 columns from 64 pairs (8 tokens of top 8) on: 6-13% faster
    at 8-256 tokens on an H100 (the thirty-third session), the same at one token."""
    block_m = min(128, max(16, triton.next_power_of_2(num_pairs // num_experts)))
    if block_m >= 64:   # (float32 activations: three stages of these tiles overflow an H100's shared memory)
        return dict(block_m=block_m, block_n=128, block_k=64, num_warps=8, num_stages=3 if itemsize <= 2 else 2)
    return dict(block_m=block_m, block_n=64 if packed and num_pairs >= 64 else 32, block_k=128, num_warps=4,
                num_stages=3)


def _moe_matmul(a, w, c, pairs, block_experts, pair_weights, rows_per_a: int, tiles: dict,
                scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
    num_experts, n, k = w.shape
    block_k = min(tiles["block_k"], max(16, triton.next_power_of_2(k)))
    int4 = isinstance(w, reference.Int4Experts)
    if int4:      # (its scales and zeros, its groups along K)
        weight, scale, zeros, g_idx = w.qweight, w.scales, w.zeros, w.g_idx
        group_n, group_k = 1, w.group_size
        whole_k = g_idx is None and group_k % block_k == 0
    else:
        weight, zeros, g_idx = (w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w), None, None
        group_n, group_k = block or (1, 1)
        whole_k = group_k % block_k == 0
    assert a.stride(-1) == weight.stride(-1) == c.stride(-1) == 1
    grid = (block_experts.numel(), triton.cdiv(n, tiles["block_n"]))
    _moe_matmul_kernel[grid](a, weight, c, pairs, block_experts, pair_weights, scale, zeros, g_idx, c.shape[0],
                             num_experts, n, k, a.stride(0), weight.stride(0), weight.stride(1), c.stride(0),
                             0 if scale is None else scale.stride(0), 0 if scale is None else scale.stride(1),
                             0 if g_idx is None else g_idx.stride(0), group_n, group_k,
                             n if g_idx is None else n // g_idx.shape[1], ROWS_PER_A=rows_per_a,
                             WEIGHTED=pair_weights is not None, BLOCK_SCALED=scale is not None and not int4,
                             INT_BITS=w.bits if int4 else 0, HAS_G_IDX=g_idx is not None, WHOLE_K=whole_k,
                             BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=block_k,
                             TRANSPOSED=tiles.get("transposed", int4) and (int4 or scale is not None),
                             DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                             INT_ZEROS=w.int_zeros if int4 else True, num_warps=tiles["num_warps"],
                             num_stages=tiles["num_stages"], **pdl_launch(a.device))


def fused_moe(x: torch.Tensor, w13: torch.Tensor | reference.Int4Experts, w2: torch.Tensor | reference.Int4Experts,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
              scales: tuple | None = None, tiles: dict | None = None) -> torch.Tensor:
    """See ``reference.fused_moe``; ``tiles`` overrides ``default_tiles`` (benchmarks' sweeps)."""
    from pagoda.kernels.triton_ops import silu_and_mul
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    num_experts = w13.shape[0]
    if isinstance(w13, reference.Int4Experts) and tokens >= DEQUANTIZE_FROM_TOKENS:
        w13, w2 = dequantize_experts(w13, x.dtype), dequantize_experts(w2, x.dtype)
    tiles = tiles or default_tiles(num_pairs, num_experts, x.element_size(), isinstance(w13, reference.Int4Experts))
    if expert_map is not None:
        topk_ids = expert_map[topk_ids]
    pairs, block_experts = moe_align(topk_ids, num_experts, tiles["block_m"])
    h = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    (s13, b13), (s2, b2) = scales or ((None, None), (None, None))
    _moe_matmul(x, w13, h, pairs, block_experts, None, top_k, tiles, s13, b13)
    # (another rank's pairs are in no tile: their rows stay zero)
    y = (torch.empty if expert_map is None else torch.zeros)(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _moe_matmul(silu_and_mul(h), w2, y, pairs, block_experts, topk_weights.reshape(-1).float(), 1, tiles, s2, b2)
    return y.view(tokens, top_k, -1).sum(1)
