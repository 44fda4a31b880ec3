"""Triton kernels of the decoder layer's elementwise ops (pagoda.kernels.triton_ops) and of its
linear layers at batch 1 (pagoda.kernels.triton_linear) against their torch versions (pagoda.kernels.reference: the CPU path and the oracle), and the layers'
dispatch between the two.

Without a CUDA device the kernels run in Triton's CPU interpreter (fp32 and fp16; not bf16,
whose casts the interpreter gets wrong); with one they run compiled, bf16 included, plus a
CUDA-graph capture and replay. Fresh random inputs, never zeros; outputs the kernel writes
fresh are poisoned with NaN first. Bounds: ||out - ref|| / ||ref|| < 1e-5 (fp32), < 1e-2
(fp16, bf16), the reference computed by the torch code from the same inputs in the same dtype.
On the GPU: ``pytest tests/kernels/test_triton_ops.py -q``.
"""
import itertools
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels import triton_ops as ops
from pagoda.model.layers.activation import SiluAndMul
from pagoda.model.layers.layernorm import RMSNorm

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
TOKENS = [1, 7, 133] + ([2049] if ON_GPU else [])
EPS = 1e-6


def matrix(*axes, cpu=lambda *case: True):
    """The cartesian product of the axes; on CPU (the interpreter runs ~5 ms per program) only
    the cases ``cpu`` keeps."""
    return [case for case in itertools.product(*axes) if ON_GPU or cpu(*case)]


def seed_for(request) -> torch.Generator:
    """A fresh, reproducible stream per test case (seeded by its id)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def randn(*shape, gen, dtype=torch.float32, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale + shift).to(DEVICE, dtype)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert not out.isnan().any(), "unwritten (or NaN) output elements"
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# --------------------------------------------------------------------------------------------
# RMSNorm


def _norm_inputs(tokens, hidden, dtype, gen, strided):
    """x (optionally a column slice of a wider buffer: strided rows), residual, weight. Inputs
    of mean 0.5 and weights around 1, so the sum, the norm and the weight all matter."""
    width = hidden + 64 if strided else hidden
    x = randn(tokens, width, gen=gen, dtype=dtype, shift=0.5)[:, 32:32 + hidden] if strided \
        else randn(tokens, hidden, gen=gen, dtype=dtype, shift=0.5)
    residual = randn(tokens, hidden, gen=gen, dtype=dtype, scale=2.0)
    weight = randn(hidden, gen=gen, dtype=dtype, scale=0.2, shift=1.0)
    return x, residual, weight


NORM_CASES = matrix([576, 1024, 4096], TOKENS, DTYPES,
                    cpu=lambda h, t, d: t < 100 or h == 1024 or (h == 4096 and d == torch.float16))


@pytest.mark.parametrize("hidden,tokens,dtype", NORM_CASES, ids=str)
def test_rms_norm(hidden, tokens, dtype, request):
    x, _, weight = _norm_inputs(tokens, hidden, dtype, seed_for(request), strided=tokens == 7)
    ref = reference.rms_norm(x, weight, EPS)
    check(ops.rms_norm(x, weight, EPS, out=nan_like(ref)), ref, dtype)
    check(ops.rms_norm(x, weight, EPS), ref, dtype)


@pytest.mark.parametrize("hidden,tokens,dtype", NORM_CASES, ids=str)
def test_fused_add_rms_norm(hidden, tokens, dtype, request):
    x, residual, weight = _norm_inputs(tokens, hidden, dtype, seed_for(request), strided=tokens == 7)
    x0, residual0 = x.clone(), residual.clone()
    ref, ref_sum = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, EPS, out=nan_like(ref),
                                               residual_out=nan_like(ref_sum))
    check(out, ref, dtype)
    check(new_residual, ref_sum, dtype)
    # The decoder layer relies on the inputs being left as they were (by default).
    assert torch.equal(x, x0) and torch.equal(residual, residual0)


def test_fused_add_rms_norm_in_place(request):
    x, residual, weight = _norm_inputs(7, 1024, torch.float16, seed_for(request), strided=False)
    ref, ref_sum = reference.fused_add_rms_norm(x, residual, weight, EPS)
    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, EPS, out=x, residual_out=residual)
    assert out is x and new_residual is residual
    check(x, ref, torch.float16)
    check(residual, ref_sum, torch.float16)


@pytest.mark.parametrize("head_dim,tokens,dtype",
                         matrix([64, 128], TOKENS, DTYPES, cpu=lambda h, t, d: t < 100 or h == 64),
                         ids=str)
def test_qk_norm_on_qkv_slices(head_dim, tokens, dtype, request):
    # Qwen3's per-head q/k norm: q and k are column slices of the fused qkv output, normed per
    # head either as llama.py does it, on a (tokens * heads, head_dim) copy, or as a 3-D
    # (tokens, heads, head_dim) view (no copy: the kernel follows both strides).
    gen = seed_for(request)
    num_heads, num_kv_heads = 16, 8
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype, shift=0.3)
    weight = randn(head_dim, gen=gen, dtype=dtype, scale=0.2, shift=1.0)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    for sl in (qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]):
        ref = reference.rms_norm(sl.reshape(-1, head_dim), weight, EPS)
        check(ops.rms_norm(sl.reshape(-1, head_dim), weight, EPS, out=nan_like(ref)), ref, dtype)
        out3 = ops.rms_norm(sl.unflatten(-1, (-1, head_dim)), weight, EPS)
        assert out3.shape == (tokens, sl.shape[1] // head_dim, head_dim)
        check(out3.view(-1, head_dim), ref, dtype)


@pytest.mark.parametrize("hidden,tokens,dtype", [(1024, 7, d) for d in DTYPES] + [(576, 1, torch.bfloat16)]
                         + ([(4096, 300, torch.bfloat16)] if ON_GPU else []), ids=str)
def test_unit_offset_rms_norm(hidden, tokens, dtype, request):
    """Gemma's norm (times 1 + w, in float32 before the cast), alone and after the residual add;
    weights around 0 as Gemma's are, so that the offset matters."""
    x, residual, weight = _norm_inputs(tokens, hidden, dtype, seed_for(request), strided=tokens == 7)
    weight = weight - 1.0
    ref = reference.rms_norm(x, weight, EPS, unit_offset=True)
    check(ops.rms_norm(x, weight, EPS, out=nan_like(ref), unit_offset=True), ref, dtype)
    ref, ref_sum = reference.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    out, new_residual = ops.fused_add_rms_norm(x, residual, weight, EPS, unit_offset=True)
    check(out, ref, dtype)
    check(new_residual, ref_sum, dtype)
    if dtype != torch.float32:   # the product rounded once, after the offset: not Llama's norm's order
        plain = reference.rms_norm(x, weight + 1.0, EPS)
        assert not torch.equal(reference.rms_norm(x, weight, EPS, unit_offset=True), plain)


