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
bounds it. One row takes the GEMV kernel (164 us, thirty-fourth session): a 16-row tensor-
core tile dequantized for one row of x is work the CUDA cores skip. Its second form (forty-
fifth session, ``_w4a16_gemv_kernel``) takes a word's eight 4-bit values two at a time in bf16x2
instructions (``BF16X2_ASM``), K steps of 128 inputs (a group's scales for the step, or for each
word row where groups are smaller: GGUF's 16 and 32), the next step's words prefetched into
registers, and sums the split partials in the kernel: 110 us against 132 for the eight on an
H100; W2 Llama-3-8B GPTQ batch 1 3.21 ms a token against 4.13, its GGUF file packed 4.05.
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
# so no tile of 16 rows dequantized for one (1 turns it on, 0 off). Its tiles, programs an SM and
# split-K sums: BENCHMARKS.md, forty-fourth session (`benchmarks/gemv_probe.py`, H100: the eight
# decode matrices of both models at one row 109.9 us against the previous GEMV's 132.2; bf16
# cuBLAS 192.5).
GEMV = 1
GEMV_TILES = dict(BLOCK_N=64, num_warps=4)
GEMV_STEP = 128             # K a loop step (at most; a power of two dividing the group size)
GEMV_PROGRAMS_PER_SM = 4    # split K until this many programs an SM
# 4-bit weights times bf16 x two values an instruction (BF16X2_ASM; 0: in float32 as float16's)
GEMV_BF16X2 = 1
# Split partials summed by the last program of each column tile (1), or by torch after the kernel (0)
GEMV_REDUCE_IN_KERNEL = 1

# The eight 4-bit values of a word (value j at bits 4j) times their x, summed: the pairs (j, j + 4)
# are masked into the mantissas of two bf16 (128 + q: exact), 128 + zero subtracted by an fma with
# 1.0 (exact), multiplied by the pair's x (one rounding a product), the four pairs' products added
# in bf16x2 and the two halves once in float32. $1: the word; $2: -(128 + zero) in both halves;
# $3-$6: the x pairs (x_j, x_j+4); $0: the float32 sum's bits. Twice fewer instructions a weight
# than float32 (shift, mask, subtract, multiply-add each), at a product's rounding to bf16 (the
# relative error of a row's sum about 1.5x float32's: tests/kernels/test_triton_w4a16.py). The CPU
# interpreter runs no PTX: ``_bf16x2_emulated`` does the same arithmetic there.
BF16X2_ASM = tl.constexpr("""{
.reg .b32 t, d, a, s, one;
mov.b32 one, 0x3F803F80;
lop3.b32 t, $1, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, t, one, $2;
mul.rn.bf16x2 a, d, $3;
shr.u32 s, $1, 4;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, t, one, $2;
fma.rn.bf16x2 a, d, $4, a;
shr.u32 s, $1, 8;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, t, one, $2;
fma.rn.bf16x2 a, d, $5, a;
shr.u32 s, $1, 12;
lop3.b32 t, s, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 d, t, one, $2;
fma.rn.bf16x2 a, d, $6, a;
shl.b32 t, a, 16;
and.b32 d, a, 0xFFFF0000;
add.f32 $0, t, d;
}""")

fix_interpreter_bugs()


@triton.jit
def _minus_zero(q, zero, BITS: tl.constexpr, INT_ZEROS: tl.constexpr):
    """``q - zero`` in zero's dtype (exact for integer zeros: small integers). Without an
    int-to-float conversion (a quarter-rate instruction, one per weight): q's bits set into the
    mantissa of 128.0 (bf16, 7 mantissa bits: 4-bit q), 1024.0 (fp16, 10 bits: up to 8-bit q) or
    2^23 (float32) read as that float, then that base subtracted with an integer zero point; a
    float one (``INT_ZEROS`` off: GGUF's) after the base, so that its fraction survives (one
    rounding)."""
    if zero.dtype == tl.float32:
        q = (q | 0x4B000000).to(tl.float32, bitcast=True)
        return q - (zero + 8388608.0) if INT_ZEROS else (q - 8388608.0) - zero
    elif (zero.dtype == tl.bfloat16) & (BITS <= 7):
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
                 BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, INT_ZEROS: tl.constexpr):
    """Inputs ``k0 .. k0 + BLOCK_K`` of a packed expert's weight columns ``offs_n``, ``(q - z) * s``
    in the scales' dtype (``Int4Experts``' values; ``INT_ZEROS`` off: zeros with fractions).
    ``w_ptrs``: the tile's words, ``(BLOCK_K / pack, BLOCK_N)``, each loaded once and unpacked in
    registers: word row r, value j is input ``(k0 / pack + r) * pack + j`` (K is a whole number of
    words). Groups: whole tiles of one (WHOLE_K), by the rule ``k // group_k``, or (HAS_G_IDX)
    read from ``g[expert, n // n_per_g_idx, k]``, each half of w13 its own under act-order."""
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
    return _minus_zero(q, zero, INT_BITS, INT_ZEROS) * scale


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
                                     BLOCK_K=block_k, INT_ZEROS=w.int_zeros)
    return out


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor, bits: int,
               group_size: int | None, dtype: torch.dtype, int_zeros: bool = True) -> torch.Tensor:
    """A linear layer's packed weight (the module docstring's layout) as ``(N, K)`` in ``dtype``,
    as ``F.linear`` takes it: ``int4.dequantize``'s values transposed, in one pass (batches over
    ``PACKED_MAX_M`` rows, then cuBLAS). ``group_size`` None: each input's group from ``g_idx``."""
    g = None if group_size is not None else g_idx.view(1, 1, -1)
    one = reference.Int4Experts(qweight[None], scales[None], zeros[None], g, bits, group_size or 1, int_zeros)
    return dequantize_experts(one, dtype)[0]


