"""Sampling in one Triton kernel: the GPU path of ``pagoda.runner.sampler`` for batches without
penalties, logit bias, banned tokens or logprobs; temperature, top-k, top-p and min-p per row.

Why: in torch, sampling a batch is a float copy of the logits, a division, a softmax, a cumsum
and a search: five passes over a (batch, vocabulary) tensor (256 x 151,936 floats at batch
256: 0.8 ms of GPU time and a dozen launches). Top-p sorted the vocabulary (5.2 ms at batch
256) and top-k ran torch.topk (1.6 ms).

How, for rows without filters: Gumbel-max, one pass over the row, split over several programs
(each the best of its part; a second small kernel picks the best part) so that a small batch
still fills the GPU. ``argmax_i(logit_i / T + g_i)`` with ``g_i = -log(-log(u_i))``, ``u_i`` uniform, is
distributed exactly as ``softmax(logit / T)``. The uniforms come from Philox keyed by the
row's 64-bit seed (four per call, ``tl.rand4x``), so the draw of a row depends only on its seed
and logits, never on the batch (the runner derives the seed from the request's seed and its
output position). And it barely depends on the logits' last bits: a perturbation moves the
draw only where two noisy scores nearly tie. An inverse-CDF draw (one uniform per row, two
cheap passes: 0.10 ms at batch 256 on the H200, against 0.22 for Gumbel-max in one program
a row then, 0.07 split now) moves to the neighbouring token
whenever rounding moves the cumulative sum across a step, which a flat distribution over
151,936 tokens makes frequent: seeded requests of a float32 dummy model changed tokens
between batches every 10-13 steps (BENCHMARKS.md, seventh session), so that a seeded request
would not reproduce whatever shares the batch. Greedy rows (``T = 0``) take the plain argmax,
first index on ties, as ``torch.argmax`` does.

How, for rows with top-k, top-p or min-p: a first pass keeps the running max and the sum of
``exp2((x - max) * k)``, ``k = log2(e) / T`` (an online softmax normaliser); the filters'
thresholds come next (below); the draw is by inverse CDF over the kept tokens, with one
Philox number per row, as the torch path draws (``sampler.draw``): it adds the kept terms
chunk by chunk until the sum passes ``u * total`` and scans only the chunk where it does. A
draw that float rounding pushes past the last term (probability about 1e-7) takes the argmax.

Filters, without sorting: each keeps the tokens whose logit is at or above a threshold, so all
tokens tied with the boundary stay (as with vLLM's sort-based top-k; the sorted torch path
keeps ties in sort order), and the draw runs over the kept tokens only. Min-p's is
direct: a token stays when its term ``exp2((x - max) * k)``, its probability over the max's,
is at least min_p. Top-k's and top-p's are found exactly by a search over keys, the
order-preserving int32 images of the logits: each pass counts (top-k) or sums the min-p-kept
mass (top-p) of the tokens at or above 16 keys at once (a compare, a select and an add per
token and key) and keeps the interval where the count or the mass crosses its target (k; top_p of the mass
that top-k and min-p keep), until it is one key wide. The keys are evenly spaced, at most 4
passes for bf16 logits (16-bit keys) and 8 for float32, but the first pass spaces them evenly
in value, where the logits are, which usually saves one. Top-p runs after top-k, over what
top-k keeps, as in ``sampler.apply_top_k_top_p_min_p``; ``reference.sampling_mask`` is this
definition in torch.

Passes over the whole vocabulary cost more than the draw, so the search runs on a short list
when it can: the first pass also keeps each column's max (a column: the logits at one offset
of every chunk, 38 at most for 151,936 tokens). At least k tokens reach the k-th largest
column max, and the tokens at or above any key hold at least the column maxima's mass there,
so the filters' thresholds lie at or above the key where the column maxima alone reach the
target: a search over the 4096 maxima finds it (within a key or so of the k-th largest token for top-k <= 4096; for
top-p when the kept set is much smaller than 4096 tokens, as in a model's next-token
distribution). One pass copies the tokens at or above that bound, in vocabulary order, into
the row's list (``LIST_CAP`` entries); the searches and the draw then run on it. A row whose
bound is too low for the list (more tokens than fit, or a top-p set of many thousand tokens)
searches the whole row: 3 or 4 passes for bf16 logits where the list took one copy.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagoda.kernels.triton_utils import fix_interpreter_bugs, num_sms, pdl_launch, pdl_wait

BLOCK_V = 4096
LIST_CAP = 2 * BLOCK_V      # a row's list of candidates (at least BLOCK_V: it first holds the column maxima)
SEARCH_BLOCK = 256          # tokens a search pass compares with its 16 keys at once (two such a step)
COPY_BLOCK = 1024           # tokens per step of the copy into the list (2048: its prefix sum spills)
NUM_PIVOTS = tl.constexpr(16)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# The hardware's approximate base-2 logarithm (lg2.approx: one instruction, where tl.math.log2
# is a polynomial of a dozen); the CPU interpreter has only the exact one.
FAST_LOG2 = tl.constexpr(not triton.knobs.runtime.interpret)
# Keys of narrower dtypes leave these low bits constant: dropping them shortens the search.
KEY_SHIFT = {torch.float32: 0, torch.float16: 13, torch.bfloat16: 16}
# Batches without filters split each row over programs until about this many per SM (two
# waves at 46 registers): one program a row took 0.18 ms on rows of 151,936 logits at any
# batch from 1 to 64 (a chunk every 4.5 us), a fixed cost of every W1 step; split, with each
# lane keeping its own best and hardware logarithms, 0.02-0.07 ms from batch 1 to 256 (H200,
# BENCHMARKS.md; 4 an SM ran W1 the same).
GUMBEL_PROGRAMS_PER_SM = 8
GUMBEL_MAX_SPLITS = 64
fix_interpreter_bugs()


@triton.jit
def _row_uniform(seed, zero):
    """The row's uniform number in [0, 1): Philox at counter 0 of its seed (``zero``: an int32
    0 tensor, the counter)."""
    return tl.rand(seed, zero)


@triton.jit
def _key(x, SHIFT: tl.constexpr):
    """The order-preserving int32 image of float32 ``x``, shifted right past the low bits that
    values of the input dtype leave constant. (+ 0.0 turns -0.0 into its equal +0.0: the max
    of a row of zeros may be either.)"""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)) >> SHIFT


@triton.jit
def _key_value(key, SHIFT: tl.constexpr):
    """The float32 value of a key (the inverse of ``_key``)."""
    b = (key << SHIFT) | tl.where(key < 0, (1 << SHIFT) - 1, 0)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _at(vec, i, N: tl.constexpr):
    """vec[i] for a runtime i (a reduction: registers cannot be indexed)."""
    return tl.sum(tl.where(tl.arange(0, N) == i, vec, 0), 0)


@triton.jit
def _reach(vals, n, pivots, m, k, min_p, mass, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """For each pivot key, the number (``mass`` false) or the min-p-kept mass (true) of the
    list's ``n`` tokens at or above it: one pass, all pivots at once. Each thread sums its own
    column, the threads' sums meeting once after the pass (a reduction a step took more
    instructions than the compares), and has two loads in flight a step (a column of 256
    tokens: 16 sums a thread; wider spills)."""
    cols = tl.arange(0, BLOCK)
    reach = tl.zeros([NUM_PIVOTS, BLOCK], tl.float32)
    for start in range(0, n, 2 * BLOCK):
        for half in tl.static_range(2):
            valid = start + half * BLOCK + cols < n
            x = tl.load(vals + start + half * BLOCK + cols, mask=valid, other=float("-inf")).to(tl.float32)
            e = tl.math.exp2((x - m) * k)
            w = tl.where(valid, tl.where(mass, tl.where(e >= min_p, e, 0.0), 1.0), 0.0)
            reach += tl.where(_key(x, SHIFT)[None, :] >= pivots[:, None], w[None, :], 0.0)
    return tl.sum(reach, 1)


@triton.jit
def _search(vals, n, lo, hi, floor, target, frac, m, k, min_p, mass, SHIFT: tl.constexpr,
            SEARCH_BLOCK: tl.constexpr):
    """The largest key s in [lo, hi) that at least ``target + frac * reach(lo)`` of the list
    reaches (a count or a mass, as ``_reach``), and its reach: the threshold that keeps as few
    tokens as the target allows. Needs reach(hi) under the target; returns lo (reach -1) when
    reach(lo) is under it too. Each pass evaluates lo and 15 more pivots and keeps the interval
    between the last that reaches the target and the next: evenly spaced in key, except the
    first pass's, evenly spaced in value from ``floor`` (when finite) to the max, where the
    logits are (keys crowd around 0 and run through empty exponents)."""
    j = tl.arange(0, NUM_PIVOTS)
    floor = tl.maximum(floor, _key_value(lo, SHIFT))
    lo = lo.to(tl.int64)        # (the span of 32-bit keys overflows int32)
    hi = hi.to(tl.int64)
    reach_lo = tl.full([], -1.0, tl.float32)
    passes = 0
    while hi - lo > 1:
        q = (lo + j.to(tl.int64) * ((hi - lo + NUM_PIVOTS - 1) // NUM_PIVOTS)).to(tl.int32)
        if (passes == 0) & (floor > float("-inf")):
            by_value = floor + j.to(tl.float32) * ((m - floor) / NUM_PIVOTS)
            q = tl.where(j == 0, lo.to(tl.int32), _key(by_value, SHIFT))
        reach = _reach(vals, n, q, m, k, min_p, mass, SHIFT, SEARCH_BLOCK)
        if passes == 0:
            target += frac * _at(reach, 0, NUM_PIVOTS)
        passes += 1
        # (reach falls as the pivot rises, in float too: sums of non-negative terms in a fixed
        # order, zeros for the tokens under the pivot; so the pivots reaching the target are a prefix)
        c = tl.sum((reach >= target).to(tl.int32), 0)
        if c == 0:
            hi = lo + 1
        else:
            reach_lo = _at(reach, c - 1, NUM_PIVOTS)
            hi = tl.where(c < NUM_PIVOTS, _at(q, c, NUM_PIVOTS).to(tl.int64), hi)
            lo = _at(q, c - 1, NUM_PIVOTS).to(tl.int64)
    return lo.to(tl.int32), reach_lo


@triton.jit
def _draw(vals, ids, n, t, target, m, k, min_p, HAS_IDS: tl.constexpr, SHIFT: tl.constexpr,
          BLOCK: tl.constexpr):
    """The first of the list's tokens whose cumulative kept term passes ``target`` (-1 when
    rounding leaves the sum under it), and the sum of the terms scanned: with an infinite
    target, the kept mass. Kept: key at or above ``t``, term at least min_p."""
    cols = tl.arange(0, BLOCK)
    run = tl.full([], 0.0, tl.float32)
    token = tl.full([], -1, tl.int32)
    start = 0
    while (start < n) & (token < 0):
        x = tl.load(vals + start + cols, mask=start + cols < n, other=float("-inf")).to(tl.float32)
        p = tl.math.exp2((x - m) * k)
        p = tl.where((_key(x, SHIFT) >= t) & (p >= min_p), p, 0.0)
        chunk_total = tl.sum(p, 0)
        if run + chunk_total > target:
            # (counting the columns at or under the target finds the first one past it; a
            # column of zero mass never adds, so it is never the one)
            i = tl.sum((tl.cumsum(p, 0) + run <= target).to(tl.int32), 0)
            if i < BLOCK:   # else rounding: the scan's sum stayed under the target
                if HAS_IDS:
                    token = tl.load(ids + start + i)
                else:
                    token = start + i
        run += chunk_total
        start += BLOCK
    return token, run


@triton.jit
def _compact(row, vocab, bound, m, k, min_p, total, list_vals, list_ids, LIST_CAP: tl.constexpr,
             SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """Copies the row's tokens with key at or above ``bound`` (values and ids, in vocabulary
    order) into the list, stopping once they overflow it. Returns their number and the row's
    min-p-kept mass (``total`` without min-p)."""
    cols = tl.arange(0, BLOCK)
    n = tl.full([], 0, tl.int32)
    norm = tl.full([], 0.0, tl.float32)
    start = 0
    while (start < vocab) & (n <= LIST_CAP):
        valid = start + cols < vocab
        x = tl.load(row + start + cols, mask=valid, other=float("-inf")).to(tl.float32)
        take = valid & (_key(x, SHIFT) >= bound)
        taken = tl.sum(take.to(tl.int32), 0)
        if taken > 0:       # (few chunks have candidates when the bound is tight)
            pos = n + tl.cumsum(take.to(tl.int32), 0) - 1
            tl.store(list_vals + pos, x, mask=take & (pos < LIST_CAP))
            tl.store(list_ids + pos, start + cols, mask=take & (pos < LIST_CAP))
        n += taken
        if min_p > 0:
            e = tl.math.exp2((x - m) * k)
            norm += tl.sum(tl.where(e >= min_p, e, 0.0), 0)
        start += BLOCK
    return n, tl.where(min_p > 0, norm, total)


@triton.jit
def _filter_and_draw(vals, ids, n, lo, norm, u, vocab, m, k, top_k, top_p, min_p, use_k, use_p,
                     HAS_IDS: tl.constexpr, SHIFT: tl.constexpr, BLOCK: tl.constexpr,
                     SEARCH_BLOCK: tl.constexpr):
    """Top-k, then top-p over what top-k and min-p keep, then the draw, over a list holding
    every token the filters may keep, all at or above key ``lo`` (the row itself, or its
    candidates). ``norm``, when positive, is the min-p-kept mass of the whole row (top-p's
    total without top-k, when the list holds only candidates). Returns the token (-1:
    rounding) and the threshold key."""
    top = _key(m, SHIFT) + 1
    t = lo
    if use_k:
        t, _ = _search(vals, n, lo, top, float("-inf"), top_k.to(tl.float32), 0.0, m, k, min_p,
                       False, SHIFT, SEARCH_BLOCK)
    kept = tl.full([], -1.0, tl.float32)
    if use_p:
        given = (norm > 0) & (use_k == 0)
        t, kept = _search(vals, n, t, top, _top_p_floor(m, k, top_p, vocab), tl.where(given, top_p * norm, 0.0),
                          tl.where(given, 0.0, top_p), m, k, min_p, True, SHIFT, SEARCH_BLOCK)
    if kept < 0:
        _, kept = _draw(vals, ids, n, t, float("inf"), m, k, min_p, HAS_IDS, SHIFT, BLOCK)
    token, _ = _draw(vals, ids, n, t, u * kept, m, k, min_p, HAS_IDS, SHIFT, BLOCK)
    return token, t


@triton.jit
def _top_p_floor(m, k, top_p, vocab):
    """A logit under which top-p drops every token: each has less than (1 - top_p) / vocab of
    the max's probability, so all of them together less than 1 - top_p of the kept mass."""
    return m + tl.math.log2(tl.maximum(1.0 - top_p, 1e-30) / vocab) / k


