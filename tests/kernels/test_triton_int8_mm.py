"""The INT8 W8A8 Triton kernel (``pagoda.kernels.triton_int8_mm``) against ``reference.scaled_mm``
on fresh random INT8 matrices: rows and columns that do not fill a tile (they wrap around to row
0 when loaded), K not a multiple of the tile's, several row tiles per group of the launch order,
with and without a bias, float32 / float16 / bfloat16 output. In Triton's CPU interpreter
(small tiles, so that one matrix spans many programs) without a GPU; compiled, at the decode
and prefill shapes of Qwen3-0.6B and Llama-3-8B with the default tiles, with one."""
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels import triton_int8_mm as ti

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# (The sums are exact in both; what is left is the epilogue's rounding to the output dtype, and
# on the GPU the reference's float32 sums over a long K.)
TOLERANCE = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 4e-3}
SMALL_TILES = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, GROUP_M=2, num_warps=4, num_stages=2)
CPU_SHAPES = [(5, 48, 64), (37, 80, 100), (70, 33, 96)]
GPU_SHAPES = [(257, 4096, 1024), (300, 4096, 14336), (1100, 1024, 3072), (2048, 6144, 4096), (4096, 1024, 2048),
              (513, 1000, 4104)]


def random_operands(m, n, k, gen):
    x_q = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    x_scale = torch.rand(m, 1, generator=gen) * 1e-2 + 1e-4
    w_scale = torch.rand(n, 1, generator=gen) * 1e-2 + 1e-4
    bias = torch.randn(n, generator=gen)
    return [t.to(DEVICE) for t in (x_q, x_scale, w_q, w_scale, bias)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m,n,k", GPU_SHAPES if ON_GPU else CPU_SHAPES, ids=str)
def test_int8_mm_matches_the_scaled_matmul(m, n, k, dtype, request):
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    x_q, x_scale, w_q, w_scale, bias = random_operands(m, n, k, gen)
    tiles = None if ON_GPU else SMALL_TILES
    for b in (None, bias.to(dtype)):
        out = ti.int8_mm(x_q, x_scale, w_q, w_scale, b, dtype, tiles)
        assert out.dtype == dtype and out.shape == (m, n)
        ref = reference.scaled_mm(x_q, x_scale, w_q, w_scale, b, torch.float32)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


def test_int8_mm_default_tiles_and_strided_rows():
    """The tiles chosen by the row count, and x's rows strided (a slice of a wider buffer): the
    kernel reads rows by their stride."""
    gen = torch.Generator().manual_seed(11)
    x_q, x_scale, w_q, w_scale, bias = random_operands(40, 72, 256, gen)
    wide = torch.zeros(40, 300, dtype=torch.int8, device=DEVICE)
    wide[:, 8:264] = x_q
    out = ti.int8_mm(wide[:, 8:264], x_scale, w_q, w_scale, bias, torch.float32)
    assert ti.tiles_for(40) is ti.TILES[0] and ti.tiles_for(1 << 20) is ti.TILES[max(ti.TILES)]
    ref = reference.scaled_mm(x_q, x_scale, w_q, w_scale, bias, torch.float32)
    assert ((out - ref).norm() / ref.norm()).item() < TOLERANCE[torch.float32]


def test_int8_mm_no_rows():
    gen = torch.Generator().manual_seed(12)
    _, _, w_q, w_scale, _ = random_operands(1, 24, 32, gen)
    x_q = torch.empty(0, 32, dtype=torch.int8, device=DEVICE)
    out = ti.int8_mm(x_q, torch.empty(0, 1, device=DEVICE), w_q, w_scale, None, torch.bfloat16)
    assert out.shape == (0, 24) and out.dtype == torch.bfloat16


def test_int8_mm_refuses_other_dtypes():
    gen = torch.Generator().manual_seed(13)
    x_q, x_scale, w_q, w_scale, _ = random_operands(4, 16, 32, gen)
    with pytest.raises(AssertionError):
        ti.int8_mm(x_q.float(), x_scale, w_q, w_scale, None, torch.float32)
