"""Triton kernels for the elementwise ops of a decoder layer: RMSNorm (alone, and fused with the
residual add), SiLU-and-mul, and the per-token 8-bit quantization of a W8A8 matmul's input. Same
functions, (positional) signatures and semantics as their torch versions in
``pagoda.kernels.reference`` (the CPU path and the tests' oracle); they also take ``out=`` tensors.
The norm and SiLU-and-mul can write their rows already quantized for the W8A8 matmul after them
(``quant_dtype``): the quantization's own launch, and a write and read of the rows, saved. (The rotary embedding has no kernel: the KV-write and attention kernels
apply it as they read k and q, see ``triton_attention``.)

Why: in eager torch each of these is 5-10 tiny kernels (RMSNorm alone is float, pow, mean, add,
rsqrt, mul, to, mul); at decode they cost far more in launches and Python than in bytes. Here
each is one launch that reads its inputs once and writes its outputs once.

All of them are CUDA-graph capturable: launch parameters come from tensor shapes only, no
host sync, outputs allocated from shapes. Math in float32; the roundings to the input dtype
are the ones the torch code (i.e. HF's modelling code) does, so that bf16 results agree with
the torch path to the last bit in nearly every element.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels import reference
from pagoda.kernels.triton_utils import fix_interpreter_bugs, pdl_launch, pdl_wait

fix_interpreter_bugs()


def _num_warps(tile: int) -> int:
    """About 8-16 elements per thread, up to 16 warps."""
    return max(1, min(16, tile // 512))


@triton.jit
def _quantize_rows(x, Q_MAX: tl.constexpr, IS_INT8: tl.constexpr):
    """Float32 rows ``x (BLOCK_M, BLOCK)`` (columns past the row zero) over each row's scale,
    its largest magnitude / Q_MAX: ``(q, scale (BLOCK_M,))``, ``reference.per_token_quant``'s
    values (INT8 rounded half away from zero; the store's cast truncates)."""
    # (div_rn: Triton's float32 division is otherwise approximate; the reference's is exact)
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-12), Q_MAX)
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -Q_MAX, Q_MAX)
    if IS_INT8:
        q = tl.where(q >= 0, tl.floor(q + 0.5), -tl.floor(0.5 - q))
    return q, scale


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _quant_args(quant_dtype: torch.dtype | None, rows: int, k: int, device) -> tuple:
    """(q, scale) outputs for rows quantized to ``quant_dtype`` (or none), and the kernels' constants."""
    if quant_dtype is None:
        return None, None, dict(Q_MAX=1.0, QUANT=False, IS_INT8=False)
    q = torch.empty(rows, k, dtype=quant_dtype, device=device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=device)
    top = reference.INT8_MAX if quant_dtype == torch.int8 else reference.FP8_MAX
    return q, scale, dict(Q_MAX=top, QUANT=True, IS_INT8=quant_dtype == torch.int8)


# --------------------------------------------------------------------------------------------
# RMSNorm


@triton.jit(do_not_specialize=["num_rows"])   # the token count: no variant per value class
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr,
                     num_rows, n_inner, stride_x0, stride_x1, stride_r, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     OUT_DTYPE: tl.constexpr, QUANT: tl.constexpr, Q_MAX: tl.constexpr, IS_INT8: tl.constexpr,
                     USE_PDL: tl.constexpr, UNIT_OFFSET: tl.constexpr = False):
    pdl_wait(USE_PDL)
    # BLOCK_M rows of BLOCK_N (>= N) columns per program. Row r of x sits at
    # (r // n_inner) * stride_x0 + (r % n_inner) * stride_x1, which covers 2-D inputs with a row
    # stride (n_inner = 1) and 3-D (tokens, heads, head_dim) views of a fused qkv output.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None] & (cols < N)[None, :]
    rows = rows.to(tl.int64)
    x_off = (rows // n_inner) * stride_x0 + (rows % n_inner) * stride_x1
    x = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    out_off = rows[:, None] * N + cols[None, :]             # outputs are contiguous
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + (rows * stride_r)[:, None] + cols[None, :], mask=mask, other=0.0)
        # The sum in the inputs' dtype is the new residual, and what is normalised.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_off, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
    if UNIT_OFFSET:   # Gemma's: times 1 + w, in float32
        y = xf * rstd[:, None]
        w = 1.0 + tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    else:
        y = (xf * rstd[:, None]).to(x.dtype)                # HF: back to the input dtype ...
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    out = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(OUT_DTYPE)   # ... then times the weight
    if QUANT:   # the next matmul's per-token 8-bit input in place of the norm's output (rounded to it first)
        q, scale = _quantize_rows(out.to(tl.float32), Q_MAX, IS_INT8)
        tl.store(q_ptr + out_off, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows, scale, mask=rows < num_rows)
    else:
        tl.store(out_ptr + out_off, out, mask=mask)


