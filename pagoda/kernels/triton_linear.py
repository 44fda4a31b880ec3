"""``x @ w.T (+ bias)`` for one-token decode steps (batch 1) in one Triton kernel.

Why: at batch 1 a small model's matmuls are matrix-vector products over 4-13 MB of weights
(Qwen3-0.6B: 4 per layer, 28 layers). They should stream the weights at memory bandwidth, a
few microseconds each, but cuBLAS reads them at 0.3-2 TB/s on the H200 (5-13 us each inside a
CUDA graph, some with a second split-K reduction kernel): more than half of a decode step's GPU
time (``benchmarks/linear_kernels.py``).

How: each program loads a (BLOCK_N, K) slab of the weight in one go: every load of the
program is in flight at once, so it pays the memory latency once instead of once per tile of
a K loop. The slab must fit in registers, so a K over CHUNK_K is cut into chunks, and each
chunk's slab is loaded before the previous one is summed (two in flight). Then, for each input
row, a float32 multiply and a row sum, rounded once to the output dtype.

8-bit weights (FP8 or INT8, ``pagoda.quant.w8``) take the same kernel with their scale per output
row: the slab is converted in registers and the row sum scaled once, so a batch-1 step reads
half of bf16's bytes.

Where it runs (measured, see BENCHMARKS.md): one row only, any matrix. At one row it beat cuBLAS
on every matrix of Qwen3-0.6B and Llama-3-8B, the 1 GB LM head included (1.03-1.8x). At 4 rows
cuBLAS was faster on most shapes; a tensor-core variant for 5-64 rows lost to cuBLAS everywhere.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_bugs, pdl_launch, pdl_wait

fix_interpreter_bugs()

MAX_M = 1                    # rows of x (the kernel takes up to 4; 0 turns it off)
CHUNK_K = 4096               # K per slab; a longer K is streamed in chunks of this
SLAB_ELEMENTS = 16384        # BLOCK_N * BLOCK_K: 64 elements a thread at 8 warps
SLAB_WARPS = 8


@triton.jit
def _small_m_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_om,
                           M: tl.constexpr, M_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           NUM_CHUNKS: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                           USE_PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    cols = tl.arange(0, BLOCK_K)
    ms = tl.arange(0, M_P)
    acc = tl.zeros([BLOCK_N, M_P], tl.float32)   # column m: output row m
    # The slab of each K chunk is loaded before the previous chunk is summed, so two chunks'
    # loads are in flight at once (a K longer than one chunk is streamed, not waited for).
    w_next = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)
    # Only x comes from the kernel before: the first slab is loaded before waiting for it, so
    # under PDL the weight read starts while that kernel is still running. (No kernel of a
    # forward pass writes weights.)
    pdl_wait(USE_PDL)
    for c in tl.static_range(NUM_CHUNKS):
        w = w_next.to(tl.float32)
        k = c * BLOCK_K + cols
        if c + 1 < NUM_CHUNKS:
            k_next = k + BLOCK_K
            w_next = tl.load(w_rows + k_next[None, :], mask=row_ok[:, None] & (k_next < K)[None, :], other=0.0)
        for m in tl.static_range(M):
            x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
            acc = tl.where(ms[None, :] == m, acc + tl.sum(w * x[None, :], axis=1)[:, None], acc)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + ms[None, :] * stride_om + rows[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (ms < M)[None, :])


EIGHT_BIT = (torch.float8_e4m3fn, torch.int8)


def use_small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``small_m_linear`` should run this matmul (decided from shapes only, so the
    choice is the same at CUDA-graph capture and replay)."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_M and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype in (x.dtype, *EIGHT_BIT) and x.stride(1) == 1 and weight.stride(1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``F.linear`` through ``small_m_linear`` where it beats cuBLAS, else None."""
    return small_m_linear(x, weight, bias, scale) if use_small_m_linear(x, weight) else None


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight * scale[:, None], bias)`` for ``x (M, K)`` with M <= 4, any K; weight
    ``(N, K)`` (x's dtype, or 8-bit with its float32 ``scale`` per row, ``(N,)`` or ``(N, 1)``)
    and x with unit stride along K. Capturable (no host sync)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= 4 and weight.shape[1] == k, (x.shape, weight.shape)
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert (scale is not None) == (weight.dtype in EIGHT_BIT) and (scale is None or scale.numel() == n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_k = min(triton.next_power_of_2(k), CHUNK_K)
    block_n = max(1, min(64, SLAB_ELEMENTS // block_k))
    _small_m_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if scale is None else scale, weight if bias is None else bias, out, n, k, x.stride(0),
        weight.stride(0), out.stride(0), M=m, M_P=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        NUM_CHUNKS=triton.cdiv(k, block_k), HAS_SCALE=scale is not None, HAS_BIAS=bias is not None,
        num_warps=SLAB_WARPS,
        **pdl_launch(x.device))
    return out
