"""The Triton sampling kernel (pagoda.kernels.triton_sampling) against its torch oracles: rows
without filters against reference.gumbel_sample given the same noise, rows with top-k / top-p /
min-p against reference.sampling_mask and reference.inverse_cdf_sample given the same uniforms;
the noise and the uniforms against their laws.
Without a CUDA device the kernels run in Triton's CPU interpreter (fp32, fp16); with one,
compiled, bf16 included: ``pytest tests/kernels/test_triton_sampling.py -q``."""
import math
import zlib

import pytest
import torch

from pagoda.kernels import reference, triton_sampling
from pagoda.kernels.triton_sampling import BLOCK_V, gumbel_noise_triton, row_uniforms_triton, sample_triton

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


def test_split_rows_draw_as_one_pass(request, monkeypatch):
    """Rows without filters are split over programs (more on small batches): the split changes
    no token, ties across splits included (the earliest column wins)."""
    gen = gen_for(request)
    vocab = 3 * BLOCK_V + 97
    logits = (torch.randn(4, vocab, generator=gen) * 3).to(DEVICE)
    logits[0, [BLOCK_V - 1, 2 * BLOCK_V]] = 100.0     # a greedy tie across splits
    logits[1, 3 * BLOCK_V + 1] = 100.0                # in the last split's part chunk
    temp = torch.tensor([0.0, 0.0, 0.7, 1.3], device=DEVICE)
    seeds = random_seeds(4, gen)
    drawn = {}
    for splits in (1, 2, 4, 8):   # 8: programs past the row's end
        monkeypatch.setattr(triton_sampling, "_gumbel_splits", lambda *args, s=splits: s)
        drawn[splits] = sample_triton(logits, temp, seeds)
    assert all(torch.equal(t, drawn[1]) for t in drawn.values()), drawn
    assert drawn[1][:2].tolist() == [BLOCK_V - 1, 3 * BLOCK_V + 1]


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


def test_draw_moves_only_with_a_near_tie(request):
    """Why rows without filters take Gumbel-max: logits perturbed a little, as a different batch's
    matmuls round them, move a row's draw only where two noisy scores nearly tie (about 3e-3 a
    row here). An inverse-CDF draw over such flat rows moves to a neighbouring token whenever
    the perturbed sum crosses a step of the CDF, about 0.35 * sqrt(vocab) times as often: on
    the H200, seeded requests of a float32 dummy model changed tokens between batches every
    10-13 steps (BENCHMARKS.md, seventh session)."""
    gen = gen_for(request)
    n, vocab = 16, 20_000
    logits = torch.randn(n, vocab, generator=gen) * 0.01                  # nearly flat rows
    nudged = logits + 2e-3 * torch.randn(n, vocab, generator=gen)
    temp, seeds = torch.ones(n, device=DEVICE), random_seeds(n, gen)
    assert torch.equal(sample_triton(logits.to(DEVICE), temp, seeds), sample_triton(nudged.to(DEVICE), temp, seeds))


def test_greedy_ties_take_first_index():
    vocab = 2 * BLOCK_V + 5
    logits = torch.zeros(2, vocab, device=DEVICE)
    logits[0, [7, BLOCK_V + 3]] = 1.0          # a tie across chunks
    logits[1, [BLOCK_V + 9, BLOCK_V + 11]] = 1.0  # a tie within a chunk
    tokens = sample_triton(logits, torch.zeros(2, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE))
    assert tokens.tolist() == [7, BLOCK_V + 9] == logits.argmax(-1).tolist()


def test_uniforms_are_uniform(request):
    """One uniform number per row, a function of the row's seed alone: uniform in [0, 1)."""
    n = 20_000 if ON_GPU else 500    # (the CPU interpreter runs a program in about 5 ms)
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


# ---------------------------------------------------------------- top-k / top-p / min-p
# Relative slack for the sandwich below: the kernel sums masses in float32 (exp2 approximate on
# the GPU), the reference in float64.
SLACK = 1e-4


def filter_rows(vocab):
    """(temperature, top_k, top_p, min_p) rows mixing every filter and combination."""
    return torch.tensor([
        [0.0, 5, 0.5, 0.0],          # greedy: the argmax whatever the filters
        [0.8, 0, 1.0, 0.0],          # temperature only, in a filtered batch
        [1.0, 1, 1.0, 0.0],          # k = 1
        [0.7, 50, 1.0, 0.0],
        [1.0, vocab, 1.0, 0.0],      # k >= vocab: off
        [1.3, vocab - 1, 1.0, 0.0],  # all but one
        [1.0, 0, 0.9, 0.0],
        [0.6, 0, 1e-6, 0.0],         # tiny top_p: the max alone
        [1.5, 0, 0.999, 0.0],        # thousands of tokens
        [0.9, 20, 0.5, 0.0],
        [1.0, 0, 1.0, 0.1],          # min-p alone
        [1.2, 0, 0.95, 0.05],
        [0.8, 10, 0.8, 0.02],        # all three
    ], dtype=torch.float64).T


