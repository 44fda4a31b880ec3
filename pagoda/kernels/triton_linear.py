"""``x @ w.T (+ bias)`` for decode batches, in Triton: a kernel for a handful of rows (batch
1-4) and one for skinny batches (up to 64 rows).

Why: at batch 1 a small model's matmuls are matrix-vector products over 4-13 MB of weights
(Qwen3-0.6B: 4 per layer, 28 layers). They should stream the weights at memory bandwidth, a
few microseconds each, but cuBLAS runs them at 0.8-1.6 TB/s on the H200 (5-12 us each inside
a CUDA graph, some with a second split-K reduction kernel): together more than half of a
decode step's GPU time.

How: each program loads a (BLOCK_N, K) slab of the weight in one go: every load of the
program is in flight at once, so it pays the memory latency once instead of once per tile of
a K loop. That limits K (the slab must fit in registers: K <= MAX_K). Then, for each of the
M <= MAX_M input rows, a float32 multiply and a row sum, rounded once to the output dtype.
The weight is read once whatever M is. Large matrices do not go here: cuBLAS streams them at
bandwidth already (see ``use_small_m_linear``).

Skinny batches (5-64 rows): still memory-bound (64 rows is a third of the H200's ridge
point), yet cuBLAS reads Llama-3-8B's qkv and o weights at batch 64 at about 3 TB/s. Each
program owns BLOCK_N output columns and streams its (BLOCK_N, K) slab of the weight through a
software-pipelined K loop (``tl.range(num_stages)``: several tiles in flight), multiplying it by
all of x's rows at once on the tensor cores (``tl.dot``, float32 accumulation). x is small and
read from L2 by every program.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_loop_bounds

MAX_M = 4                    # rows of x: decode batches up to this size
MAX_K = 4096                 # the slab of one program holds whole rows of w
MAX_WEIGHT_BYTES = 64 << 20  # above this cuBLAS already runs at bandwidth (measured on the H200)
SLAB_ELEMENTS = 16384        # BLOCK_N * next_pow2(K): 64 elements a thread at 8 warps
SKINNY_MAX_M = 64            # rows of x for the skinny kernel (0 turns it off)
# 4 stages of a 64 x 128 x-tile and a 32 x 128 w-tile: 96 KB of shared memory, two programs an SM
SKINNY_TILES = dict(BLOCK_N=32, BLOCK_K=128, num_stages=4, num_warps=4)
fix_interpreter_loop_bounds()


@triton.jit
def _small_m_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                           M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < N, cols < K
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    for m in tl.static_range(M):
        x = tl.load(x_ptr + m * stride_xm + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = tl.sum(w * x[None, :], axis=1)
        if HAS_BIAS:
            y += bias
        tl.store(out_ptr + m * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          STAGES: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    x_base = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_base = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < K)[None, :]
        x = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _small_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES)


def use_small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_m_linear`` should run this matmul (decided from shapes only, so the
    choice is the same at CUDA-graph capture and replay)."""
    return _small_weight(x, weight) and 0 < x.shape[0] <= MAX_M and weight.shape[1] <= MAX_K


def use_skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear`` can run this matmul: up to SKINNY_MAX_M rows over the same
    small weights, any K (``linear`` asks ``small_m_linear`` first)."""
    return _small_weight(x, weight) and 0 < x.shape[0] <= SKINNY_MAX_M


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear`` through the kernel made for x's row count, or None where cuBLAS is the
    better choice (large batches, large weights, other dtypes)."""
    if use_small_m_linear(x, weight):
        return small_m_linear(x, weight, bias)
    if use_skinny_linear(x, weight):
        return skinny_linear(x, weight, bias)
    return None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (M, K)`` with M <= 64 (one tile of rows), any K;
    weight ``(N, K)`` and x with unit stride along K. Capturable (no host sync)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 64 and weight.shape[1] == k, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    t = SKINNY_TILES
    _skinny_linear_kernel[(triton.cdiv(n, t["BLOCK_N"]),)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"],
        STAGES=t["num_stages"], HAS_BIAS=bias is not None, num_warps=t["num_warps"])
    return out


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x (M, K)`` with M <= MAX_M and K <= MAX_K; weight
    ``(N, K)`` and x with unit stride along K. Capturable (no host sync)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_M and k <= MAX_K and weight.shape[1] == k, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, SLAB_ELEMENTS // block_k))
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0),
        out.stride(0), M=m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None, num_warps=8)
    return out