def test_rms_norm_mixed_dtypes(request):
    # torch's type promotion: an fp32 weight on fp16 activations gives fp32 (as the torch path).
    gen = seed_for(request)
    x = randn(5, 576, gen=gen, dtype=torch.float16, shift=0.5)
    residual = randn(5, 576, gen=gen, dtype=torch.float16)
    weight = randn(576, gen=gen, scale=0.2, shift=1.0)
    check(ops.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS), torch.float16)
    for o, r in zip(ops.fused_add_rms_norm(x, residual, weight, EPS),
                    reference.fused_add_rms_norm(x, residual, weight, EPS)):
        check(o, r, torch.float16)


# --------------------------------------------------------------------------------------------
# SiLU and mul


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,d", [(1, 14336), (7, 3072), (133, 1536), (5, 1000)]
                         + ([(2049, 14336)] if ON_GPU else []))
@pytest.mark.parametrize("act", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_silu_and_mul(tokens, d, dtype, act, request):
    gen = seed_for(request)
    x = randn(tokens, 2 * d + 16, gen=gen, dtype=dtype, scale=3.0)[:, 8:8 + 2 * d]   # strided rows
    ref = getattr(reference, act)(x)
    check(getattr(ops, act)(x, out=nan_like(ref)), ref, dtype)
    check(getattr(ops, act)(x), ref, dtype)


# --------------------------------------------------------------------------------------------
# Linear layers at batch 1 (pagoda.kernels.triton_linear)


# (N, K): Qwen3-0.6B's qkv, o, gate_up, down and Llama-3-8B's qkv on the GPU; on CPU small
# shapes with K not a power of two and N not a multiple of the kernel's row block
LINEAR_SHAPES = ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096), (1000, 1000),
                  (4096, 14336), (1000, 9000)]  # K over one chunk (Llama-3-8B's down), and ragged
                 if ON_GPU else [(37, 96), (130, 200), (16, 64)])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", LINEAR_SHAPES, ids=str)
