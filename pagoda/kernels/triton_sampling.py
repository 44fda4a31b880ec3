"""Sampling from temperature-scaled logits in one Triton kernel (the GPU fast path of
``pagoda.runner.sampler`` for rows without top-k / top-p / min-p, penalties or logprobs).

Why: in torch, sampling a batch is a float copy of the logits, a division, a softmax, a cumsum
and a search: five passes over a (batch, vocabulary) tensor (256 x 151,936 floats at batch
256: 0.8 ms of GPU time and a dozen launches). The Gumbel-max kernel that came next read the
logits once but drew a Philox number and took two logarithms for every logit: about 145
instructions each, 0.19 ms a step at batch 256 (BENCHMARKS.md).

How: inverse CDF with one uniform number per row, in two passes over the row (one program per
row). The first keeps the running max and the sum of ``exp2((x - max) * k)``, ``k = log2(e) /
T`` (an online softmax normaliser). The second adds the same terms chunk by chunk until the sum
passes ``u * total`` and scans only the chunk where it does: a few instructions a logit, and
the row is in L2 for the second pass. The uniform comes from Philox keyed by the row's 64-bit
seed, so the draw of a row depends only on its seed and logits, never on the batch (a seeded
request reproduces its output whatever shares the step; the runner derives the seed from the
request's seed and its output position). Greedy rows (``T = 0``) take the first pass's argmax,
first index on ties, as ``torch.argmax`` does. A draw that float rounding pushes past the
last term (probability about 1e-7) takes the argmax too.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_loop_bounds, pdl_launch, pdl_wait

BLOCK_V = 4096
LOG2E = tl.constexpr(1.4426950408889634)
fix_interpreter_loop_bounds()


@triton.jit
def _row_uniform(seed, zero):
    """The row's uniform number in [0, 1): Philox at counter 0 of its seed (``zero``: an int32
    0 tensor, the counter)."""
    return tl.rand(seed, zero)


@triton.jit
def _sample_kernel(logits_ptr, temperature_ptr, seeds_ptr, out_ptr, vocab, stride_row,
                   BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)       # 0 for greedy rows
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK_V)
    k = LOG2E / tl.where(temperature > 0, temperature, 1.0)

    # Pass 1: the max, its first index, and (sampled rows) the sum of exp2((x - max) * k).
    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, vocab, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, 0)
        chunk_best = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start
        best = tl.where(chunk_max > m, chunk_best, best)       # strictly: earlier chunks win ties
        new_m = tl.maximum(m, chunk_max)
        if temperature > 0:
            total = total * tl.math.exp2((m - new_m) * k) + tl.sum(tl.math.exp2((x - new_m) * k), 0)
        m = new_m

    token = best
    if temperature > 0:
        # Pass 2: the first column whose cumulative term passes u * total.
        target = _row_uniform(tl.load(seeds_ptr + row), row * 0) * total
        run = tl.full([], 0.0, tl.float32)
        start = 0
        found = 0
        while (start < vocab) & (found == 0):
            x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
            p = tl.math.exp2((x - m) * k)
            chunk_total = tl.sum(p, 0)
            if run + chunk_total > target:
                # (counting the columns at or under the target finds the first one past it; a
                # column of zero mass never adds, so it is never the one)
                idx = tl.sum((tl.cumsum(p, 0) + run <= target).to(tl.int32), 0)
                if idx < BLOCK_V:   # else rounding: the scan's sum stayed under the target
                    token = start + idx
                    found = 1
            run += chunk_total
            start += BLOCK_V
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits (batch, vocab)`` (any float dtype, unit stride along the
    vocabulary): a draw from ``softmax(logits / temperature)``, or the argmax where
    ``temperature`` is 0. ``temperature`` float32 and ``seeds`` int64, both ``(batch,)`` on the
    logits' device. Capturable: no host sync, output allocated from shapes."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (batch,) and seeds.shape == (batch,)
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    if batch:
        _sample_kernel[(batch,)](logits, temperature, seeds, out, vocab, logits.stride(0),
                                 BLOCK_V=BLOCK_V, num_warps=8, **pdl_launch(logits.device))
    return out


@triton.jit
def _uniform_kernel(seeds_ptr, out_ptr):
    row = tl.program_id(0)
    tl.store(out_ptr + row, _row_uniform(tl.load(seeds_ptr + row), row * 0))


def row_uniforms_triton(seeds: torch.Tensor) -> torch.Tensor:
    """The uniform number ``sample_triton`` draws for each row's seed, float32 ``(batch,)``: lets
    the tests check the kernel against ``reference.inverse_cdf_sample``."""
    out = torch.empty(seeds.shape[0], dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0],)](seeds, out)
    return out