def _output(out, shape, dtype, device):
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    assert out.shape == shape and out.dtype == dtype and out.is_contiguous(), \
        f"out must be a contiguous {dtype} tensor of shape {tuple(shape)}"
    return out


def _launch_rms_norm(x, residual, weight, eps, out, residual_out, quant_dtype=None, unit_offset=False):
    N = x.shape[-1]
    assert weight.shape == (N,) and weight.is_contiguous(), "weight must be a contiguous (N,) vector"
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is None and x.dim() == 3:                    # (tokens, heads, head_dim) view
        num_rows, n_inner, sx0, sx1 = x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)
    else:
        x2 = x.reshape(-1, N)                                # a view wherever one exists
        num_rows, n_inner, sx0, sx1 = x2.shape[0], 1, x2.stride(0), 0
    res_dtype = x.dtype
    if residual is not None:
        assert residual.shape == x.shape, f"residual {tuple(residual.shape)} != x {tuple(x.shape)}"
        res_dtype = torch.promote_types(x.dtype, residual.dtype)
        residual_out = _output(residual_out, x.shape, res_dtype, x.device)
        residual = residual.reshape(-1, N)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    out_dtype = res_dtype if unit_offset else torch.promote_types(res_dtype, weight.dtype)
    q, scale, quant = _quant_args(quant_dtype, num_rows, N, x.device)
    if quant_dtype is None:
        out = _output(out, x.shape, out_dtype, x.device)
    else:
        assert x.dim() == 2 and out is None, "quantized rows come from 2-D inputs, into new tensors"
        out = reference.QuantizedInput(q, scale, out_dtype)
    if num_rows == 0:
        return out, residual_out
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_M = min(max(1, 2048 // BLOCK_N), triton.next_power_of_2(num_rows))
    has_res = residual is not None
    dummy = out if quant_dtype is None else x     # (a pointer the variant does not use)
    _rms_norm_kernel[(triton.cdiv(num_rows, BLOCK_M),)](
        x, residual if has_res else x, weight, dummy, residual_out if has_res else dummy,
        dummy if q is None else q, dummy if scale is None else scale,
        num_rows, n_inner, sx0, sx1, residual.stride(0) if has_res else 0, N, eps,
        HAS_RESIDUAL=has_res, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, OUT_DTYPE=_TL_DTYPES[out_dtype], **quant,
        UNIT_OFFSET=unit_offset, num_warps=_num_warps(BLOCK_M * BLOCK_N), **pdl_launch(x.device))
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, quant_dtype: torch.dtype | None = None, unit_offset: bool = False):
    """RMSNorm over the last dim of ``x`` (any shape; rows may be strided, e.g. a 3-D
    ``(tokens, heads, head_dim)`` view of a qkv output). Returns ``out``: by default a new
    contiguous tensor; a given one must be contiguous (it may be ``x`` itself, if contiguous).
    ``quant_dtype`` (INT8 or FP8; 2-D ``x``): the output's rows quantized per token for a W8A8
    matmul instead, a ``QuantizedInput`` (``per_token_quant`` of the output, in one pass).
    ``unit_offset``: Gemma's norm (``reference.rms_norm``'s)."""
    return _launch_rms_norm(x, None, weight, eps, out, None, quant_dtype, unit_offset)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
                       quant_dtype: torch.dtype | None = None, unit_offset: bool = False) -> tuple:
    """``(rms_norm(x + residual), x + residual)`` in one pass. By default into new tensors,
    the inputs unchanged (what the torch version does; in place would move the same bytes).
    ``out=x, residual_out=residual`` (both contiguous) makes it in place, vLLM style: each
    program reads its whole row before it writes it. ``quant_dtype``, ``unit_offset``: as
    ``rms_norm``'s."""
    return _launch_rms_norm(x, residual, weight, eps, out, residual_out, quant_dtype, unit_offset)