@triton.jit
def _sample_filtered(row, vocab, col_max, m, total, u, k, top_k, top_p, min_p, use_k, use_p,
                     list_vals, list_ids, LIST_CAP: tl.constexpr, SHIFT: tl.constexpr,
                     BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, COPY_BLOCK: tl.constexpr):
    """A row with filters: the bound from the column maxima, the list of candidates at or
    above it when they fit, then the filters and the draw on the list or else the row."""
    bound = tl.full([], -1, tl.int32)
    found = tl.full([], -1.0, tl.float32)
    if use_k | use_p:
        columns = tl.minimum(vocab, BLOCK)
        tl.store(list_vals + tl.arange(0, BLOCK), col_max)
        tl.debug_barrier()
        # Top-k: the k-th largest column max (k <= 4096). Top-p without top-k: the largest key
        # whose column maxima hold top_p of the row's mass (none when all of them hold less).
        lo = _key(tl.min(tl.where(tl.arange(0, BLOCK) < columns, col_max, float("inf")), 0), SHIFT)
        bound, found = _search(list_vals, columns, lo, _key(m, SHIFT) + 1,
                               tl.where(use_k, float("-inf"), _top_p_floor(m, k, top_p, vocab)),
                               tl.where(use_k, top_k.to(tl.float32), top_p * total), 0.0, m, k, min_p,
                               use_k == 0, SHIFT, SEARCH_BLOCK)
        tl.debug_barrier()
    n = tl.full([], LIST_CAP + 1, tl.int32)
    norm = tl.full([], -1.0, tl.float32)
    if found >= 0:
        n, norm = _compact(row, vocab, bound, m, k, min_p, total, list_vals, list_ids, LIST_CAP, SHIFT,
                           COPY_BLOCK)
        tl.debug_barrier()
    if n <= LIST_CAP:
        token, t = _filter_and_draw(list_vals, list_ids, n, bound, norm, u, vocab, m, k, top_k, top_p,
                                    min_p, use_k, use_p, True, SHIFT, BLOCK, SEARCH_BLOCK)
    else:
        lowest = _key(tl.full([], float("-inf"), tl.float32), SHIFT)
        token, t = _filter_and_draw(row, list_ids, vocab, lowest, -1.0, u, vocab, m, k, top_k, top_p,
                                    min_p, use_k, use_p, False, SHIFT, BLOCK, SEARCH_BLOCK)
    return token, t


