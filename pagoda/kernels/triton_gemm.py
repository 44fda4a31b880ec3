"""``x @ w.T`` for decode steps of tens to hundreds of rows: a tiled tensor-core GEMM in Triton.

Why: at W1's decode batches (192-256 rows) Qwen3-0.6B's 112 GEMMs take about 9 us each in
cuBLAS where reading their weights takes 1-3 us and their FLOPs 3 us at the matmul ceiling
(BENCHMARKS.md, seventh session): cuBLAS picks few, large tiles for these shapes, so most of
the 132 SMs wait. This kernel's tiles are chosen per shape so every SM has work.

How: one program per (BLOCK_M, BLOCK_N) output tile; programs that share a weight tile are
adjacent in launch order (row tiles fastest), so the weight tile is read from HBM once and
from L2 by the others. The K loop is software-pipelined; with ``TMA`` the tiles are fetched
by the Hopper tensor-memory accelerator from host-built descriptors, else by pointer loads.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_loop_bounds, pdl_launch, pdl_wait

fix_interpreter_loop_bounds()


@triton.jit
def _gemm_kernel(x, w, out, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 STAGES: tl.constexpr, TMA: tl.constexpr, USE_PDL: tl.constexpr):
    tiles_m = tl.cdiv(M, BLOCK_M)
    pid = tl.program_id(0)
    off_m = (pid % tiles_m) * BLOCK_M
    off_n = (pid // tiles_m) * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    pdl_wait(USE_PDL)
    # K is a multiple of BLOCK_K (the caller checks): no mask along K.
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        if TMA:
            a = x.load([off_m, k])
            b = w.load([off_n, k])
        else:
            a = tl.load(x + offs_m[:, None] * stride_xm + (k + offs_k)[None, :], mask=(offs_m < M)[:, None], other=0.0)
            b = tl.load(w + offs_n.to(tl.int64)[:, None] * stride_wn + (k + offs_k)[None, :],
                        mask=(offs_n < N)[:, None], other=0.0)
        acc = tl.dot(a, b.T, acc)
    tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def gemm(x: torch.Tensor, w: torch.Tensor, block_m: int, block_n: int, block_k: int, stages: int,
         warps: int, tma: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w)`` for ``x (M, K)`` and ``w (N, K)``, unit stride along K, K a multiple of
    ``block_k``. Capturable (no host sync)."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and k % block_k == 0 and x.stride(1) == 1 and w.stride(1) == 1
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    a, b = x, w
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        a = TensorDescriptor.from_tensor(x, [block_m, block_k])
        b = TensorDescriptor.from_tensor(w, [block_n, block_k])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _gemm_kernel[grid](a, b, out, m, n, k, x.stride(0), w.stride(0), out.stride(0), BLOCK_M=block_m,
                       BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, TMA=tma, num_warps=warps,
                       **pdl_launch(x.device))
    return out