def run_filtered(logits, rows, seeds):
    temp, top_k, top_p, min_p = (rows[0].float(), rows[1].long(), rows[2].float(), rows[3].float())
    dev = logits.device
    thresholds = torch.empty(logits.shape[0], device=dev)
    tokens = sample_triton(logits, temp.to(dev), seeds, top_k.to(dev), top_p.to(dev), min_p.to(dev), thresholds)
    return tokens.cpu(), thresholds.cpu(), (temp, top_k, top_p, min_p)


def check_against_reference(logits, rows, seeds, u):
    """The kernel's kept set lies between the reference's at top_p and min_p moved by SLACK
    (so it is exactly the reference's where those agree: at least half the rows, the others
    keeping thousands of tokens), and its draw is the reference's given the same uniform (up
    to the rounding of a CDF step). Returns the kept sets."""
    tokens, thr, (temp, top_k, top_p, min_p) = run_filtered(logits, rows, seeds)
    x = logits.cpu().float()
    lower = reference.sampling_mask(x, temp, top_k, torch.where(top_p < 1, top_p * (1 - SLACK), 1.0),
                                    min_p * (1 + SLACK))
    upper = reference.sampling_mask(x, temp, top_k, (top_p * (1 + SLACK)).clamp(max=1), min_p * (1 - SLACK))
    probs = (x.double() / temp.double().clamp(min=1e-30)[:, None]).softmax(-1)
    kept = ((reference.float_key(x) >= reference.float_key(thr)[:, None])
            & (probs >= probs.amax(-1, keepdim=True) * min_p.double()[:, None]))
    sampled = temp > 0
    assert (lower <= kept)[sampled].all() and (kept <= upper)[sampled].all()
    # Rows whose filters are all off draw by Gumbel-max, like a batch without filters.
    plain = sampled & ((top_k <= 0) | (top_k >= x.shape[-1])) & (top_p >= 1) & (min_p <= 0)
    scores = x / temp.clamp(min=1e-30)[:, None] + gumbel_noise_triton(seeds, x.shape[-1]).cpu()
    picked = scores.gather(1, tokens[:, None]).squeeze(1)
    assert ((scores.max(1).values - picked)[plain] <= 1e-5 * scores.max(1).values.abs()[plain] + 1e-6).all()
    sampled &= ~plain
    tight = (lower == upper).all(-1) & sampled
    assert tight.sum() >= 0.5 * sampled.sum()
    assert torch.equal(tokens[temp == 0], x.argmax(-1)[temp == 0]), "greedy rows must be the exact argmax"
    assert upper.gather(1, tokens[:, None])[sampled].all()
    # The draw over the kept set: u * total in the token's CDF interval, up to float32 rounding.
    mass = probs * kept
    cdf = mass.cumsum(-1)
    target = (u.cpu().double() * cdf[:, -1])[:, None]
    hi = cdf.gather(1, tokens[:, None])
    lo = hi - mass.gather(1, tokens[:, None])
    tol = 1e-5 * cdf[:, -1:]
    assert ((lo <= target + tol) & (target <= hi + tol))[tight].all()
    ref = reference.inverse_cdf_sample(x, temp, u.cpu(), kept)
    assert (tokens == ref)[tight].float().mean() >= 0.75
    return kept, tight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_filters_match_reference(request, dtype, vocab):
    gen = gen_for(request)
    rows = filter_rows(vocab)
    batch = rows.shape[1]
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE, dtype)
    seeds = random_seeds(batch, gen)
    kept, tight = check_against_reference(logits, rows, seeds, row_uniforms_triton(seeds))
    assert tight[2:4].all() and tight[5] and tight[7], "top-k alone and a tiny top-p: no rounding can move them"
    assert kept[4].all() and kept[3].sum() >= 50 and kept[7].sum() >= 1   # (more: ties at the boundary)


