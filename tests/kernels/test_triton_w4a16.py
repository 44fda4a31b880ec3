"""The W4A16 Triton kernel (``pagoda.kernels.triton_w4a16``) against ``int4.dequantize`` and a
float32 matmul, on fresh random packed weights: 4 and 8 bits, groups by the rule (of 128 and 256,
a row of scales a tile) and permuted (GPTQ act-order, through g_idx), a partial last group, 1-130 rows (each row count's own tile), batches over the largest
row tile (row tiles), column counts that do not fill a tile, and
K split over programs or not. In Triton's CPU interpreter (float32, float16) without a GPU;
compiled, in bfloat16 and float16, with one."""
import zlib

import pytest
import torch

from pagoda.kernels import triton_w4a16 as tw
from pagoda.quant.int4 import dequantize, pack_rows

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def random_layer(k, n, bits, group, act_order, dtype, gen):
    groups = -(-k // group)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (k, n), generator=gen, dtype=torch.int32)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    scales = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, top + 1, (groups, n), generator=gen).to(dtype)
    return [t.to(DEVICE) for t in (pack_rows(q, bits), scales, zeros, g_idx)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 64, 130])
@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 256, 200, 128, False), (4, 256, 48, 32, True), (8, 96, 64, 64, False), (4, 1024, 128, 128, True),
    (4, 1024, 64, 256, False)],
    ids=["4bit", "4bit-act-order-narrow", "8bit-partial-group", "4bit-act-order-split-k", "4bit-groups-256-split-k"])
def test_w4a16_matches_dequantized_matmul(dtype, m, bits, k, n, group, act_order, request):
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    qweight, scales, zeros, g_idx = random_layer(k, n, bits, group, act_order, dtype, gen)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    w = dequantize(qweight, scales, zeros, g_idx, bits)
    for b in (None, bias):
        ref = x.float() @ w.float() + (0 if b is None else b.float())
        # groups by the rule are read a row a tile (group_size given), else through g_idx
        out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, bits, b, None if act_order else group)
        assert out.dtype == dtype and out.shape == (m, n)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("bits,group", [(4, 32), (4, 16), (8, 16), (8, 32)])
def test_float_zero_points(dtype, m, bits, group, request):
    """GGUF's layout (``quantization="gguf"``): zero points with fractions, groups of 16 or 32,
    with ``int_zeros`` off; the integer-zero path would drop their fractions (float16's base of
    1024 has no fraction bits left)."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    k, n = 256, 96
    qweight, scales, _, g_idx = random_layer(k, n, bits, group, False, dtype, gen)
    zeros = (torch.rand(k // group, n, generator=gen) * (1 << bits)).to(DEVICE, dtype)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    ref = x.float() @ dequantize(qweight, scales, zeros, g_idx, bits).float()
    out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, bits, None, group, int_zeros=False)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    if dtype == torch.float16:
        rounded = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, bits, None, group)
        assert ((rounded.float() - ref).norm() / ref.norm()).item() > 3 * err


@pytest.mark.parametrize("bits,k,n,group,act_order", [
    (4, 256, 200, 128, False), (4, 256, 48, 32, True), (8, 96, 64, 64, False), (4, 160, 72, 48, False)],
    ids=["4bit", "4bit-act-order", "8bit-partial-group", "4bit-groups-across-tiles"])
def test_dequantize_gives_the_weight_int4_dequantize_builds(bits, k, n, group, act_order, request):
    """Batches over MAX_M rows: the whole weight dequantized in one pass, transposed for
    ``F.linear``, holds ``int4.dequantize``'s values exactly, in the scales' dtype and another."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    dtype = DTYPES[0]
    qweight, scales, zeros, g_idx = random_layer(k, n, bits, group, act_order, dtype, gen)
    want = dequantize(qweight, scales, zeros, g_idx, bits).t()
    for out_dtype in (dtype, torch.float32):
        got = tw.dequantize(qweight, scales, zeros, g_idx, bits, None if act_order else group, out_dtype)
        assert got.shape == (n, k) and got.dtype == out_dtype and got.is_contiguous()
        assert torch.equal(got, want.to(out_dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 5, 64, 130])
