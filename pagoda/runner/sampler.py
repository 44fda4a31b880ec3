"""Sampling for the whole batch in a few tensor ops: penalties, temperature, top-k / top-p /
min-p, then one draw per row. A seeded request draws its random number from its own generator,
so its output does not depend on what else shares the batch. On CUDA, batches without
penalties, logit bias, banned tokens or logprobs take one Triton kernel instead
(kernels/triton_sampling.py: the same filters, thresholds found without sorting)."""
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor            # (B,) float32, 0 for greedy rows
    all_greedy: bool
    top_k: torch.Tensor | None           # (B,) int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None           # (B,) float32
    min_p: torch.Tensor | None           # (B,) float32
    generators: dict[int, torch.Generator]   # row -> its own generator (seeded requests)
    # Penalties (None when no row uses them): output token counts and a prompt-token mask.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None    # (B, V) float32
    prompt_mask: torch.Tensor | None = None      # (B, V) bool
    # (row indices, token ids) whose logits are forced to -inf (min_tokens holding back stops)
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None    # rows, their (rows, vocab) bool masks
    bad_words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None   # rows, ids, banned (bool) now
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, values
    # Every row keeps at most this many tokens (all rows set top_k); 0 when some row sets none.
    max_top_k: int = 0
    # The most logprobs a row asks for (-1: the whole vocabulary); None when no row asks.
    max_num_logprobs: int | None = None
    # Some row is greedy (False lets the sampler skip the argmax: 13 ms a step at batch 256 on
    # the CPU). True when unknown.
    any_greedy: bool = True
    # (B,) int64 per-row Philox seeds: set by the runner when the batch can take the one-kernel
    # GPU path (no penalties, bias, banned tokens or logprobs; top_k, top_p and min_p are then
    # all set or all None).
    seeds: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor           # (B,)
    # The rest only when some row asks for logprobs:
    logprobs: torch.Tensor | None     # (B,) raw logprob of the sampled token
    ranks: torch.Tensor | None        # (B,) rank of the sampled token
    topk_ids: torch.Tensor | None     # (B, k)
    topk_logprobs: torch.Tensor | None


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.repetition_penalty is not None:
        seen = md.prompt_mask | (md.output_counts > 0)
        rp = md.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty[:, None] * md.output_counts
        logits = logits - md.presence_penalty[:, None] * (md.output_counts > 0).float()
    return logits


# Up to this k, top-k candidates (torch.topk) are much cheaper than sorting the vocabulary.
MAX_TOPK_CANDIDATES = 1024


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask logits outside each row's top-k / nucleus / min-p set to -inf."""
    if md.min_p is not None:
        probs = logits.softmax(-1)
        threshold = probs.amax(-1, keepdim=True) * md.min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    if 0 < md.max_top_k <= MAX_TOPK_CANDIDATES:
        # Every row's set lies within its max_top_k best tokens: rank only those.
        cand, cand_idx = logits.topk(md.max_top_k, dim=-1)
        return torch.full_like(logits, float("-inf")).scatter(-1, cand_idx, _mask_sorted(cand, md))
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    return logits.scatter(-1, sorted_idx, _mask_sorted(sorted_logits, md))


def _mask_sorted(sorted_logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Top-k then top-p over logits sorted in descending order (a prefix of the vocabulary).
    Tokens tied at the boundary stay or go in sort order; the one-kernel path keeps them all
    (reference.sampling_mask)."""
    n = sorted_logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if md.top_k is not None:
        k = torch.where(md.top_k > 0, md.top_k, n)
        remove |= torch.arange(n, device=sorted_logits.device)[None, :] >= k[:, None]
    if md.top_p is not None:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        remove |= (probs.cumsum(-1) - probs) >= md.top_p[:, None]
    remove[:, 0] = False
    return sorted_logits.masked_fill(remove, float("-inf"))


def draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row by inverting the CDF: a single uniform number per row, so a seeded row
    takes its number from its own generator. (The first index whose cumulative mass exceeds
    u * total always has mass, so a masked token is never drawn.)"""
    u = torch.rand(probs.shape[0], device=probs.device)
    for row, gen in generators.items():
        u[row] = torch.rand(1, generator=gen, device=probs.device)[0]
    cdf = probs.cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return tokens.clamp_(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    plain = (md.logit_bias is None and md.banned is None and md.allowed is None and md.bad_words is None
             and md.output_counts is None)
    if md.all_greedy and plain and md.max_num_logprobs is None:
        return SamplerOutput(logits.argmax(-1), None, None, None, None)   # no float copy needed
    if md.seeds is not None:
        from pagoda.kernels.triton_sampling import sample_triton
        tokens = sample_triton(logits, md.temperature, md.seeds, md.top_k, md.top_p, md.min_p)
        return SamplerOutput(tokens, None, None, None, None)
    raw = logits.float()
    logits = raw
    if md.logit_bias is not None:
        rows, ids, vals = md.logit_bias
        logits = logits.index_put((rows, ids), vals, accumulate=True)
    logits = apply_penalties(logits, md)
    if md.banned is not None:
        logits = logits.index_put(md.banned, torch.full((), float("-inf"), device=logits.device))
    if md.bad_words is not None:
        rows, ids, banned = md.bad_words   # (accumulated: a token two words ban, one now, is banned)
        logits = logits.index_put((rows, ids), torch.where(banned, float("-inf"), 0.0), accumulate=True)
    if md.allowed is not None:
        rows, keep = md.allowed
        logits = logits.index_put((rows,), logits[rows].masked_fill(~keep, float("-inf")))
    if md.all_greedy:
        tokens = logits.argmax(-1)
    else:
        temp = torch.where(md.temperature > 0, md.temperature, 1.0)
        probs = apply_top_k_top_p_min_p(logits / temp[:, None], md).softmax(-1)
        tokens = draw(probs, md.generators)
        if md.any_greedy:
            tokens = torch.where(md.temperature > 0, tokens, logits.argmax(-1))
    if md.max_num_logprobs is None:
        return SamplerOutput(tokens, None, None, None, None)
    # One log_softmax of the raw logits (measured faster on the H200 than logit - logsumexp,
    # which torch runs in several passes).
    raw_logprobs = raw.log_softmax(-1)
    token_logprobs = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    ranks = (raw_logprobs > token_logprobs[:, None]).sum(-1) + 1
    k = raw.shape[-1] if md.max_num_logprobs == -1 else md.max_num_logprobs
    topk_lp, topk_ids = raw_logprobs.topk(k, dim=-1)
    return SamplerOutput(tokens, token_logprobs, ranks, topk_ids, topk_lp)


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """Prompt logprobs: each row's target logprob and rank, and its top-k."""
    lp = logits.float().log_softmax(-1)
    target_lp = lp.gather(-1, targets[:, None]).squeeze(-1)
    ranks = (lp > target_lp[:, None]).sum(-1) + 1
    topk_lp, topk_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], targets[:, None][:, :0])
    return target_lp, ranks, topk_ids, topk_lp


def apply_grammar_bitmasks(logits: torch.Tensor, req_ids: list[str], masks: dict) -> None:
    """Set to -inf the logits of the tokens a row's grammar forbids (structured outputs; rows in
    ``req_ids`` order, rows without a mask left alone). A mask holds a bit a token, token t at
    bit t % 32 of int32 word t // 32 (llguidance's layout); columns past its bits are forbidden."""
    rows = [i for i, r in enumerate(req_ids) if r in masks]
    if not rows:
        return
    words = torch.from_numpy(np.stack([masks[req_ids[i]] for i in rows])).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
