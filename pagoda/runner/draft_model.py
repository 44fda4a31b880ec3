"""Speculative decoding with a draft model, the runner's side: a smaller model of the same
vocabulary that guesses the next k tokens of each request, which the target checks in its next
step (the scheduler schedules them as it does n-gram drafts, runner/model_runner.py keeps those
the target samples too).

The draft keeps its own KV in the target's blocks (its layers' caches are indexed by the same
block tables and slot mapping), so every token the target computes the draft computes too. Once
a step's sampled tokens are on the host, ``propose`` runs the draft over the step's tokens that
stand (a prompt's chunk; the tokens before the drafts kept) and, for each request that proposes,
the token sampled after them, whose logits give its first draft: one forward, as vLLM's draft
runner does (a step whose requests all sample nothing runs it at once: ``run_step``). Then k - 1
one-token steps follow, each on the draft the last one picked (greedily). They reach k - 1
positions past the next step's first token: the scheduler gives each request that many slots
more (vLLM's lookahead)."""
import logging
from typing import NamedTuple

import numpy as np
import torch

from pagoda.config import EngineConfig, KVCacheGroup
from pagoda.distributed.parallel_state import broadcast
from pagoda.model.loader import get_model

logger = logging.getLogger(__name__)


class DraftStep(NamedTuple):
    """A step's requests as the draft catches up on them (``DraftModel.propose``): the first
    position the step computed of each, its number of tokens, whether it sampled; and those the
    scheduler wants drafts for."""
    req_ids: list[str]
    states: list
    computed: list[int]
    q_lens: list[int]
    sampled: list[bool]
    wanted: set[str]


class DraftModel:
    def __init__(self, config: EngineConfig, device: torch.device):
        self.k = config.speculative.num_speculative_tokens
        mc = config.speculative.draft_model_config
        self.model = get_model(mc, device)
        # Its layers follow the target's one block table (EngineArgs allows a draft no other).
        self.kv_cache_groups = (KVCacheGroup(0, tuple(range(mc.arch.num_hidden_layers))),)
        self.graphs = None     # its CUDA graphs (ModelRunner._capture_graphs)
        logger.info("Draft model %s (%s, %d layers): up to %d drafts a step.", mc.model, mc.arch.architecture,
                    mc.arch.num_hidden_layers, self.k)

    @torch.inference_mode()
    def run_step(self, runner, batch: dict, t: dict[str, torch.Tensor]) -> None:
        """The draft's KV for a step in which no request sampled (its flat batch, as the target ran it)."""
        runner.run(self.model, self.graphs, batch, t)

    @torch.inference_mode()
    def propose(self, runner, step: DraftStep) -> dict[str, list[int]]:
        """The draft's KV for the step's tokens that stand, and up to k drafts for each request of
        ``step.wanted`` that sampled (its row holds its tokens up to the one sampled, ``num_tokens``),
        fewer where its blocks or max_model_len end first. Runs on every rank (the collectives
        of a sharded draft); the driver picks the tokens."""
        names, rows, computed, ends, num = [], [], [], [], []
        for r, s, start, q_len, sampled in zip(step.req_ids, step.states, step.computed, step.q_lens, step.sampled):
            if runner.requests.get(r) is not s:        # (preempted or aborted since)
                continue
            n = 0
            if sampled and r in step.wanted:
                # Draft j (from 0) follows the KV of position num_tokens - 1 + j: it needs a slot there.
                room = min(runner.num_row_blocks[s.row] * runner.block_size, runner.max_model_len)
                n = max(0, min(self.k, room - s.num_tokens + 1))
            end = start + q_len if not sampled else s.num_tokens - (n == 0)
            if end > start:
                names.append(r), rows.append(s.row), computed.append(start), ends.append(end), num.append(n)
        if not rows:
            return {}
        rows, computed, ends, num = (np.array(x, dtype=np.int64) for x in (rows, computed, ends, num))
        # The proposing requests, those with most steps first (each later step a prefix of them).
        order = np.argsort(-num, kind="stable")[:int(np.count_nonzero(num))]
        tokens = self._catch_up(runner, rows, computed, ends, order)
        if tokens is None:
            return {}
        steps, prows, known, num = [tokens], rows[order], ends[order], num[order]
        for j in range(1, int(num.max())):
            m = int((num > j).sum())
            b = runner.prepare_inputs(prows[:m], np.ones(m, dtype=np.int64), known[:m] - 1 + j)
            t = runner.upload_batch(b)
            t["input_ids"] = tokens[:m]
            tokens = self._greedy(runner, runner.run(self.model, self.graphs, b, t))
            steps.append(tokens)
        if runner.rank != 0:
            return {}
        drafts = torch.full((len(prows), len(steps)), -1, dtype=torch.long, device=tokens.device)
        for j, x in enumerate(steps):
            drafts[:len(x), j] = x
        return {names[i]: d[:n] for i, d, n in zip(order.tolist(), drafts.tolist(), num.tolist())}

    def _catch_up(self, runner, rows, computed, ends, proposing) -> torch.Tensor | None:
        """One forward of the draft over positions [computed, end) of each row (decodes first,
        as the backends take a batch); the greedy tokens after the last position of the rows
        ``proposing`` picks (indices into rows), in that order."""
        q_lens = ends - computed
        order = np.argsort(q_lens != 1, kind="stable")
        place = np.empty(len(order), dtype=np.int64)
        place[order] = np.arange(len(order))
        last = np.cumsum(q_lens[order]) - 1
        b = runner.prepare_inputs(rows[order], q_lens[order], computed[order])
        t = runner.upload_batch(b, logits_idx=last[place[proposing]])      # (one copy for both)
        hidden = runner.run(self.model, self.graphs, b, t)
        return self._greedy(runner, hidden[t["logits_idx"]]) if len(proposing) else None

    def _greedy(self, runner, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's most likely tokens, on every rank (with tensor parallelism the logits are
        the driver's: it sends the tokens to the others, which feed them to the next step)."""
        logits = self.model.compute_logits(hidden)
        if runner.single_rank:
            return logits.argmax(-1)
        tokens = logits.argmax(-1) if logits is not None else \
            torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return broadcast(tokens, src=runner.driver)
