"""Sampling from temperature-scaled logits in one Triton kernel (the GPU fast path of
``pagoda.runner.sampler`` for rows without top-k / top-p / min-p, penalties or logprobs).

Why: in torch, sampling a batch is a float copy of the logits, a division, a softmax, a cumsum
and a search: five passes over a (batch, vocabulary) tensor (256 x 151,936 floats at batch
256: 0.8 ms of GPU time and a dozen launches). This kernel reads the logits once.

How: the Gumbel-max trick. ``argmax_i(logit_i / T + g_i)`` with ``g_i = -log(-log(u_i))``,
``u_i`` uniform, is distributed exactly as ``softmax(logit / T)``, so a row is one pass that
keeps a running max. The uniforms come from Philox keyed by a per-row 64-bit seed (four per
call, ``tl.rand4x``: the random numbers, not the bytes, were this kernel's cost): the noise of
a row depends only on its seed, never on the batch,
so a seeded request reproduces its output whatever shares the step (the runner derives the
seed from the request's seed and its output position). Greedy rows (``T = 0``) take the plain
argmax, first index on ties, as ``torch.argmax`` does.
"""
import torch
import triton
import triton.language as tl

from pagoda.kernels.triton_utils import fix_interpreter_loop_bounds, pdl_launch, pdl_wait

BLOCK_V = 4096
fix_interpreter_loop_bounds()


@triton.jit
def _gumbel(u):
    """Standard Gumbel noise from uniforms in [0, 1) (u = 0 gives -inf: never picked, the
    limit of the formula)."""
    return -tl.log(-tl.log(u))


@triton.jit
def _chunk(logits_row, seed, start, vocab, temperature, BLOCK_V: tl.constexpr, SCORES: tl.constexpr):
    """The best (score, column) of columns [start, start + BLOCK_V) of a row, or with SCORES
    the noise itself. One Philox call gives four uniforms (tl.rand4x): quarter q of the chunk
    takes the q-th, counters numbered per chunk, so the noise of a column depends only on the
    seed and the column."""
    Q: tl.constexpr = BLOCK_V // 4
    u = tl.rand4x(seed, (start // 4) + tl.arange(0, Q))
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for q in tl.static_range(4):
        cols = start + q * Q + tl.arange(0, Q)
        g = _gumbel(u[q])
        if SCORES:
            tl.store(logits_row + cols, g, mask=cols < vocab)
        else:
            x = tl.load(logits_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            if temperature > 0:
                x = x / temperature + g
            x = tl.where(cols < vocab, x, float("-inf"))
            m = tl.max(x, 0)
            i = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start + q * Q
            best_idx = tl.where(m > best, i, best_idx)      # strictly: earlier columns win ties
            best = tl.maximum(m, best)
    return best, best_idx


@triton.jit
def _sample_kernel(logits_ptr, temperature_ptr, seeds_ptr, out_ptr, vocab, stride_row,
                   BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)       # 0 for greedy rows
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        m, i = _chunk(base, seed, start, vocab, temperature, BLOCK_V, False)
        best_idx = tl.where(m > best, i, best_idx)
        best = tl.maximum(m, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


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
def _noise_kernel(seeds_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    for start in range(0, vocab, BLOCK_V):
        _chunk(out_ptr + row.to(tl.int64) * vocab, seed, start, vocab, 1.0, BLOCK_V, True)


def gumbel_noise_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise ``sample_triton`` adds for each row's seed, as a ``(batch, vocab)`` float32
    tensor: lets the tests check the kernel against ``reference.gumbel_sample``."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    _noise_kernel[(seeds.shape[0],)](seeds, out, vocab, BLOCK_V=BLOCK_V)
    return out