@pytest.mark.parametrize("weight_dtype,k,n", [(torch.int8, 256, 200), (torch.float8_e4m3fn, 1024, 96)], ids=str)
def test_w8a16_matches_the_dequantized_matmul(dtype, m, weight_dtype, k, n, request):
    """8-bit weights as ``quant.w8`` stores them ((N, K), a float32 scale a row): converted in
    registers, the row scales applied to the sums (K split or not)."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    w = (torch.randn(n, k, generator=gen) * 60).clamp(-127, 127)
    w = (w.round().to(torch.int8) if weight_dtype == torch.int8 else w.to(weight_dtype)).to(DEVICE)
    scale = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).to(DEVICE)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    for b in (None, bias):
        ref = x.float() @ (w.float() * scale).t() + (0 if b is None else b.float())
        out = tw.w8a16_linear(x, w, scale, b)
        assert out.dtype == dtype and out.shape == (m, n)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 37])
@pytest.mark.parametrize("block,k,n", [((128, 128), 1024, 256), ((32, 48), 400, 100), ((64, 256), 512, 192)], ids=str)
def test_w8a16_with_block_scales(dtype, m, block, k, n, request):
    """FP8 weights with a scale per block (DeepSeek's / Qwen3's FP8 checkpoints): blocks that
    span whole tiles or lie within them, partial blocks at the matrix's edges."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    w = (torch.randn(n, k, generator=gen) * 60).clamp(-400, 400).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.01 + 1e-3
    dense = w.float() * scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    ref = x.float() @ dense.to(DEVICE).t() + bias.float()
    out = tw.w8a16_linear(x, w.to(DEVICE), scale.to(DEVICE), bias, block=block)
    assert out.dtype == dtype and out.shape == (m, n)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_batches_over_the_largest_row_tile_run_in_row_tiles(monkeypatch):
    # the largest tile cut to 32 rows: 70 rows are three row tiles, the last partial
    monkeypatch.setattr(tw, "TILES", {32: dict(tw.TILES[64])})
    gen = torch.Generator().manual_seed(2)
    qweight, scales, zeros, g_idx = random_layer(256, 96, 4, 128, False, torch.float16, gen)
    x = torch.randn(70, 256, generator=gen).to(DEVICE, torch.float16)
    ref = x.float() @ dequantize(qweight, scales, zeros, g_idx, 4).float()
    out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, 128)
    assert ((out.float() - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float16]


@pytest.mark.parametrize("kernel,rows", [("_w4a16_kernel", 2), ("_w4a16_gemv_kernel", 1)])
def test_split_k_is_chosen_for_few_column_tiles(monkeypatch, kernel, rows):
    # 2 column tiles cannot fill the chip: K is split; a call on a matrix wide enough is not
    # (one row takes the GEMV kernel, more rows the tensor-core one).
    calls = []
    real = getattr(tw, kernel)

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(tw, kernel, Spy())
    monkeypatch.setattr(tw, "PROGRAMS_PER_SM", 1)
    monkeypatch.setattr(tw, "GEMV_PROGRAMS_PER_SM", 1)
    gen = torch.Generator().manual_seed(0)
    block_n = (tw.GEMV_TILES if rows == 1 else tw.TILES[64])["BLOCK_N"]
    k = 2 * (tw.GEMV_STEP if rows == 1 else tw.TILES[64]["BLOCK_K"])
    for n in (2 * block_n, block_n * tw.num_sms(torch.device(DEVICE))):
        qweight, scales, zeros, g_idx = random_layer(k, n, 4, 128, False, torch.float32, gen)
        x = torch.randn(rows, k, generator=gen).to(DEVICE)
        out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4)
        ref = x.double() @ dequantize(qweight, scales, zeros, g_idx, 4).double()
        assert ((out.double() - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float32]
    assert calls[0][1] > 1 and calls[1][1] == 1


@pytest.mark.parametrize("reduce_in_kernel", [1, 0])
@pytest.mark.parametrize("k,group", [(1024, 128), (480, 48), (384, 384), (4096, 64)],
                         ids=["groups-128", "groups-48-a-word-row-each", "one-group", "groups-64-split"])
def test_gemv_split_sums(monkeypatch, reduce_in_kernel, k, group, request):
    """One row, K split over programs: the last program of each column tile sums the splits (its
    counters left at zero for the next launch: three launches in a row agree), or torch does;
    steps within groups of any size that holds whole words, and a single group."""
    monkeypatch.setattr(tw, "GEMV_REDUCE_IN_KERNEL", reduce_in_kernel)
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    dtype = DTYPES[0]
    n = 3 * tw.GEMV_TILES["BLOCK_N"] - 5
    qweight, scales, zeros, g_idx = random_layer(k, n, 4, group, False, dtype, gen)
    x = torch.randn(1, k, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    ref = x.float() @ dequantize(qweight, scales, zeros, g_idx, 4).float() + bias.float()
    outs = [tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, bias, group) for _ in range(3)]
    err = ((outs[0].float() - ref).norm() / ref.norm()).item()
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    if reduce_in_kernel:
        assert int(tw._split_counts(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("zeros_kind,group", [("int", 128), ("fractions", 32), ("beyond_clamp", 16)])
def test_gemv_bf16x2_against_float32(monkeypatch, zeros_kind, group):
    """4-bit weights times bf16 x two values an instruction: as close to the exact product as the
    float32 path, within a factor of two, and not the float32 path's result (so it ran). In the
    CPU interpreter the instructions' arithmetic is emulated (``_bf16x2_emulated``), which checks
    the x pairs and zeros the kernel feeds them. GGUF's zero points with fractions (the words'
    sums take their nearest integers, the fractions' share added once), also far outside the
    range an integer part may take (-128..128: the rest goes with the fraction)."""
    gen = torch.Generator().manual_seed(3)
    k, n = (4096, 512) if ON_GPU else (1024, 96)
    qweight, scales, zeros, g_idx = random_layer(k, n, 4, group, False, torch.bfloat16, gen)
    if zeros_kind != "int":
        span = 16 if zeros_kind == "fractions" else 600
        zeros = ((torch.rand(zeros.shape, generator=gen) - (0 if span == 16 else 0.5)) * span).to(DEVICE, zeros.dtype)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    ref = x.double() @ dequantize(qweight, scales, zeros, g_idx, 4).double()
    errs, outs = [], []
    for on in (1, 0):
        monkeypatch.setattr(tw, "GEMV_BF16X2", on)
        outs.append(tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, group, int_zeros=zeros_kind == "int"))
        errs.append(((outs[-1].double() - ref).norm() / ref.norm()).item())
    assert errs[0] < 2 * errs[1] + 1e-3 and not torch.equal(outs[0], outs[1]), errs


@pytest.mark.skipif(not ON_GPU, reason="the layer takes the kernel on CUDA tensors only")
def test_quantized_layer_runs_the_kernel_for_decode_batches(monkeypatch):
    # (and larger batches the whole weight dequantized by ``tw.dequantize``, then cuBLAS)
    used = []
    real = tw.w4a16_linear
    monkeypatch.setattr(tw, "w4a16_linear", lambda *a, **kw: used.append(a[0].shape[0]) or real(*a, **kw))
    from pagoda.model.layers.linear import ReplicatedLinear
    from pagoda.quant.int4 import Int4Config, Int4LinearMethod
    layer = ReplicatedLinear(256, 128, bias=False, quant_method=Int4LinearMethod(
        Int4Config.from_checkpoint("gptq", dict(bits=4, group_size=128, checkpoint_format="gptq_v2"))))
    gen = torch.Generator().manual_seed(1)
    layer.qweight.data, layer.scales.data, layer.zeros, layer.g_idx.data = random_layer(256, 128, 4, 128, False,
                                                                                    torch.bfloat16, gen)
    layer.bits = 4   # (as process_weights_after_loading sets it)
    dequantized = []
    real_dequantize = tw.dequantize
    monkeypatch.setattr(tw, "dequantize", lambda *a, **kw: dequantized.append(a[6]) or real_dequantize(*a, **kw))
    w = dequantize(layer.qweight, layer.scales, layer.zeros, layer.g_idx, 4).float()
    for m in (1, tw.PACKED_MAX_M, tw.PACKED_MAX_M + 1, 2000):
        x = torch.randn(m, 256, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w
        assert ((layer(x).float() - ref).norm() / ref.norm()).item() < TOLERANCE[torch.bfloat16]
    assert used == [1, tw.PACKED_MAX_M] and dequantized == [torch.bfloat16, torch.bfloat16]
