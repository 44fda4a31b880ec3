"""The Triton sampling kernel (pagoda.kernels.triton_sampling) against its torch oracle
(reference.gumbel_sample, given the same noise), and the noise itself against the Gumbel law.
Without a CUDA device the kernels run in Triton's CPU interpreter (fp32, fp16); with one,
compiled, bf16 included: ``pytest tests/kernels/test_triton_sampling.py -q``."""
import math
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.kernels.triton_sampling import BLOCK_V, gumbel_noise_triton, sample_triton

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
    noise = gumbel_noise_triton(seeds, vocab)
    ref = reference.gumbel_sample(logits, temp, noise)
    greedy = temp == 0
    assert torch.equal(tokens[greedy], ref[greedy]), "greedy rows must be the exact argmax"
    # Sampled rows: the kernel's division and add may round differently (approximate division,
    # fused ops), so the token it picks must be a maximum of the reference's scores up to
    # float32 rounding.
    scores = logits.float() / temp.clamp(min=1e-30)[:, None] + noise
    picked = scores.gather(1, tokens[:, None]).squeeze(1)
    best = scores.max(1).values
    assert ((best - picked)[~greedy] <= 1e-5 * best.abs()[~greedy] + 1e-6).all()
    assert (tokens == ref).float().mean() >= 0.8


def test_greedy_ties_take_first_index():
    vocab = 2 * BLOCK_V + 5
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [7, BLOCK_V + 3]] = 1.0          # a tie across chunks
    logits[1, [BLOCK_V + 9, BLOCK_V + 11]] = 1.0  # a tie within a chunk
    tokens = sample_triton(logits, torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert tokens.tolist() == [7, BLOCK_V + 9] == logits.argmax(-1).tolist()


def test_noise_is_gumbel(request):
    """iid standard Gumbel noise is what makes the argmax a draw from softmax(logits / T)."""
    vocab = 50_000
    noise = gumbel_noise_triton(random_seeds(2, gen_for(request)), vocab).cpu().double()
    assert torch.isfinite(noise).all()
    for row in noise:
        assert abs(row.mean().item() - 0.5772156649) < 0.03            # Euler's constant
        assert abs(row.std().item() - math.pi / math.sqrt(6)) < 0.03
        # Kolmogorov-Smirnov distance to the Gumbel CDF exp(-exp(-x)).
        x = row.sort().values
        cdf = torch.exp(-torch.exp(-x))
        ks = (cdf - torch.arange(1, vocab + 1, dtype=torch.float64) / vocab).abs().max().item()
        assert ks < 1.63 / math.sqrt(vocab)                             # p = 0.01
    assert (noise[0] - noise[1]).abs().mean() > 0.5, "different seeds, different noise"


def test_noise_depends_on_seed_only(request):
    """A row's noise is a function of its seed: same seed, same noise, wherever the row sits."""
    seeds = random_seeds(4, gen_for(request))
    a = gumbel_noise_triton(seeds, 3000)
    b = gumbel_noise_triton(seeds.flip(0), 3000).flip(0)
    assert torch.equal(a, b)
    logits = torch.randn(4, 3000, device=DEVICE)
    temp = torch.full((4,), 1.0, device=DEVICE)
    assert torch.equal(sample_triton(logits, temp, seeds),
                       sample_triton(logits.flip(0), temp, seeds.flip(0)).flip(0))


def test_empirical_distribution(request):
    """End to end on a tiny vocabulary: token frequencies over many seeds follow softmax(x / T)."""
    gen = gen_for(request)
    n, temp = 400 if not ON_GPU else 20_000, 0.7
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3], device=DEVICE).expand(n, -1).contiguous()
    tokens = sample_triton(logits, torch.full((n,), temp, device=DEVICE), random_seeds(n, gen))
    freq = torch.bincount(tokens.cpu(), minlength=5).double() / n
    p = (logits[0].cpu().double() / temp).softmax(-1)
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (freq, p)