@triton.jit
def _dequantize_experts_kernel(w_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, stride_we, stride_w1, stride_se, stride_s1,
                               stride_ge, group_k, n_per_g_idx, INT_BITS: tl.constexpr, HAS_G_IDX: tl.constexpr,
                               WHOLE_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                               INT_ZEROS: tl.constexpr):
    """One ``(BLOCK_N, BLOCK_K)`` tile of one expert's dense weight (``_packed_tile``, transposed)."""
    PACK: tl.constexpr = 32 // INT_BITS
    k0 = tl.program_id(0) * BLOCK_K
    expert = tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + (k0 // PACK + tl.arange(0, BLOCK_K // PACK))[:, None] * stride_w1
              + offs_n[None, :])
    w = _packed_tile(w_ptrs, s_ptr, z_ptr, g_ptr, expert, k0, K, offs_n, n_valid, stride_se, stride_s1, stride_ge,
                     group_k, n_per_g_idx, INT_BITS, HAS_G_IDX, WHOLE_K, BLOCK_K, BLOCK_N, INT_ZEROS)
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
def _bits16(v):
    """A 16-bit float tensor's bits in the low half of an int32."""
    return v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _gemv_words(qweight_ptr, k0, k_hi, r, offs_n, n_ok, stride_w, PACK: tl.constexpr):
    """The packed words of the K step from ``k0``: (word rows, columns)."""
    rows = k0 // PACK + r
    return tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                   mask=(rows * PACK < k_hi)[:, None] & n_ok[None, :], other=0)


