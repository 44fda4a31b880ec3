"""``(x_q * x_scale) @ (w_q * w_scale).T (+ bias)`` on INT8 tensor cores, the scales applied in
the epilogue: the matmul of INT8 W8A8 layers (``pagoda.quant.w8``) from two rows up, decode
batches and prefill. ``reference.scaled_mm`` is its oracle.

Why: cuBLAS's INT8 matmul (``torch._int_mm``) writes int32 sums, which the scales then rescale
in float32 and round: three more passes over an output as large as a prefill chunk's, and on
the H100 its int32 matmul alone was slower than bf16's from about 2,000 rows (BENCHMARKS.md,
thirty-third session); under 17 rows it refuses. Here the int32 accumulator is scaled in
registers and written once, in the activations' dtype: 1.1-1.5x bf16's cuBLAS from 1,024 rows,
and faster than the W8A16 kernel from 8 rows.

How: the usual tiled matmul. Each program owns a ``BLOCK_M x BLOCK_N`` tile of the output;
programs go down ``GROUP_M`` row tiles before the next column tile, so a wave of programs
shares its weight tiles in L2. Rows and columns past the matrix's edge read row (column) 0
again instead of being masked, so the loads along M and N are unmasked (their results are not
stored); K is masked only when it is not a multiple of ``BLOCK_K``.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_bugs

# Tiles by the batch's rows: the largest key not above them. Measured on an H100 (BENCHMARKS.md,
# thirty-fourth session: `benchmarks/w4a16.py --w8 --int8 --sweep`), the eight decode matrices
# of Qwen3-0.6B and Llama-3-8B: 202-206 us at 2-32 rows, 208 at 64, 279 at 256, 611 at 1,024,
# 1,057 at 2,048, 7,572 at 16,384 (bf16 cuBLAS: 249, 251, 287, 676, 1,291, 11,232).
TILES = {
    0: dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
    64: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
    256: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    1024: dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
}

fix_interpreter_bugs()


@triton.jit
def _int8_mm_kernel(a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_bn,
                    stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows % M).to(tl.int64)[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + (cols % N).to(tl.int64)[None, :] * stride_bn + ks[:, None]   # w^T's (BLOCK_K, BLOCK_N) tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < left, other=0)
            b = tl.load(b_ptrs, mask=ks[:, None] < left, other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    row_ok = rows < M
    col_ok = cols < N
    out = acc.to(tl.float32) * tl.load(a_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    out *= tl.load(b_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], out.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def tiles_for(m: int) -> dict:
    return TILES[max(key for key in TILES if key <= m)]


def int8_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
            bias: torch.Tensor | None, out_dtype: torch.dtype, tiles: dict | None = None) -> torch.Tensor:
    """``reference.scaled_mm`` in one launch: INT8 ``x_q (M, K)`` and ``w_q (N, K)``, both with
    unit stride along K, float32 scales a row of each (``(M, 1)``, ``(N,)`` or ``(N, 1)``), an
    optional bias ``(N,)``; exact int32 sums, scaled and rounded once to ``out_dtype``. Capturable
    (no host sync). ``tiles``: a ``TILES`` entry (default: by M)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    assert x_q.dtype == w_q.dtype == torch.int8 and w_q.shape[1] == k, (x_q.dtype, w_q.dtype, x_q.shape, w_q.shape)
    assert x_q.stride(1) == 1 and w_q.stride(1) == 1
    assert x_scale.numel() == m and w_scale.numel() == n
    out = torch.empty(m, n, dtype=out_dtype, device=x_q.device)
    if m == 0 or n == 0:
        return out
    t = dict(tiles or tiles_for(m))
    block_m, block_n, block_k = t.pop("BLOCK_M"), t.pop("BLOCK_N"), t.pop("BLOCK_K")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _int8_mm_kernel[grid](
        x_q, x_scale.float().contiguous(), w_q, w_scale.float().contiguous(), w_q if bias is None else bias, out,
        m, n, k, x_q.stride(0), w_q.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, HAS_BIAS=bias is not None, **t)
    return out