@triton.jit
def _log2(x):
    if FAST_LOG2:
        y = libdevice.fast_log2f(x)
    else:
        y = tl.math.log2(x)
    return y


@triton.jit
def _gumbel(u):
    """Standard Gumbel noise from uniforms in [0, 1): ``-ln(-ln u)``, in base-2 logarithms
    (u = 0 gives -inf, never picked: the formula's limit)."""
    return -LN2 * _log2(-LN2 * _log2(u))


@triton.jit
def _gumbel_noise(seed, start, BLOCK_V: tl.constexpr):
    """The noise of columns [start, start + BLOCK_V), as four quarters: quarter q holds columns
    ``start + q * BLOCK_V // 4 + lane``. One Philox call gives four uniforms (tl.rand4x),
    numbered per chunk, so a column's noise depends only on the seed and the column."""
    u = tl.rand4x(seed, (start // 4) + tl.arange(0, BLOCK_V // 4))
    return _gumbel(u[0]), _gumbel(u[1]), _gumbel(u[2]), _gumbel(u[3])


@triton.jit
def _best_in_range(base, seed, temperature, lo, hi, vocab, BLOCK_V: tl.constexpr):
    """The best (score, column) over columns [lo, hi) of a row (``lo`` a multiple of BLOCK_V):
    of ``logit / T + g`` (Gumbel-max, ``g`` from ``_gumbel_noise``), or of the logits where
    ``temperature`` is 0 (greedy). Ties go to the earliest column, as one pass over the row
    gives them. Each lane keeps its own best over the chunks (strictly greater: its earlier
    column wins a tie), and the lanes meet once at the end: a reduction a quarter cost more
    than the noise."""
    Q: tl.constexpr = BLOCK_V // 4
    lane = tl.arange(0, Q)
    best = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.full([Q], 0, tl.int32)
    sampled = temperature > 0
    t = tl.where(sampled, temperature, 1.0)     # (greedy rows: no division by 0)
    for start in range(lo, hi, BLOCK_V):
        g = _gumbel_noise(seed, start, BLOCK_V)
        for q in tl.static_range(4):
            cols = start + q * Q + lane
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            x = tl.where(cols < vocab, tl.where(sampled, x / t + g[q], x), float("-inf"))
            better = x > best
            best_idx = tl.where(better, cols, best_idx)
            best = tl.where(better, x, best)
    score = tl.max(best, 0)
    return score, tl.min(tl.where(best == score, best_idx, vocab), 0)


# (not specialized on the split counts, which change with the batch: one compiled variant)
@triton.jit(do_not_specialize=["chunks_per_split", "splits"])
def _gumbel_max_kernel(logits_ptr, temperature_ptr, seeds_ptr, out_ptr, part_score_ptr, part_idx_ptr,
                       vocab, stride_row, chunks_per_split, splits, BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr):
    """Batches without filters: program (row, split) takes ``chunks_per_split`` chunks of the
    row. With one split it writes the token; with more, its best (score, column), which
    ``_pick_split_kernel`` reduces."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)     # (step inputs: read before the wait)
    seed = tl.load(seeds_ptr + row)
    pdl_wait(USE_PDL)
    lo = split * chunks_per_split * BLOCK_V
    hi = tl.minimum(lo + chunks_per_split * BLOCK_V, vocab)
    best, best_idx = _best_in_range(logits_ptr + row.to(tl.int64) * stride_row, seed, temperature, lo, hi,
                                    vocab, BLOCK_V)
    if splits == 1:
        tl.store(out_ptr + row, best_idx.to(tl.int64))
    else:
        tl.store(part_score_ptr + row * splits + split, best)
        tl.store(part_idx_ptr + row * splits + split, best_idx)


@triton.jit(do_not_specialize=["splits"])
def _pick_split_kernel(out_ptr, part_score_ptr, part_idx_ptr, splits, MAX_SPLITS: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """A row's token: the best of its splits' (score, column), the first split on ties (so the
    earliest column wins, as in one pass)."""
    row = tl.program_id(0)
    pdl_wait(USE_PDL)
    offs = tl.arange(0, MAX_SPLITS)
    score = tl.load(part_score_ptr + row * splits + offs, mask=offs < splits, other=float("-inf"))
    first = tl.min(tl.where((score == tl.max(score, 0)) & (offs < splits), offs, MAX_SPLITS), 0)
    tl.store(out_ptr + row, tl.load(part_idx_ptr + row * splits + first).to(tl.int64))


@triton.jit
def _sample_kernel(logits_ptr, temperature_ptr, seeds_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
                   list_vals_ptr, list_ids_ptr, out_ptr, thresholds_ptr, vocab, stride_row,
                   BLOCK_V: tl.constexpr, LIST_CAP: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
                   COPY_BLOCK: tl.constexpr, SHIFT: tl.constexpr, THRESHOLDS: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """Batches with filters (top-k, top-p or min-p on some row): one program a row."""
    pdl_wait(USE_PDL)
    row = tl.program_id(0)
    temperature = tl.load(temperature_ptr + row)       # 0 for greedy rows
    base = logits_ptr + row.to(tl.int64) * stride_row
    cols = tl.arange(0, BLOCK_V)
    k = LOG2E / tl.where(temperature > 0, temperature, 1.0)

    # Rows without filters: Gumbel-max, one pass. Rows with filters: a first pass (the max, its
    # first index, the sum of exp2((x - max) * k), each column's max), then the filters and the
    # inverse-CDF draw over what they keep. Greedy rows: the first pass's argmax.
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    filtered_row = ((temperature > 0) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0) | (min_p > 0))).to(tl.int32)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if (temperature > 0) & (filtered_row == 0):
        _, best_idx = _best_in_range(base, tl.load(seeds_ptr + row), temperature, 0, vocab, vocab, BLOCK_V)
        tl.store(out_ptr + row, best_idx.to(tl.int64))
        if THRESHOLDS:
            tl.store(thresholds_ptr + row, float("-inf"))
        return

    m = tl.full([], float("-inf"), tl.float32)
    best = tl.full([], 0, tl.int32)
    total = tl.full([], 0.0, tl.float32)
    col_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, 0)
        chunk_best = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start
        best = tl.where(chunk_max > m, chunk_best, best)       # strictly: earlier chunks win ties
        new_m = tl.maximum(m, chunk_max)
        if filtered_row:
            total = total * tl.math.exp2((m - new_m) * k) + tl.sum(tl.math.exp2((x - new_m) * k), 0)
            col_max = tl.maximum(col_max, x)
        m = new_m

    token = best
    t = _key(tl.full([], float("-inf"), tl.float32), SHIFT)
    if filtered_row:
        u = _row_uniform(tl.load(seeds_ptr + row), row * 0)
        row_list = row.to(tl.int64) * LIST_CAP
        drawn, t = _sample_filtered(base, vocab, col_max, m, total, u, k, top_k, top_p, min_p,
                                    use_k, use_p, list_vals_ptr + row_list, list_ids_ptr + row_list,
                                    LIST_CAP, SHIFT, BLOCK_V, SEARCH_BLOCK, COPY_BLOCK)
        if drawn >= 0:
            token = drawn
    tl.store(out_ptr + row, token.to(tl.int64))
    if THRESHOLDS:
        tl.store(thresholds_ptr + row, _key_value(t, SHIFT))


def sample_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  min_p: torch.Tensor | None = None, thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits (batch, vocab)`` (float32, float16 or bfloat16, unit stride
    along the vocabulary): a draw from ``softmax(logits / temperature)`` restricted to what the
    row's filters keep (``reference.sampling_mask``), or the argmax where ``temperature`` is 0.
    ``temperature`` float32 and ``seeds`` int64, both ``(batch,)`` on the logits' device; the
    optional filters ``(batch,)`` too: ``top_k`` integer (0 or >= vocab: off), ``top_p`` and
    ``min_p`` float32 (1 and 0: off). ``thresholds`` (float32, tests): receives each row's
    top-k/top-p threshold on the logits (-inf: none). Capturable: no host sync, buffers
    allocated from shapes."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == (batch,) and seeds.shape == (batch,)
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    if not batch:
        return out
    filtered = top_k is not None or top_p is not None or min_p is not None
    if not filtered:
        _gumbel_max(logits, temperature, seeds, out)
        if thresholds is not None:
            thresholds.fill_(float("-inf"))
        return out
    assert LIST_CAP >= BLOCK_V
    # (the runner passes all three; a missing one costs a fill)
    top_k = torch.zeros(batch, dtype=torch.long, device=logits.device) if top_k is None else top_k
    top_p = torch.ones(batch, device=logits.device) if top_p is None else top_p
    min_p = torch.zeros(batch, device=logits.device) if min_p is None else min_p
    lists = (torch.empty(batch, LIST_CAP, dtype=torch.float32, device=logits.device),
             torch.empty(batch, LIST_CAP, dtype=torch.int32, device=logits.device))
    _sample_kernel[(batch,)](logits, temperature, seeds, top_k, top_p, min_p, *lists, out,
                             out if thresholds is None else thresholds, vocab, logits.stride(0),
                             BLOCK_V=BLOCK_V, LIST_CAP=LIST_CAP, SEARCH_BLOCK=SEARCH_BLOCK,
                             COPY_BLOCK=COPY_BLOCK, SHIFT=KEY_SHIFT[logits.dtype],
                             THRESHOLDS=thresholds is not None, num_warps=8,
                             **pdl_launch(logits.device))
    return out


def _gumbel_splits(batch: int, chunks: int, device: torch.device) -> int:
    want = triton.cdiv(GUMBEL_PROGRAMS_PER_SM * num_sms(device), batch)
    return min(triton.next_power_of_2(want), triton.next_power_of_2(chunks), GUMBEL_MAX_SPLITS)


def _gumbel_max(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor) -> None:
    """Rows without filters (Gumbel-max or greedy), each split over a power of two of programs
    (from shapes only: capturable), then a pick of the best split where there are several."""
    batch, vocab = logits.shape
    chunks = triton.cdiv(vocab, BLOCK_V)
    splits = _gumbel_splits(batch, chunks, logits.device)
    parts = (torch.empty(batch, splits, dtype=torch.float32, device=logits.device),
             torch.empty(batch, splits, dtype=torch.int32, device=logits.device)) if splits > 1 else (out, out)
    _gumbel_max_kernel[(batch, splits)](logits, temperature, seeds, out, *parts, vocab, logits.stride(0),
                                        triton.cdiv(chunks, splits), splits, BLOCK_V=BLOCK_V, num_warps=8,
                                        **pdl_launch(logits.device))
    if splits > 1:
        _pick_split_kernel[(batch,)](out, *parts, splits, MAX_SPLITS=GUMBEL_MAX_SPLITS, num_warps=1,
                                     **pdl_launch(logits.device))


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


@triton.jit
def _noise_kernel(seeds_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    Q: tl.constexpr = BLOCK_V // 4
    for start in range(0, vocab, BLOCK_V):
        g = _gumbel_noise(seed, start, BLOCK_V)
        for q in tl.static_range(4):
            cols = start + q * Q + tl.arange(0, Q)
            tl.store(out_ptr + row.to(tl.int64) * vocab + cols, g[q], mask=cols < vocab)


def gumbel_noise_triton(seeds: torch.Tensor, vocab: int) -> torch.Tensor:
    """The noise ``sample_triton`` adds to each unfiltered row for its seed, a ``(batch, vocab)``
    float32 tensor: lets the tests check the kernel against ``reference.gumbel_sample``."""
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _noise_kernel[(seeds.shape[0],)](seeds, out, vocab, BLOCK_V=BLOCK_V)
    return out