def test_filters_take_every_path(request, monkeypatch):
    """Small chunks and a short candidate list reach every path on a small vocabulary: the
    list (top-k 5, top-p of a few tokens), no bound from the column maxima (k beyond the
    columns, a flat top-p), and a list that overflows (a tie at the k-th place wider than the
    list: the whole tie stays)."""
    monkeypatch.setattr(triton_sampling, "BLOCK_V", 256)
    monkeypatch.setattr(triton_sampling, "LIST_CAP", 512)
    gen = gen_for(request)
    vocab = 3001
    rows = torch.tensor([[1.0, 5, 1.0, 0.0], [0.7, 0, 0.6, 0.0], [1.0, 300, 1.0, 0.0],
                         [2.0, 0, 0.99, 0.0], [1.0, 10, 0.9, 0.0], [1.0, 10, 1.0, 0.3]], dtype=torch.float64).T
    logits = torch.randn(6, vocab, generator=gen) * 3
    logits[3] *= 0.05                               # flat: top-p keeps most of the row
    tie = torch.randperm(vocab, generator=gen)[:600]
    logits[4:, tie] = logits[4:].amax(-1, keepdim=True) + 1   # 600 tokens tied at the max
    seeds = random_seeds(6, gen)
    kept = check_against_reference(logits.to(DEVICE), rows, seeds, row_uniforms_triton(seeds))[0].sum(-1)
    assert kept[0] == 5 and kept[2] == 300 and kept[3] > 512 and kept[4] == 600 and kept[5] == 600


def test_ties_at_the_threshold_stay():
    """A threshold keeps every token tied with the boundary: top-k 2 over [3, 1, 1, 1, -5, ...]
    keeps four tokens, and so does top-p 0.8, which needs the max (0.70 of the mass) and part
    of the tie (0.095 each)."""
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0] + [-5.0] * 60, device=DEVICE).expand(4, -1).contiguous()
    thresholds = torch.empty(4, device=DEVICE)
    one = torch.ones(4, device=DEVICE)
    tokens = sample_triton(logits, one, torch.arange(4, device=DEVICE) * 7919,
                           torch.tensor([2, 2, 0, 0], device=DEVICE), torch.tensor([1.0, 1.0, 0.8, 0.8], device=DEVICE),
                           None, thresholds)
    assert thresholds.tolist() == [1.0] * 4 and set(tokens.tolist()) <= {0, 1, 2, 3}


def test_signed_zeros_are_one_value():
    """-0.0 and +0.0 are equal logits, so a tie: a row of both keeps all of them under top-k 3
    or top-p 0.5 (the max of such a row may come out as either)."""
    logits = torch.zeros(2, 40, device=DEVICE)
    logits[:, ::3] = -0.0
    thresholds = torch.empty(2, device=DEVICE)
    sample_triton(logits, torch.ones(2, device=DEVICE), torch.arange(2, device=DEVICE),
                  torch.tensor([3, 0], device=DEVICE), torch.tensor([1.0, 0.5], device=DEVICE), None, thresholds)
    assert (thresholds.cpu() == 0).all()
    assert torch.equal(reference.float_key(logits[0]), torch.zeros(40, dtype=torch.int32, device=DEVICE))


def test_filtered_draw_depends_on_seed_only(request):
    gen = gen_for(request)
    logits = torch.randn(4, 1500, generator=gen).to(DEVICE) * 2
    seeds = random_seeds(4, gen)
    temp = torch.full((4,), 0.9, device=DEVICE)
    top_k = torch.tensor([0, 40, 0, 7], device=DEVICE)
    top_p = torch.tensor([0.8, 1.0, 0.95, 0.5], device=DEVICE)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0], device=DEVICE)
    flip = sample_triton(logits.flip(0), temp, seeds.flip(0), top_k.flip(0), top_p.flip(0), min_p.flip(0)).flip(0)
    assert torch.equal(sample_triton(logits, temp, seeds, top_k, top_p, min_p), flip)


@pytest.mark.skipif(not ON_GPU, reason="20,000 rows: too slow for the interpreter")
def test_filtered_empirical_distribution(request):
    """Token frequencies over many seeds follow softmax(x / T) renormalised over the kept set."""
    n, temp = 20_000, 0.7
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, 1.5], device=DEVICE).expand(n, -1).contiguous()
    for top_k, top_p, min_p in [(3, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.2), (4, 0.9, 0.1)]:
        f = lambda v, dtype=None: torch.full((n,), v, device=DEVICE, dtype=dtype)
        tokens = sample_triton(logits, f(temp), random_seeds(n, gen_for(request)), f(top_k, torch.long), f(top_p),
                               f(min_p))
        keep = reference.sampling_mask(logits[:1].cpu(), torch.tensor([temp]), torch.tensor([top_k]),
                                       torch.tensor([top_p]), torch.tensor([min_p]))[0]
        p = (logits[0].cpu().double() / temp).softmax(-1) * keep
        p /= p.sum()
        freq = torch.bincount(tokens.cpu(), minlength=6).double() / n
        assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-9).all(), (top_k, top_p, min_p, freq, p)