# --------------------------------------------------------------------------------------------
# SiLU and mul


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, stride_x, d, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                         Q_MAX: tl.constexpr, IS_INT8: tl.constexpr, USE_PDL: tl.constexpr,
                         GELU_TANH: tl.constexpr = False):
    pdl_wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    # As torch does in the input dtype: the activation rounded to it, then the product rounded to it.
    if GELU_TANH:   # 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2 / pi) (g + 0.044715 g^3)
        u = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * u))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = (act * up).to(out_ptr.dtype.element_ty)
    if QUANT:   # (a whole row a program) the next matmul's per-token 8-bit input instead
        q, scale = _quantize_rows(out.to(tl.float32)[None, :], Q_MAX, IS_INT8)
        tl.store(q_ptr + t * d + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask[None, :])
        tl.store(scale_ptr + t + tl.arange(0, 1), scale)
    else:
        tl.store(out_ptr + t * d + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, quant_dtype: torch.dtype | None = None):
    """``silu(gate) * up`` of ``x = [gate, up]`` (..., 2 * d) -> ``out`` (..., d), by default
    a new tensor (rows of x may be strided). ``quant_dtype`` (INT8 or FP8; 2-D ``x``): the rows
    quantized per token for a W8A8 matmul instead, a ``QuantizedInput``."""
    return _act_and_mul(x, out, quant_dtype, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, out: torch.Tensor | None = None, quant_dtype: torch.dtype | None = None):
    """``gelu(gate) * up``, GELU's tanh approximation (Gemma's MLP); otherwise ``silu_and_mul``."""
    return _act_and_mul(x, out, quant_dtype, gelu_tanh=True)


def _act_and_mul(x, out, quant_dtype, gelu_tanh: bool):
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q, scale, quant = _quant_args(quant_dtype, x2.shape[0], d, x.device)
    if quant_dtype is None:
        out = _output(out, (*x.shape[:-1], d), x.dtype, x.device)
    else:
        assert x.dim() == 2 and out is None, "quantized rows come from 2-D inputs, into new tensors"
        out = reference.QuantizedInput(q, scale, x.dtype)
    if x2.shape[0] == 0 or d == 0:
        return out
    # (quantized: a whole row a program, for its largest magnitude)
    BLOCK = triton.next_power_of_2(d) if quant_dtype is not None else min(1024, triton.next_power_of_2(d))
    dummy = out if quant_dtype is None else x2
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, BLOCK))](
        x2, dummy, dummy if q is None else q, dummy if scale is None else scale, x2.stride(0), d, BLOCK=BLOCK,
        **quant, GELU_TANH=gelu_tanh, num_warps=_num_warps(2 * BLOCK), **pdl_launch(x.device))
    return out


# --------------------------------------------------------------------------------------------
# Per-token 8-bit quantization (the activations of a W8A8 matmul)


@triton.jit
def _per_token_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, K, Q_MAX: tl.constexpr, IS_INT8: tl.constexpr,
                            BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_rows(x[None, :], Q_MAX, IS_INT8)
    tl.store(q_ptr + row * K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask[None, :])
    tl.store(scale_ptr + row + tl.arange(0, 1), scale)


def per_token_quant(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.per_token_quant`` in one launch: ``x (M, K)`` (rows may be strided) ->
    contiguous FP8 or INT8 rows and their float32 scales ``(M, 1)``."""
    m, k = x.shape
    assert x.stride(1) == 1
    q, scale, quant = _quant_args(dtype, m, k, x.device)
    if m:
        block = triton.next_power_of_2(k)
        _per_token_quant_kernel[(m,)](x, q, scale, x.stride(0), k, Q_MAX=quant["Q_MAX"], IS_INT8=quant["IS_INT8"],
                                      BLOCK=block, num_warps=_num_warps(block), **pdl_launch(x.device))
    return q, scale