def test_small_m_linear(n, k, rows, dtype, request):
    """Against F.linear in float32 from the same inputs, every row count the kernel takes: with
    and without bias, x both contiguous and a column slice of a wider buffer (strided rows)."""
    from pagoda.kernels.triton_linear import small_m_linear as kernel
    gen = seed_for(request)
    w = randn(n, k, gen=gen, dtype=dtype, scale=k ** -0.5)
    bias = randn(n, gen=gen, dtype=dtype)
    x_wide = randn(rows, k + 8, gen=gen, dtype=dtype)
    for x in (x_wide[:, :k].contiguous(), x_wide[:, 8:]):
        for b in (None, bias):
            ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
            check(kernel(x, w, b), ref.to(dtype), dtype)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("n,k", [(37, 200), (16, 64), (9, 65)], ids=str)
def test_small_m_linear_k_chunks(n, k, rows, monkeypatch, request):
    """A K longer than one chunk is summed over several slabs (here chunks of 32, the last one
    partial), with the same result as F.linear."""
    from pagoda.kernels import triton_linear
    monkeypatch.setattr(triton_linear, "CHUNK_K", 32)
    dtype = DTYPES[-1] if ON_GPU else torch.float16
    gen = seed_for(request)
    w = randn(n, k, gen=gen, dtype=dtype, scale=k ** -0.5)
    bias = randn(n, gen=gen, dtype=dtype)
    x = randn(rows, k, gen=gen, dtype=dtype)
    ref = torch.nn.functional.linear(x.float(), w.float(), bias.float())
    check(triton_linear.small_m_linear(x, w, bias), ref.to(dtype), dtype)


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("n,k", [(37, 96), (16, 200)] + ([(4096, 14336)] if ON_GPU else []), ids=str)
def test_small_m_linear_eight_bit_weights(n, k, weight_dtype, request):
    """8-bit weights (pagoda.quant.w8) with a float32 scale per output row: converted in
    registers, each row sum scaled once; against F.linear on the dequantized weight."""
    from pagoda.kernels.triton_linear import small_m_linear as kernel
    dtype = DTYPES[-1] if ON_GPU else torch.float16
    gen = seed_for(request)
    w = (torch.randn(n, k, generator=gen) * 60).clamp(-127, 127)
    w = (w.round().to(torch.int8) if weight_dtype == torch.int8 else w.to(weight_dtype)).to(DEVICE)
    scale = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    bias = randn(n, gen=gen, dtype=dtype)
    x = randn(1, k, gen=gen, dtype=dtype)
    for b in (None, bias):
        ref = torch.nn.functional.linear(x.float(), w.float() * scale, None if b is None else b.float())
        check(kernel(x, w, b, scale), ref.to(dtype), dtype)
    with pytest.raises(AssertionError):
        kernel(x, w)              # an 8-bit weight without its scale


# --------------------------------------------------------------------------------------------
# Per-token FP8 quantization (W8A8's activations)


# A row's scale from the norm's quantizing variant against per_token_quant of its plain output:
# the row's largest value may round the other way (half precision), or differ in float32's last bit.
QUANT_SCALE_RTOL = {torch.float32: 1e-6, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}


def assert_same_quantized(q: torch.Tensor, ref_q: torch.Tensor) -> None:
    """INT8 values, and FP8 ones on the GPU, bit for bit. Triton 3.6's interpreter rounds to FP8
    its own way (a value that rounds up to a power of two comes out as half of it, the smallest
    subnormal, 2^-9, as zero; some ties go up): there the misses must be few, of the same sign
    and within a factor of two, or zero against the smallest subnormal."""
    if ON_GPU or q.dtype == torch.int8:
        assert q.dtype == ref_q.dtype and torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        return
    qf, rf = q.float(), ref_q.float()
    miss = qf != rf
    assert miss.float().mean() < 0.05
    qf, rf = qf[miss], rf[miss]
    nonzero = (qf != 0) & (rf != 0)
    assert ((qf + rf)[~nonzero].abs() == 2 ** -9).all()
    qf, rf = qf[nonzero], rf[nonzero]
    assert (qf * rf > 0).all() and ((qf / rf).abs().clamp(min=0.5, max=2) == (qf / rf).abs()).all()


@pytest.mark.parametrize("quant_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 1024), (7, 896), (5, 3000)] + ([(300, 4096)] if ON_GPU else []),
                         ids=str)
