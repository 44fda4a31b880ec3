"""The Triton sampling kernel (pagoda.kernels.triton_sampling) against its torch oracle
(reference.inverse_cdf_sample, given the same uniforms), and the uniforms against their law.
Without a CUDA device the kernels run in Triton's CPU interpreter (fp32, fp16); with one,
compiled, bf16 included: ``pytest tests/kernels/test_triton_sampling.py -q``."""
import math
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels.triton_sampling import BLOCK_V, row_uniforms_triton, sample_triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
VOCABS = [1000, BLOCK_V + 97] + ([151_936] if ON_GPU else [])


def gen_for(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def random_seeds(n, gen):
    return torch.randint(0, 2**62, (n,), generator=gen).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_sample_matches_reference(request, dtype, vocab):
    gen = gen_for(request)
    batch = 6
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE, dtype)
    # Mixed rows: greedy (0), low, neutral and high temperatures.
    temp = torch.tensor([0.0, 0.6, 1.0, 0.0, 1.5, 0.05], device=DEVICE)
    seeds = random_seeds(batch, gen)
    tokens = sample_triton(logits, temp, seeds)
    u = row_uniforms_triton(seeds)
    ref = reference.inverse_cdf_sample(logits, temp, u)
    greedy = temp == 0
    assert torch.equal(tokens[greedy], ref[greedy]), "greedy rows must be the exact argmax"
    # Sampled rows: the kernel sums in float32 (and exp2 is approximate on the GPU), so where
    # u * total falls within rounding of a step of the CDF it may pick the neighbour. The token
    # must hold u * total in its CDF interval up to that rounding, and carry mass.
    probs = (logits.double() / temp.double().clamp(min=1e-30)[:, None]).softmax(-1)
    cdf = probs.cumsum(-1)
    x = (u.double() * cdf[:, -1])[:, None]
    hi = cdf.gather(1, tokens[:, None])
    lo = hi - probs.gather(1, tokens[:, None])
    tol = 1e-5
    sampled = ~greedy
    assert ((lo <= x + tol) & (x <= hi + tol))[sampled].all()
    assert (probs.gather(1, tokens[:, None]) > 0)[sampled].all()
    assert (tokens == ref)[sampled].float().mean() >= 0.75


def test_greedy_ties_take_first_index():
    vocab = 2 * BLOCK_V + 5
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [7, BLOCK_V + 3]] = 1.0          # a tie across chunks
    logits[1, [BLOCK_V + 9, BLOCK_V + 11]] = 1.0  # a tie within a chunk
    tokens = sample_triton(logits, torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert tokens.tolist() == [7, BLOCK_V + 9] == logits.argmax(-1).tolist()


def test_uniforms_are_uniform(request):
    """One uniform number per row, a function of the row's seed alone: uniform in [0, 1)."""
    n = 20_000 if ON_GPU else 2_000
    seeds = random_seeds(n, gen_for(request))
    u = row_uniforms_triton(seeds).cpu().double()
    assert ((u >= 0) & (u < 1)).all()
    x = u.sort().values
    ks = (x - torch.arange(1, n + 1, dtype=torch.float64) / n).abs().max().item()
    assert ks < 1.63 / math.sqrt(n)                                         # p = 0.01
    assert torch.equal(row_uniforms_triton(seeds.flip(0)).cpu().flip(0), u.float())


def test_draw_depends_on_seed_only(request):
    """A row's draw is a function of its seed and logits: the same wherever the row sits."""
    seeds = random_seeds(4, gen_for(request))
    logits = torch.randn(4, 3000, device=DEVICE)
    temp = torch.full((4,), 1.0, device=DEVICE)
    assert torch.equal(sample_triton(logits, temp, seeds),
                       sample_triton(logits.flip(0), temp, seeds.flip(0)).flip(0))


def test_mass_in_one_column_of_a_later_chunk():
    # Every other column (and the masked tail of the last chunk) has no mass: the draw must
    # land on the one column that has, whatever the uniform.
    vocab = 2 * BLOCK_V + 5
    logits = torch.full((3, vocab), -1e4, device=DEVICE)
    logits[:, BLOCK_V + 17] = 0.0
    tokens = sample_triton(logits, torch.ones(3, device=DEVICE), torch.arange(3, device=DEVICE) * 977)
    assert tokens.tolist() == [BLOCK_V + 17] * 3


def test_empirical_distribution(request):
    """End to end on a tiny vocabulary: token frequencies over many seeds follow softmax(x / T)."""
    gen = gen_for(request)
    n, temp = 400 if not ON_GPU else 20_000, 0.7
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3], device=DEVICE).expand(n, -1).contiguous()
    tokens = sample_triton(logits, torch.full((n,), temp, device=DEVICE), random_seeds(n, gen))
    freq = torch.bincount(tokens.cpu(), minlength=5).double() / n
    p = (logits[0].cpu().double() / temp).softmax(-1)
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (freq, p)
