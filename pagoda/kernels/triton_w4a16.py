"""``x @ W (+ bias)`` with W a GPTQ/AWQ weight in pagoda's repacked layout
(``pagoda.quant.int4``: int32 ``qweight (K / pack, N)`` packed along K, ``scales`` / ``zeros``
``(groups, N)``, ``g_idx (K,)``), for decode batches (up to ``MAX_M`` rows), in one Triton kernel
(one row: ``_w4a16_gemv_kernel``, on the CUDA cores).
The same kernel takes 8-bit weights as ``pagoda.quant.w8`` stores them (FP8 or INT8 ``(N, K)``,
a float32 scale per output row, applied to the sums; or FP8 with a scale per block of
``block_n x block_k`` weights, DeepSeek's and Qwen3's FP8 checkpoints, applied to the tile as it
is converted): ``w8a16_linear``.

Why: the portable path dequantizes the whole weight to the model's dtype each call, then runs a
dense matmul. At a decode step's few rows that writes a bf16 weight and reads it back, more than
twice a bf16 matmul's bytes, where the point of 4-bit weights is to read a quarter of them.

How: each program owns ``BLOCK_N`` output columns of up to ``max(TILES)`` rows and a range of
K. Per ``BLOCK_K`` step it loads the packed words (once each, unpacked in registers), the x
tile, and the scales and zeros: one row of each when the tile lies in one group, else each row's
group through ``g_idx`` (GPTQ's act-order). It dequantizes the tile in registers
(``_minus_zero``: no int-to-float conversion) and feeds it to ``tl.dot`` as the A operand,
computing ``out`` transposed (float32 accumulator). A weight has few column tiles at decode
shapes (Qwen3-0.6B's o_proj: 8 of 128 columns), so K is split over programs until about
``PROGRAMS_PER_SM`` programs an SM run; split partials are summed in float32 by torch, then
rounded once. Each row tile dequantizes the weight again, so packed weights take the kernel up
to ``PACKED_MAX_M`` rows, where one pass over the whole weight (``dequantize``) and cuBLAS
become cheaper.

Measured on the H200 (BENCHMARKS.md, fourteenth session): the eight decode matrices of
Qwen3-0.6B and Llama-3-8B at one row in 204 us, against 2,941 for dequantize + cuBLAS and 199
for bf16 cuBLAS: a quarter of the bytes in bf16's time, so the dequantization, not memory,
bounds it. One row now takes the GEMV kernel (164 us, thirty-fourth session): a 16-row tensor-
core tile dequantized for one row of x is work the CUDA cores skip.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels import reference
from pagoda.kernels.triton_utils import fix_interpreter_bugs, num_sms

# Rows of x the kernel takes (0 turns it off); more: dequantize + cuBLAS.
MAX_M = 256
# ... for packed (GPTQ / AWQ) weights: over it, the whole weight dequantized in one pass
# (``dequantize``) and cuBLAS cost less than the kernel's row tiles dequantizing it again each.
# On an H100 (BENCHMARKS.md, thirty-fifth session; the eight decode matrices of both models, us):
# kernel 419 / 607 / 656 at 128 / 192 / 256 rows, dequantize + cuBLAS 459 / 485 / 495; W1
# Llama-3-8B GPTQ 7,301 output tok/s at 128 against 6,744 at 256.
PACKED_MAX_M = 128
# Tiles by BLOCK_M, the rows a program takes (the batch's rows rounded up to a power of two, at
# least 16; batches over the largest run in row tiles of it, each dequantizing the weight again).
# Measured on the H200 (BENCHMARKS.md, fifteenth session: `benchmarks/w4a16.py --sweep`), the
# eight decode matrices of both models: at 1-64 rows 204-286 us; at 128 rows 395 us (BLOCK_N 128
# at 4 warps 477: a 128 x 128 float32 accumulator is 128 registers a thread); at 256 rows 624
# (64-row tiles four times over: 730; BLOCK_N 128 at 4 warps spills: 4,469).
TILES = {
    64: dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3),
    128: dict(BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
    256: dict(BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3),
}
PROGRAMS_PER_SM = 4      # split K until this many programs an SM
MAX_SPLIT_K = 16
# One row of x with packed weights (a batch-1 decode step) takes the GEMV kernel: no tensor cores,
# so no tile of 16 rows dequantized for one (1 turns it on, 0 off). On the H200 (BENCHMARKS.md,
# thirty-fourth session) the eight decode matrices of both models at one row: 164 us against the
# tensor-core kernel's 204 (bf16 cuBLAS 202); W2 Llama-3-8B GPTQ batch 1 4.02 ms a step against
# 5.01. Its tiles: the fastest of `benchmarks/w4a16.py --gemv-sweep`'s on an H100 (32 x 256: 167
# us; 64 x 128: 179; 128 x 128: 196).
GEMV = 1
GEMV_TILES = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)

fix_interpreter_bugs()


@triton.jit
def _minus_zero(q, zero, BITS: tl.constexpr, INT_ZEROS: tl.constexpr):
    """``q - zero`` in zero's dtype (exact for integer zeros: small integers). For bf16 and fp16
    without an int-to-float conversion (a quarter-rate instruction, one per weight): q's bits set
    into the mantissa of 128.0 (bf16, 7 mantissa bits: 4-bit q) or 1024.0 (fp16, 10 bits: up to
    8-bit q) read as that float, then that base subtracted with an integer zero point; a float
    one (``INT_ZEROS`` off: GGUF's) after the base, so that its fraction survives (one rounding)."""
    if (zero.dtype == tl.bfloat16) & (BITS <= 7):
        q = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        return q - (zero + 128.0) if INT_ZEROS else (q - 128.0) - zero
    elif (zero.dtype == tl.float16) & (BITS <= 10):
        q = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        return q - (zero + 1024.0) if INT_ZEROS else (q - 1024.0) - zero
    else:
        return q.to(zero.dtype) - zero


@triton.jit
def _packed_tile(w_ptrs, s_ptr, z_ptr, g_ptr, expert, k0, K, offs_n, n_valid, stride_se, stride_s1, stride_ge,
                 group_k, n_per_g_idx, INT_BITS: tl.constexpr, HAS_G_IDX: tl.constexpr, WHOLE_K: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Inputs ``k0 .. k0 + BLOCK_K`` of a packed expert's weight columns ``offs_n``, ``(q - z) * s``
    in the scales' dtype (``Int4Experts``' values). ``w_ptrs``: the tile's words, ``(BLOCK_K /
    pack, BLOCK_N)``, each loaded once and unpacked in registers: word row r, value j is input
    ``(k0 / pack + r) * pack + j`` (K is a whole number of words). Groups: whole tiles of one
    (WHOLE_K), by the rule ``k // group_k``, or (HAS_G_IDX) read from ``g[expert, n //
    n_per_g_idx, k]``, each half of w13 its own under act-order."""
    PACK: tl.constexpr = 32 // INT_BITS
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_valid = offs_k < K
    words = tl.load(w_ptrs, mask=(tl.arange(0, BLOCK_K // PACK) < (K - k0) // PACK)[:, None] & n_valid[None, :],
                    other=0)
    shifts = tl.arange(0, PACK) * INT_BITS
    q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << INT_BITS) - 1), [BLOCK_K, BLOCK_N])
    sz = expert.to(tl.int64) * stride_se + offs_n[None, :]
    if WHOLE_K:
        sz += (k0 // group_k) * stride_s1
        sz_mask = n_valid[None, :]
    else:
        if HAS_G_IDX:
            g = tl.load(g_ptr + expert.to(tl.int64) * stride_ge + (offs_n // n_per_g_idx)[None, :] * K
                        + offs_k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0)
        else:
            g = (offs_k // group_k)[:, None]
        sz += g.to(tl.int64) * stride_s1
        sz_mask = k_valid[:, None] & n_valid[None, :]
    scale = tl.load(s_ptr + sz, mask=sz_mask, other=0.0)
    zero = tl.load(z_ptr + sz, mask=sz_mask, other=0.0)
    return _minus_zero(q, zero, INT_BITS, True) * scale


def dequantize_experts(w: reference.Int4Experts, dtype: torch.dtype) -> torch.Tensor:
    """Packed experts as a dense ``(E, N, K)`` weight in ``dtype`` (``Int4Experts.dense``'s values):
    large batches of a mixture of experts (``triton_moe.DEQUANTIZE_FROM_TOKENS``) and of a linear
    layer (``dequantize``: one expert)."""
    e, n, k = w.shape
    out = torch.empty(e, n, k, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 64, min(64, max(16, triton.next_power_of_2(k)))
    g = w.g_idx
    grid = (triton.cdiv(k, block_k), triton.cdiv(n, block_n), e)
    _dequantize_experts_kernel[grid](w.qweight, w.scales, w.zeros, g, out, n, k, w.qweight.stride(0),
                                     w.qweight.stride(1), w.scales.stride(0), w.scales.stride(1),
                                     0 if g is None else g.stride(0), w.group_size,
                                     n if g is None else n // g.shape[1], INT_BITS=w.bits, HAS_G_IDX=g is not None,
                                     WHOLE_K=g is None and w.group_size % block_k == 0, BLOCK_N=block_n,
                                     BLOCK_K=block_k)
    return out


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
               group_size: int | None, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's packed weight (the module docstring's layout) as ``(N, K)`` in ``dtype``,
    as ``F.linear`` takes it: ``int4.dequantize``'s values transposed, in one pass (batches over
    ``PACKED_MAX_M`` rows, then cuBLAS). ``group_size`` None: each input's group from ``g_idx``."""
    g = None if group_size is not None else g_idx.view(1, 1, -1)
    one = reference.Int4Experts(qweight[None], scales[None], zeros[None], g, bits, group_size or 1)
    return dequantize_experts(one, dtype)[0]


@triton.jit
def _dequantize_experts_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, stride_we, stride_w1, stride_se, stride_s1,
                               stride_ge, group_k, n_per_g_idx, INT_BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                               WHOLE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``(BLOCK_N, BLOCK_K)`` tile of one expert's dense weight (``_packed_tile``, transposed)."""
    PACK: tl.constexpr = 32 // INT_BITS
    k0 = tl.program_id(0) * BLOCK_K
    expert = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (k0 // PACK + tl.arange(0, BLOCK_K // PACK))[:, None] * stride_w1
              + offs_n[None, :])
    w = _packed_tile(w_ptrs, s_ptr, z_ptr, g_ptr, expert, k0, K, offs_n, n_valid, stride_se, stride_s1, stride_ge,
                     group_k, n_per_g_idx, INT_BITS, HAS_G_IDX, WHOLE_K, BLOCK_K, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + expert.to(tl.int64) * N * K + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    tl.store(out, w.to(out_ptr.dtype.element_ty), mask=(offs_k < K)[:, None] & n_valid[None, :])


@triton.jit
def _w4a16_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
                  M, N, K, k_per_split, group_size, group_n, stride_xm, stride_w, stride_sg, stride_os, stride_om,
                  BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  WHOLE_GROUPS: tl.constexpr, ROW_SCALED: tl.constexpr, BLOCK_SCALED: tl.constexpr,
                  FP8_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
                  INT_ZEROS: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    offs_w = tl.arange(0, BLOCK_K // PACK)
    shifts = tl.arange(0, PACK) * BITS
    # out transposed: the weight is the dot's A operand (its dequantized tile goes to shared
    # memory in 16-byte stores; as B, in 2-byte ones)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if ROW_SCALED:     # an 8-bit weight (N, K) as stored; its row scales multiply the sums
            w = tl.load(qweight_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0)
            if FP8_WEIGHT:   # (passed as its bytes: a masked FP8 load's zero is not castable)
                w = w.to(tl.float8e4nv, bitcast=True)
            if BLOCK_SCALED:   # each weight's block scale (group_n rows x group_size columns)
                if WHOLE_GROUPS:   # the tile lies in one column of blocks
                    s = tl.load(scales_ptr + (offs_n // group_n) * stride_sg + k0 // group_size, mask=n_ok,
                                other=0.0)[:, None]
                else:
                    s = tl.load(scales_ptr + (offs_n // group_n)[:, None] * stride_sg + (offs_k // group_size)[None, :],
                                mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                w = w.to(tl.float32) * s
            w = w.to(x.dtype)
            acc += tl.dot(w, tl.trans(x), input_precision="ieee" if x.dtype == tl.float32 else "tf32")
        else:
            # The tile's packed words, each loaded once, unpacked in registers: word row r, value
            # j is K row r * PACK + j.
            rows = k0 // PACK + offs_w
            words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                            mask=(rows < tl.cdiv(k_hi, PACK))[:, None] & n_ok[None, :], other=0)
            q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1), [BLOCK_K, BLOCK_N])
            if WHOLE_GROUPS:   # the tile lies in one group (groups by the rule, a multiple of BLOCK_K)
                g = k0 // group_size
                scale = tl.load(scales_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
                zero = tl.load(zeros_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0)[None, :]
            else:              # each row's own group: act-order, small or partial groups
                g = tl.load(g_idx_ptr + offs_k, mask=k_ok, other=0).to(tl.int64)
                sz = g[:, None] * stride_sg + offs_n[None, :]
                scale = tl.load(scales_ptr + sz, mask=n_ok[None, :], other=0.0)
                zero = tl.load(zeros_ptr + sz, mask=n_ok[None, :], other=0.0)
            # (q - zero) * scale in the weights' dtype, as ``int4.dequantize`` rounds it; rows
            # past K were masked to 0 in x
            w = (_minus_zero(q, zero, BITS, INT_ZEROS) * scale).to(x.dtype)
            acc += tl.dot(tl.trans(w), tl.trans(x), input_precision="ieee" if x.dtype == tl.float32 else "tf32")
    if ROW_SCALED and not BLOCK_SCALED:
        acc *= tl.load(scales_ptr + offs_n, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + split.to(tl.int64) * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr,
                       N, K, k_per_split, group_size, stride_w, stride_sg, stride_os,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROW_GROUPS: tl.constexpr, HAS_BIAS: tl.constexpr, NUM_STAGES: tl.constexpr,
                       INT_ZEROS: tl.constexpr):
    """``x (1, K) @ W`` for packed W: each program sums ``BLOCK_N`` columns over its range of K,
    on the CUDA cores. The tile's words stay in the layout they were loaded in: value j of each
    word is taken out in turn (a shift and a mask), made a float32 without a conversion (its
    bits set into the mantissa of 2^23; an integer zero is subtracted together with 2^23,
    exactly; a float one, ``INT_ZEROS`` off, after it) and multiplied by its x. Where each word
    lies in one group (``ROW_GROUPS``: groups by the rule), the scale multiplies a word row's sum
    once; else each value's group comes from ``g_idx``. The partial sums of the tile's rows
    reduce once, at the end."""
    PACK: tl.constexpr = 32 // BITS
    BLOCK_KP: tl.constexpr = BLOCK_K // PACK
    MANTISSA: tl.constexpr = 8388608.0   # 2^23
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_KP, BLOCK_N], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        rows = k0 // PACK + tl.arange(0, BLOCK_KP)
        ok = (rows < tl.cdiv(k_hi, PACK))[:, None] & n_ok[None, :]
        words = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_w + offs_n[None, :], mask=ok, other=0)
        if ROW_GROUPS:     # a row of scales and zeros a word row
            sz = ((rows * PACK) // group_size).to(tl.int64)[:, None] * stride_sg + offs_n[None, :]
            scale = tl.load(scales_ptr + sz, mask=ok, other=0.0).to(tl.float32)
            zero = tl.load(zeros_ptr + sz, mask=ok, other=0.0).to(tl.float32)
            tile = tl.zeros([BLOCK_KP, BLOCK_N], tl.float32)
        for j in tl.static_range(PACK):
            ks = rows * PACK + j
            x = tl.load(x_ptr + ks, mask=ks < k_hi, other=0.0).to(tl.float32)[:, None]   # (rows past K: 0)
            q = ((words >> (j * BITS)) & ((1 << BITS) - 1)) | 0x4B000000
            qf = q.to(tl.float32, bitcast=True)
            if ROW_GROUPS:
                tile += (qf - (zero + MANTISSA) if INT_ZEROS else (qf - MANTISSA) - zero) * x
            else:          # each row's own group: act-order, small or partial groups
                sz = tl.load(g_idx_ptr + ks, mask=ks < k_hi, other=0).to(tl.int64)[:, None] * stride_sg + offs_n[None, :]
                s = tl.load(scales_ptr + sz, mask=n_ok[None, :], other=0.0).to(tl.float32)
                z = tl.load(zeros_ptr + sz, mask=n_ok[None, :], other=0.0).to(tl.float32)
                acc += (qf - (z + MANTISSA) if INT_ZEROS else (qf - MANTISSA) - z) * s * x
        if ROW_GROUPS:
            acc += tile * scale
    out = tl.sum(acc, axis=0)
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


def use_w4a16(x: torch.Tensor, max_m: int | None = None) -> bool:
    """Whether ``w4a16_linear`` runs this matmul (from shapes only: the same choice at CUDA-graph
    capture and replay), of up to ``max_m`` rows (default ``MAX_M``). On CPUs the interpreter
    would be slower than dequantizing. The tiles are sized for 2-byte activations: float32 ones
    need more shared memory than an H200 SM has (246 of 227 KiB at 32 rows), and float32 models
    on a GPU are for checking, not speed."""
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= (MAX_M if max_m is None else max_m)
            and x.stride(1) == 1 and x.dtype in (torch.float16, torch.bfloat16))


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 g_idx: torch.Tensor, bits: int, bias: torch.Tensor | None = None,
                 group_size: int | None = None, int_zeros: bool = True) -> torch.Tensor:
    """``x (M, K) @ W (K, N) + bias`` in ``x``'s dtype, W as ``int4.dequantize`` would build it.
    ``group_size``: the groups when ``g_idx`` is ``k // group_size`` (no act-order); None reads
    each row's group from ``g_idx``. ``int_zeros`` off: zero points with fractions (GGUF's).
    Capturable (no host sync)."""
    k, n = x.shape[1], scales.shape[1]
    assert qweight.shape == (k // (32 // bits), n) and zeros.shape == scales.shape and g_idx.shape == (k,)
    assert qweight.stride(1) == 1 and scales.stride(1) == 1 and zeros.stride() == scales.stride()
    return _launch(x, n, (qweight, scales, zeros, g_idx), bits, bias, group_size, row_scaled=False,
                   int_zeros=int_zeros)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``x (M, K) @ (weight * scale).T + bias`` in ``x``'s dtype: an 8-bit ``weight (N, K)`` (FP8
    or INT8, unit stride along K) converted in registers, its float32 ``scale`` a row (``(N, 1)``
    or ``(N,)``) applied to the float32 sums; or, with ``block = (block_n, block_k)``, a scale per
    block, ``(ceil(N / block_n), ceil(K / block_k))``, applied to the converted tile. Capturable
    (no host sync)."""
    n, k = weight.shape
    assert x.shape[1] == k and weight.stride(1) == 1 and scale.is_contiguous()
    assert scale.numel() == n if block is None else scale.shape == (-(-n // block[0]), -(-k // block[1]))
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert fp8 or weight.dtype == torch.int8
    return _launch(x, n, (weight.view(torch.uint8) if fp8 else weight, scale, scale, scale), 8, bias,
                   block and block[1], row_scaled=True, fp8_weight=fp8, group_n=block and block[0])


def _launch(x: torch.Tensor, n: int, weights: tuple, bits: int, bias: torch.Tensor | None,
            group_size: int | None, row_scaled: bool, fp8_weight: bool = False,
            group_n: int | None = None, int_zeros: bool = True) -> torch.Tensor:
    """The kernel over ``x (M, K)``: its tiles, the K split, and the float32 partials' sum."""
    qweight, scales, zeros, g_idx = weights
    m, k = x.shape
    assert x.stride(1) == 1
    gemv = GEMV and m == 1 and not row_scaled
    block_m = min(max(TILES), max(16, triton.next_power_of_2(m)))
    tiles = GEMV_TILES if gemv else TILES[max(block_m, min(TILES))]
    block_n, block_k = tiles["BLOCK_N"], tiles["BLOCK_K"]
    col_tiles = triton.cdiv(n, block_n)
    row_tiles = triton.cdiv(m, block_m)
    split = max(1, min(MAX_SPLIT_K, triton.cdiv(k, block_k),
                       triton.cdiv(PROGRAMS_PER_SM * num_sms(x.device), col_tiles * row_tiles)))
    # splits of whole groups where groups are whole tiles: each tile then reads one row of scales
    whole_groups = group_size is not None and group_size % block_k == 0
    unit = group_size if whole_groups else block_k
    k_per_split = triton.cdiv(triton.cdiv(k, unit), split) * unit
    split = triton.cdiv(k, k_per_split)   # no empty splits
    if split == 1:   # the bias added in the kernel
        out, fused_bias = torch.empty(m, n, dtype=x.dtype, device=x.device), bias
    else:            # float32 partials, summed (and the bias added) below
        out, fused_bias = torch.empty(split, m, n, dtype=torch.float32, device=x.device), None
    if gemv:
        _w4a16_gemv_kernel[(col_tiles, split)](
            x, qweight, scales, zeros, g_idx, scales if fused_bias is None else fused_bias, out, n, k, k_per_split,
            group_size or 1, qweight.stride(0), scales.stride(0), out.stride(0) if split > 1 else 0, BITS=bits,
            BLOCK_N=block_n, BLOCK_K=block_k, ROW_GROUPS=group_size is not None and group_size % (32 // bits) == 0,
            HAS_BIAS=fused_bias is not None, NUM_STAGES=tiles["num_stages"], INT_ZEROS=int_zeros,
            num_warps=tiles["num_warps"])
    else:
        _w4a16_kernel[(col_tiles, split, row_tiles)](
            x, qweight, scales, zeros, g_idx, scales if fused_bias is None else fused_bias, out,
            m, n, k, k_per_split, group_size or 1, group_n or 1, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0) if split > 1 else 0, out.stride(-2),
            BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WHOLE_GROUPS=whole_groups,
            ROW_SCALED=row_scaled, BLOCK_SCALED=group_n is not None, FP8_WEIGHT=fp8_weight,
            HAS_BIAS=fused_bias is not None, NUM_STAGES=tiles["num_stages"], INT_ZEROS=int_zeros,
            num_warps=tiles["num_warps"])
    if split == 1:
        return out
    out = out.sum(0)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