@triton.jit
def _gemv_step(acc, words, k0, k_hi, r, offs_n, n_ok, x_ptr, scales_ptr, zeros_ptr, g_idx_ptr, group_size,
               stride_sg, BITS: tl.constexpr, VALUE_GROUPS: tl.constexpr, ROW_GROUPS: tl.constexpr,
               INT_ZEROS: tl.constexpr, BF16X2: tl.constexpr, COMPILED: tl.constexpr):
    """``acc += words' values times their x``, per word, the values' scales applied. In bf16x2
    with float zero points (GGUF's) the words' sums take the zero's nearest integer ``zi``
    (clamped so that ``q - zi`` stays an exact bf16) and subtract the rest, ``(zero - zi)``
    times the word's x summed, before the scale."""
    PACK: tl.constexpr = 32 // BITS
    ks = k0 + r * PACK                   # each word row's first input
    row_ok = ks < k_hi
    xk = x_ptr + ks
    if VALUE_GROUPS:    # each value's group from g_idx (act-order)
        for j in tl.static_range(PACK):
            g = tl.load(g_idx_ptr + ks + j, mask=row_ok, other=0).to(tl.int64)[:, None]
            s = tl.load(scales_ptr + g * stride_sg + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
            z = tl.load(zeros_ptr + g * stride_sg + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
            x = tl.load(xk + j, mask=row_ok, other=0.0).to(tl.float32)[:, None]
            acc += _minus_zero((words >> (j * BITS)) & ((1 << BITS) - 1), z, BITS, INT_ZEROS) * s * x
        return acc
    # the scales and zeros: a row for the step, which lies in one group, or (ROW_GROUPS: groups
    # smaller than the step, GGUF's 16 and 32) a row for each word row
    if ROW_GROUPS:
        sz = (ks // group_size).to(tl.int64)[:, None] * stride_sg + offs_n[None, :]
        sz_ok = row_ok[:, None] & n_ok[None, :]
    else:
        sz = (k0 // group_size) * stride_sg + offs_n[None, :]
        sz_ok = n_ok[None, :]
    s = tl.load(scales_ptr + sz, mask=sz_ok, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + sz, mask=sz_ok, other=0.0).to(tl.float32)
    if BF16X2:
        zi = z if INT_ZEROS else tl.clamp(tl.floor(z + 0.5), -128.0, 128.0)
        nz = _bits16((-(zi + 128.0)).to(tl.bfloat16))
        nz2 = nz | (nz << 16)
        x0, x1 = _x_pair(xk, 0, row_ok), _x_pair(xk, 1, row_ok)
        x2, x3 = _x_pair(xk, 2, row_ok), _x_pair(xk, 3, row_ok)
        if COMPILED:
            sums = tl.inline_asm_elementwise(BF16X2_ASM, "=r,r,r,r,r,r,r", [words, nz2, x0, x1, x2, x3],
                                             dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
        else:
            sums = _bf16x2_emulated(words, nz2, x0, x1, x2, x3)
        if not INT_ZEROS:
            sum_x = tl.zeros(row_ok.shape, tl.float32)
            for j in tl.static_range(PACK):
                sum_x += tl.load(xk + j, mask=row_ok, other=0.0).to(tl.float32)
            sums -= (z - zi) * sum_x[:, None]
        return acc + sums * s
    tile = tl.zeros(acc.shape, tl.float32)     # (float32 math: _minus_zero's 2^23 base)
    for j in tl.static_range(PACK):
        x = tl.load(xk + j, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        tile += _minus_zero((words >> (j * BITS)) & ((1 << BITS) - 1), z, BITS, INT_ZEROS) * x
    return acc + tile * s


@triton.jit
def _x_pair(xk, j: tl.constexpr, row_ok):
    """Each word row's x_j and x_j+4 (bf16) in the low and high halves of an int32: (rows, 1)."""
    lo = _bits16(tl.load(xk + j, mask=row_ok, other=0.0))
    hi = _bits16(tl.load(xk + j + 4, mask=row_ok, other=0.0))
    return (lo | (hi << 16))[:, None]


@triton.jit
def _bf16x2_emulated(words, nz2, x0, x1, x2, x3):
    """``BF16X2_ASM``'s sums in float32 ops, rounded to bf16 where its instructions round (each
    product, and each sum of products), for the CPU interpreter, which runs no PTX: so that the
    tests there check what the kernel feeds it (the x pairs, the zero) on fresh inputs. (Where an
    fma's float32 sum itself rounds, the PTX rounds once and this twice: a rare last-bit
    difference.)"""
    sums = tl.zeros(words.shape, tl.float32)
    for HALF in tl.static_range(2):
        a = tl.zeros(words.shape, tl.float32)
        a = _bf16x2_fma_half(a, words, 0, nz2, x0, HALF)
        a = _bf16x2_fma_half(a, words, 4, nz2, x1, HALF)
        a = _bf16x2_fma_half(a, words, 8, nz2, x2, HALF)
        a = _bf16x2_fma_half(a, words, 12, nz2, x3, HALF)
        sums += a
    return sums


@triton.jit
def _bf16x2_fma_half(a, words, SHIFT: tl.constexpr, nz2, x2, HALF: tl.constexpr):
    """One half of one of ``BF16X2_ASM``'s fmas: ``a + (q - zero) * x`` rounded to bf16 (to
    nearest even: the interpreter's conversion truncates)."""
    q = ((words >> (SHIFT + 16 * HALF)) & 0xF).to(tl.float32)
    d = (q + 128.0) + _bf16_half(nz2, HALF)                       # exact, as the fma with 1.0
    bits = (a + d * _bf16_half(x2, HALF)).to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_half(v, HALF: tl.constexpr):
    """The bf16 in the low (``HALF`` 0) or high half of an int32, as a float32."""
    return ((v << 16) if HALF == 0 else (v & -65536)).to(tl.float32, bitcast=True)


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                       N, K, k_per_split, num_splits, group_size, stride_w, stride_sg,
                       BITS: tl.constexpr, BLOCK_N: tl.constexpr, STEP: tl.constexpr, VALUE_GROUPS: tl.constexpr,
                       ROW_GROUPS: tl.constexpr, INT_ZEROS: tl.constexpr, BF16X2: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, REDUCE: tl.constexpr, COMPILED: tl.constexpr):
    """``x (1, K) @ W`` for packed W: each program sums ``BLOCK_N`` columns over its range of K,
    on the CUDA cores, in steps of ``STEP`` inputs that each lie in one group (unless
    ``ROW_GROUPS``: each word in one, or ``VALUE_GROUPS``: act-order). A step's words are loaded
    into registers while the step before is summed (no pipeline through shared memory: its
    waits were what bounded the kernel).
    With K split (``SPLIT``), each program writes its float32 sums to ``part``; with ``REDUCE``
    the last program of a column tile to arrive (counted in ``count``, which it sets back to 0)
    adds them up and writes the output, else torch does."""
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    r = tl.arange(0, STEP // PACK)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([STEP // PACK, BLOCK_N], tl.float32)
    w_next = _gemv_words(qweight_ptr, k_lo, k_hi, r, offs_n, n_ok, stride_w, PACK)
    for k0 in tl.range(k_lo, k_hi, STEP, num_stages=1):
        words = w_next
        w_next = _gemv_words(qweight_ptr, k0 + STEP, k_hi, r, offs_n, n_ok, stride_w, PACK)
        acc = _gemv_step(acc, words, k0, k_hi, r, offs_n, n_ok, x_ptr, scales_ptr, zeros_ptr, g_idx_ptr, group_size,
                         stride_sg, BITS, VALUE_GROUPS, ROW_GROUPS, INT_ZEROS, BF16X2, COMPILED)
    out = tl.sum(acc, axis=0)
    if SPLIT:
        tl.store(part_ptr + split.to(tl.int64) * N + offs_n, out, mask=n_ok)
        if not REDUCE:
            return
        # Every thread's sums stored and made visible at the GPU's scope before the count
        # (threadfence reduction): the last program to count reads them all.
        if COMPILED:   # (not in the CPU interpreter, which runs one program at a time)
            _fence_gpu(offs_n)
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived != num_splits - 1:
            return
        out = tl.zeros([BLOCK_N], tl.float32)
        for sp in range(num_splits):   # (.cg: from L2, where the other programs' sums are)
            out += tl.load(part_ptr + sp * N + offs_n, mask=n_ok, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")   # for the next launch
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, out.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fence_gpu(like):
    """``fence.acq_rel.gpu`` in every thread (``like``: any tensor of the program, for its shape)."""
    tl.inline_asm_elementwise("fence.acq_rel.gpu;\n\tmov.u32 $0, 0;", "=r,r", [like.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


_COUNTS: dict = {}


def _split_counts(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one a column tile, shared by the GEMV launches on ``device``: a launch
    leaves them at zero. (One stream runs the forward, so no two launches use them at once.)"""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < n:
        counts = _COUNTS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return counts


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
    if GEMV and m == 1 and not row_scaled:
        return _launch_gemv(x, n, weights, bits, bias, group_size, int_zeros)
    block_m = min(max(TILES), max(16, triton.next_power_of_2(m)))
    tiles = TILES[max(block_m, min(TILES))]
    block_n, block_k = tiles["BLOCK_N"], tiles["BLOCK_K"]
    col_tiles = triton.cdiv(n, block_n)
    row_tiles = triton.cdiv(m, block_m)
    # splits of whole groups where groups are whole tiles: each tile then reads one row of scales
    whole_groups = group_size is not None and group_size % block_k == 0
    split, k_per_split = _split_k(k, block_k, group_size if whole_groups else block_k, col_tiles * row_tiles,
                                  PROGRAMS_PER_SM, x.device)
    if split == 1:   # the bias added in the kernel
        out, fused_bias = torch.empty(m, n, dtype=x.dtype, device=x.device), bias
    else:            # float32 partials, summed (and the bias added) below
        out, fused_bias = torch.empty(split, m, n, dtype=torch.float32, device=x.device), None
    _w4a16_kernel[(col_tiles, split, row_tiles)](
        x, qweight, scales, zeros, g_idx, scales if fused_bias is None else fused_bias, out,
        m, n, k, k_per_split, group_size or 1, group_n or 1, x.stride(0), qweight.stride(0), scales.stride(0),
        out.stride(0) if split > 1 else 0, out.stride(-2),
        BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WHOLE_GROUPS=whole_groups,
        ROW_SCALED=row_scaled, BLOCK_SCALED=group_n is not None, FP8_WEIGHT=fp8_weight,
        HAS_BIAS=fused_bias is not None, NUM_STAGES=tiles["num_stages"], INT_ZEROS=int_zeros,
        num_warps=tiles["num_warps"])
    return _sum_splits(out, split, bias, x.dtype)


def _split_k(k: int, step: int, unit: int, programs: int, per_sm: int, device: torch.device) -> tuple[int, int]:
    """K split over programs until about ``per_sm`` programs an SM run (at most MAX_SPLIT_K, one
    ``step`` of K each at least), in whole ``unit``s: (splits, K a split), no split empty."""
    split = max(1, min(MAX_SPLIT_K, triton.cdiv(k, step), triton.cdiv(per_sm * num_sms(device), programs)))
    k_per_split = triton.cdiv(triton.cdiv(k, unit), split) * unit
    return triton.cdiv(k, k_per_split), k_per_split


def _sum_splits(out: torch.Tensor, split: int, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A launch's output: itself, or its float32 split partials summed, the bias added, rounded."""
    if split == 1:
        return out
    out = out.sum(0)
    if bias is not None:
        out += bias.float()
    return out.to(dtype)


def _launch_gemv(x: torch.Tensor, n: int, weights: tuple, bits: int, bias: torch.Tensor | None,
                 group_size: int | None, int_zeros: bool) -> torch.Tensor:
    """One row of x: the GEMV kernel, its steps, K split and the splits' sum."""
    qweight, scales, zeros, g_idx = weights
    k = x.shape[1]
    pack = 32 // bits
    # Steps of GEMV_STEP inputs: in one group each where the groups are a whole number of steps
    # (or one group is all of K), else a group a word row (GGUF's 16 and 32 inputs: steps that
    # small would be most of their time in their loop), else (words across groups, act-order)
    # each value's group.
    by_step = group_size is not None and (group_size >= k or group_size % GEMV_STEP == 0)
    row_groups = group_size is not None and not by_step and group_size % pack == 0
    value_groups = not (by_step or row_groups)
    block_n = GEMV_TILES["BLOCK_N"]
    col_tiles = triton.cdiv(n, block_n)
    split, k_per_split = _split_k(k, GEMV_STEP, GEMV_STEP, col_tiles, GEMV_PROGRAMS_PER_SM, x.device)
    reduce = split > 1 and bool(GEMV_REDUCE_IN_KERNEL)
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split, n, dtype=torch.float32, device=x.device) if split > 1 else out
    counts = _split_counts(x.device, col_tiles)   # (int32 even where unused: compiled all the same)
    fused_bias = bias if split == 1 or reduce else None
    bf16x2 = bool(GEMV_BF16X2) and bits == 4 and x.dtype == torch.bfloat16 and not value_groups
    _w4a16_gemv_kernel[(col_tiles, split)](
        x, qweight, scales, zeros, g_idx, bias if fused_bias is not None else scales, out, part, counts,
        n, k, k_per_split, split, group_size or k, qweight.stride(0), scales.stride(0),
        BITS=bits, BLOCK_N=block_n, STEP=GEMV_STEP, VALUE_GROUPS=value_groups, ROW_GROUPS=row_groups,
        INT_ZEROS=int_zeros, BF16X2=bf16x2,
        HAS_BIAS=fused_bias is not None, SPLIT=split > 1, REDUCE=reduce, COMPILED=not triton.knobs.runtime.interpret,
        num_warps=GEMV_TILES["num_warps"])
    if split == 1 or reduce:
        return out
    return _sum_splits(part[:, None], split, bias, x.dtype)
