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

from pagoda.kernels.triton_utils import fix_interpreter_bugs

fix_interpreter_bugs()


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``p = token * top_k + slot`` grouped by expert, each group padded with
    ``num_pairs`` (no pair) to a multiple of ``block_m``: ``(pairs (num_blocks * block_m,) int32,
    block_experts (num_blocks,))``, the expert of each block of block_m (``num_experts`` past the
    last group). Pairs of expert -1 (another rank's) are in no group. Sizes depend on the number
    of pairs alone; device ops only."""
    flat = topk_ids.flatten().long()
    n = flat.numel()
    flat = torch.where(flat < 0, num_experts, flat)      # another rank's experts: a last bin, left out
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                              torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert]   # within its expert's group
    num_blocks = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m)
    # (one slot more, where the left-out pairs go: a boolean mask would sync with the host)
    pairs = torch.full((num_blocks * block_m + 1,), n, dtype=torch.int32, device=flat.device)
    dest = torch.where(expert < num_experts, (ends - padded)[expert] + rank, num_blocks * block_m)
    pairs[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    return pairs[:-1], torch.searchsorted(ends[:num_experts], starts, right=True).to(torch.int32)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_matmul_kernel(a_ptr, w_ptr, c_ptr, pairs_ptr, block_experts_ptr, pair_weights_ptr, s_ptr, num_pairs,
                       num_experts, N, K, stride_a, stride_we, stride_wn, stride_c, stride_se, stride_sn, group_n,
                       group_k, ROWS_PER_A: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                       WHOLE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """``c[p] = a[p // ROWS_PER_A] @ w[expert].T`` (times the pair's weight if WEIGHTED) for
    the pairs of one block and BLOCK_N of the N output columns. BLOCK_SCALED: w is FP8 (its
    bytes), each group_n x group_k block of it scaled by ``s[expert, n // group_n, k // group_k]``
    as its tiles are converted (WHOLE_K: a tile lies in one column of blocks)."""
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
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_valid[:, None] & n_valid[None, :], other=0)
        if BLOCK_SCALED:
            s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + (offs_n // group_n)[None, :] * stride_sn
            if WHOLE_K:
                s = tl.load(s_ptrs + k0 // group_k, mask=n_valid[None, :], other=0.0)
            else:
                s = tl.load(s_ptrs + ((k0 + offs_k) // group_k)[:, None], mask=k_valid[:, None] & n_valid[None, :],
                            other=0.0)
            w = (w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s).to(a.dtype)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if WEIGHTED:
        acc *= tl.load(pair_weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_valid[None, :])


def default_tiles(num_pairs: int, num_experts: int) -> dict:
    """Tiles of about the pairs an expert gets (at a decode batch few; in a prefill many). Wide
    tiles of 8 warps once experts get 64 pairs or more: 1.2-1.5x on an H100 at 2,048-16,384
    tokens of Qwen3-30B-A3B's layer. Below, narrow and deep ones (32 columns, K steps of 128): twice the programs
    to stream the few experts' weights, 16% faster at one token, 2-3% at 8-256 (in CUDA graphs;
    benchmarks/moe_kernels.py --sweep)."""
    block_m = min(128, max(16, triton.next_power_of_2(num_pairs // num_experts)))
    if block_m >= 64:
        return dict(block_m=block_m, block_n=128, block_k=64, num_warps=8, num_stages=3)
    return dict(block_m=block_m, block_n=32, block_k=128, num_warps=4, num_stages=3)


def _moe_matmul(a, w, c, pairs, block_experts, pair_weights, rows_per_a: int, tiles: dict,
                scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
    num_experts, n, k = w.shape
    assert a.stride(-1) == w.stride(-1) == c.stride(-1) == 1
    block_k = min(tiles["block_k"], max(16, triton.next_power_of_2(k)))
    group_n, group_k = block or (1, 1)
    grid = (block_experts.numel(), triton.cdiv(n, tiles["block_n"]))
    _moe_matmul_kernel[grid](a, w if scale is None else w.view(torch.uint8), c, pairs, block_experts, pair_weights,
                             scale, c.shape[0], num_experts, n, k, a.stride(0), w.stride(0), w.stride(1),
                             c.stride(0), 0 if scale is None else scale.stride(0),
                             0 if scale is None else scale.stride(1), group_n, group_k, ROWS_PER_A=rows_per_a,
                             WEIGHTED=pair_weights is not None, BLOCK_SCALED=scale is not None,
                             WHOLE_K=group_k % block_k == 0, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"],
                             BLOCK_K=block_k, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                             num_warps=tiles["num_warps"], num_stages=tiles["num_stages"])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None, scales: tuple | None = None,
              tiles: dict | None = None) -> torch.Tensor:
    """See ``reference.fused_moe``; ``tiles`` overrides ``default_tiles`` (benchmarks' sweeps)."""
    from pagoda.kernels.triton_ops import silu_and_mul
    tokens, top_k = topk_ids.shape
    num_pairs = tokens * top_k
    if tokens == 0:
        return torch.zeros_like(x)
    num_experts = w13.shape[0]
    tiles = tiles or default_tiles(num_pairs, num_experts)
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