def test_norms_and_silu_write_quantized_rows(tokens, hidden, dtype, quant_dtype, request):
    """``quant_dtype``: RMSNorm (alone, after the residual add) and SiLU-and-mul hand a W8A8
    matmul its input quantized per token: ``reference.per_token_quant`` of what they write
    without it (scales equal, values as ``per_token_quant``'s own), the new residual unchanged."""
    gen = seed_for(request)
    x, res = (randn(tokens, hidden, gen=gen, dtype=dtype) for _ in range(2))
    x = x * torch.logspace(-2, 2, tokens, device=DEVICE)[:, None].to(dtype)   # (rows of other magnitudes)
    w = randn(hidden, gen=gen, dtype=dtype)
    h = randn(tokens, 2 * hidden + 16, gen=gen, dtype=dtype)[:, 8:8 + 2 * hidden]   # (strided rows)
    cases = [(ops.rms_norm(x, w, EPS, quant_dtype=quant_dtype), ops.rms_norm(x, w, EPS)),
             (ops.rms_norm(x, w, EPS, quant_dtype=quant_dtype, unit_offset=True),
              ops.rms_norm(x, w, EPS, unit_offset=True)),
             (ops.silu_and_mul(h, quant_dtype=quant_dtype), ops.silu_and_mul(h)),
             (ops.gelu_tanh_and_mul(h, quant_dtype=quant_dtype), ops.gelu_tanh_and_mul(h))]
    (got, got_res), (plain, want_res) = (ops.fused_add_rms_norm(x, res, w, EPS, quant_dtype=quant_dtype),
                                         ops.fused_add_rms_norm(x, res, w, EPS))
    assert torch.equal(got_res, want_res)
    cases.append((got, plain))
    for i, (got, plain) in enumerate(cases):
        want_q, want_scale = reference.per_token_quant(plain, quant_dtype)
        assert isinstance(got, reference.QuantizedInput) and got.dtype == dtype
        assert got.q.shape == plain.shape and got.scale.shape == (tokens, 1) and got.scale.dtype == torch.float32
        if not ON_GPU:   # (the interpreter computes both variants alike)
            assert torch.equal(got.scale, want_scale)
            assert_same_quantized(got.q, want_q)
        # Compiled, the quantizing variant may sum a row in another order: its output, and so a
        # row's largest magnitude, can differ in the last bit. Its rows dequantize to what the
        # kernel computes within the 8-bit rounding.
        torch.testing.assert_close(got.scale, want_scale, rtol=QUANT_SCALE_RTOL[dtype], atol=0)
        err = (got.q.float() * got.scale - plain.float()).abs()
        bound = (0.5 * got.scale if quant_dtype == torch.int8
                 else plain.float().abs() / 16 + got.scale * 2 ** -9) * (1 + 2 * QUANT_SCALE_RTOL[dtype])
        # (+ float32's rounding of q * scale - plain, which at a half step can pass 0.5 * scale;
        # compiled, the other order of a row's sum can also move an output by its last bit)
        last_bit = torch.finfo(dtype).eps if ON_GPU else 1e-6
        excess = err - bound - last_bit * plain.float().abs() - 1e-6 * got.scale
        assert (excess <= 0).all(), f"case {i}: {(excess > 0).sum().item()} values over, by up to " \
            f"{(excess / got.scale).max().item():.3g} of a step; |q - want_q| up to " \
            f"{(got.q.float() - want_q.float()).abs().max().item()}"
    # the torch versions (the CPU path) take it too
    want = reference.fused_add_rms_norm(x, res, w, EPS, quant_dtype)[0]
    assert torch.equal(want.scale, reference.per_token_quant(reference.rms_norm(x + res, w, EPS), quant_dtype)[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,k", [(1, 1024), (7, 3072), (3, 1000)] + ([(300, 14336)] if ON_GPU else []),
                         ids=str)
def test_per_token_quant_fp8(tokens, k, dtype, request):
    """Each row over its own scale: the FP8 values bit for bit and the scales equal to the
    reference's, rows of very different magnitudes (and strided) included."""
    gen = seed_for(request)
    x = randn(tokens, k + 8, gen=gen, dtype=dtype)[:, 4:4 + k]
    x = x * torch.logspace(-3, 3, tokens, device=DEVICE, dtype=torch.float32)[:, None].to(dtype)
    q, scale = ops.per_token_quant(x)
    ref_q, ref_scale = reference.per_token_quant(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (tokens, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale)
    assert_same_quantized(q, ref_q)
    assert (ref_q.float().abs().amax(dim=1) == reference.FP8_MAX).all()   # each row's largest hits E4M3's top
    deq = ref_q.float() * ref_scale
    assert ((deq - x.float()).norm() / x.float().norm()).item() < 0.05


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,k", [(1, 1024), (7, 3072), (3, 1000)] + ([(300, 14336)] if ON_GPU else []),
                         ids=str)
def test_per_token_quant_int8(tokens, k, dtype, request):
    """INT8 (W8A8's integer scheme): each row over its own scale, rounded half away from zero,
    values and scales equal to the reference's on the CPU and the GPU alike; ties included."""
    gen = seed_for(request)
    x = randn(tokens, k + 8, gen=gen, dtype=dtype)[:, 4:4 + k]
    x = x * torch.logspace(-3, 3, tokens, device=DEVICE, dtype=torch.float32)[:, None].to(dtype)
    x[:, 0] = (x[:, 1:].abs().amax(dim=1).float() * 127 / 126).to(dtype)   # (the row's largest: 127, then a tie)
    x[:, 1] = (x[:, 0].float() * (1.5 / 127)).to(dtype)
    q, scale = ops.per_token_quant(x, torch.int8)
    ref_q, ref_scale = reference.per_token_quant(x, torch.int8)
    assert q.dtype == torch.int8 and scale.shape == (tokens, 1) and scale.dtype == torch.float32
    assert torch.equal(scale, ref_scale) and torch.equal(q, ref_q)
    assert (ref_q[:, 0] == 127).all()
    deq = ref_q.float() * ref_scale
    assert ((deq - x.float()).norm() / x.float().norm()).item() < 0.02


def test_small_m_linear_dispatch(monkeypatch):
    """Which matmuls take the kernel: CUDA half-precision single rows with unit stride along K,
    any weight size; everything else (and every CPU tensor) runs F.linear."""
    from pagoda.kernels import triton_linear as tl_
    from pagoda.quant.base import UnquantizedLinearMethod

    class Fake:  # a tensor's shape, dtype and device alone decide
        def __init__(self, shape, dtype=torch.bfloat16, cuda=True, k_stride=1):
            self.shape, self.dtype, self.is_cuda = torch.Size(shape), dtype, cuda
            self.k_stride = k_stride

        def dim(self):
            return len(self.shape)

        def stride(self, dim):
            return self.k_stride if dim == 1 else self.shape[1] * self.k_stride

    monkeypatch.setattr(tl_, "small_m_linear", lambda *a: "small")
    w = Fake((4096, 1024))
    assert tl_.linear(Fake((1, 1024)), w) == "small"
    assert tl_.linear(Fake((tl_.MAX_M + 1, 1024)), w) is None
    assert tl_.linear(Fake((1, 8192)), Fake((1024, 8192))) == "small"              # K in chunks
    assert tl_.linear(Fake((1, 1024), cuda=False), w) is None
    assert tl_.linear(Fake((1, 1024), torch.float32), Fake((4096, 1024), torch.float32)) is None
    assert tl_.linear(Fake((1, 4096)), Fake((128256, 4096))) == "small"            # a 1 GB LM head
    assert tl_.linear(Fake((1, 1024), k_stride=2), w) is None                       # strided along K
    assert tl_.linear(Fake((1, 1024)), Fake((4096, 1024), k_stride=2)) is None
    assert tl_.linear(Fake((0, 1024)), w) is None
    monkeypatch.setattr(tl_, "MAX_M", 0)                                             # turned off
    assert tl_.linear(Fake((1, 1024)), w) is None

    class Layer(torch.nn.Module):
        pass
    layer = Layer()
    layer.weight = torch.randn(48, 32, device=DEVICE, dtype=torch.float16)
    x = torch.randn(2, 32, device=DEVICE, dtype=torch.float16)
    calls = []
    monkeypatch.setattr(tl_, "linear", lambda *a: calls.append(a) or torch.zeros(2, 48))
    out = UnquantizedLinearMethod().apply(layer, x, None)
    assert calls == ([(x, layer.weight, None)] if ON_GPU else [])   # CPU tensors never ask
    if not ON_GPU:
        assert torch.equal(out, torch.nn.functional.linear(x, layer.weight))


def test_pdl_launch_arguments(monkeypatch):
    """Programmatic dependent launch: only on CUDA devices of compute capability 9 or more (the
    kernels then wait on the previous grid first), and USE_PDL = 0 turns it off. Every kernel
    test on the H200 runs with it on."""
    from pagoda.kernels import triton_utils
    assert triton_utils.pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    if ON_GPU:
        dev = torch.device("cuda", torch.cuda.current_device())
        hopper = torch.cuda.get_device_capability(dev)[0] >= 9
        assert triton_utils.pdl_launch(dev) == ({"USE_PDL": True, "launch_pdl": True} if hopper
                                                else {"USE_PDL": False})
        monkeypatch.setattr(triton_utils, "USE_PDL", 0)
        assert triton_utils.pdl_launch(dev) == {"USE_PDL": False}


# --------------------------------------------------------------------------------------------
# Empty batches, the layers' dispatch, CUDA graphs


def test_empty_batch():
    w = torch.ones(64, device=DEVICE)
    x = torch.empty(0, 64, device=DEVICE)
    assert ops.rms_norm(x, w, EPS).shape == (0, 64)
    assert [t.shape for t in ops.fused_add_rms_norm(x, x, w, EPS)] == [(0, 64), (0, 64)]
    assert ops.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


def _layer_cases(gen, dtype):
    norm = RMSNorm(576, EPS).to(DEVICE, dtype)
    norm.weight.data = randn(576, gen=gen, dtype=dtype, scale=0.2, shift=1.0)
    x, residual = randn(3, 576, gen=gen, dtype=dtype), randn(3, 576, gen=gen, dtype=dtype)
    gate_up = randn(3, 2 * 96, gen=gen, dtype=dtype)
    return [
        (lambda: norm(x), lambda: reference.rms_norm(x, norm.weight, EPS)),
        (lambda: norm(x, residual), lambda: reference.fused_add_rms_norm(x, residual, norm.weight, EPS)),
        (lambda: SiluAndMul()(gate_up), lambda: reference.silu_and_mul(gate_up)),
    ]


def test_layers_dispatch(monkeypatch, request):
    """CPU tensors take the torch path (exactly the reference); CUDA tensors the Triton one."""
    import pagoda.model.layers.layernorm as ln   # kernels_for: the one dispatch of all three
    calls = []

    class Spy:
        def __getattr__(self, name):
            def f(*args, **kw):
                calls.append(name)
                return getattr(ops, name)(*args, **kw)
            return f

    monkeypatch.setattr(ln, "_triton_ops", lambda: Spy())
    dtype = torch.float16 if ON_GPU else torch.float32
    for layer_fn, ref_fn in _layer_cases(seed_for(request), dtype):
        ref, out = ref_fn(), layer_fn()
        for o, r in zip(out if isinstance(out, tuple) else [out], ref if isinstance(ref, tuple) else [ref]):
            if ON_GPU:
                check(o, r, dtype)
            else:
                assert torch.equal(o, r)
    expected = ["rms_norm", "fused_add_rms_norm", "silu_and_mul"]
    assert calls == (expected if ON_GPU else [])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_capture_and_replay(request):
    gen = seed_for(request)
    dtype, tokens, hidden, head_dim, d = torch.bfloat16, 8, 1024, 128, 3072
    x, residual, weight = _norm_inputs(tokens, hidden, dtype, gen, strided=False)
    qkv = randn(tokens, 32 * head_dim, gen=gen, dtype=dtype)
    gate_up = randn(tokens, 2 * d, gen=gen, dtype=dtype)
    w_lin = randn(512, hidden, gen=gen, dtype=dtype, scale=hidden ** -0.5)
    from pagoda.kernels.triton_linear import small_m_linear

    def step():
        normed, new_res = ops.fused_add_rms_norm(x, residual, weight, EPS)
        q = qkv[:, :16 * head_dim]
        qn = ops.rms_norm(q.unflatten(-1, (-1, head_dim)), weight[:head_dim], EPS)
        return normed, new_res, qn, ops.silu_and_mul(gate_up), small_m_linear(x[:2], w_lin)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):  # new inputs, in place, then replay
        x.copy_(randn(tokens, hidden, gen=gen, dtype=dtype))
        qkv.copy_(randn(tokens, 32 * head_dim, gen=gen, dtype=dtype))
        gate_up.copy_(randn(tokens, 2 * d, gen=gen, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        ref_n, ref_r = reference.fused_add_rms_norm(x, residual, weight, EPS)
        ref_qn = reference.rms_norm(qkv[:, :16 * head_dim].reshape(-1, head_dim), weight[:head_dim], EPS)
        check(outs[0], ref_n, dtype)
        check(outs[1], ref_r, dtype)
        check(outs[2].view(-1, head_dim), ref_qn, dtype)
        check(outs[3], reference.silu_and_mul(gate_up), dtype)
        check(outs[4], torch.nn.functional.linear(x[:2].float(), w_lin.float()).to(dtype), dtype)
