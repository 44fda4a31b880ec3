"""Speculative decoding with a draft model, the runner's side: a smaller model of the same
vocabulary that guesses the next k tokens of each request, which the target checks in its next
step (the scheduler schedules them as it does n-gram drafts, runner/model_runner.py keeps those
the target samples too).

The draft keeps its own KV in the target's blocks (its layers' caches are indexed by the same
block tables and slot mapping), so every token the target computes the draft computes too: right
after the target's forward it runs over the step's tokens, drafts included (those rejected are
written over later, as the target's are). Once the step's tokens are on the host, ``propose``
runs k one-token steps per request: the token sampled after the kept drafts first, then each
draft it picks (greedily). Those reach k - 1 positions past the next step's first token: the
scheduler gives each request that many slots more (vLLM's lookahead)."""
import logging

import numpy as np
import torch

from pagoda.config import EngineConfig, KVCacheGroup
from pagoda.distributed.parallel_state import broadcast
from pagoda.model.loader import get_model

logger = logging.getLogger(__name__)


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
        """The draft's KV for the target's step (its flat batch, as the target ran it)."""
        runner.run(self.model, self.graphs, batch, t)

    @torch.inference_mode()
    def propose(self, runner, requests: list[tuple[str, object]]) -> dict[str, list[int]]:
        """Up to k drafts for each request (id, state) that has just sampled (its row holds its
        tokens up to the one sampled, ``num_tokens``), fewer where its blocks or max_model_len
        end first. Runs on every rank (the collectives of a sharded draft); the driver picks
        the tokens."""
        live = [(r, s) for r, s in requests if runner.requests.get(r) is s]
        if not live:
            return {}
        rows = np.array([s.row for _, s in live], dtype=np.int64)
        known = np.array([s.num_tokens for _, s in live], dtype=np.int64)
        # Step j (from 0) writes the KV of position known - 1 + j: it needs a slot there.
        end = np.minimum(runner.num_row_blocks[rows] * runner.block_size, runner.max_model_len)
        num = np.clip(end - known + 1, 0, self.k)
        order = np.argsort(-num, kind="stable")     # those with most steps first: each step a prefix
        rows, known, num = rows[order], known[order], num[order]
        steps, tokens = [], None
        for j in range(int(num.max())):
            m = int((num > j).sum())
            b = runner.prepare_inputs(rows[:m], np.ones(m, dtype=np.int64), known[:m] - 1 + j)
            t = runner.upload_batch(b)
            if tokens is not None:
                t["input_ids"] = tokens[:m]
            tokens = self._greedy(runner, runner.run(self.model, self.graphs, b, t))
            steps.append(tokens)
        if not steps or runner.rank != 0:
            return {}
        drafts = torch.full((len(rows), len(steps)), -1, dtype=torch.long, device=tokens.device)
        for j, x in enumerate(steps):
            drafts[:len(x), j] = x
        drafts = drafts.tolist()
        return {live[i][0]: drafts[n][:num[n]] for n, i in enumerate(order.tolist()) if num[n]}

    def _greedy(self, runner, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's most likely tokens, on every rank (with tensor parallelism the logits are
        the driver's: it sends the tokens to the others, which feed them to the next step)."""
        logits = self.model.compute_logits(hidden)
        if runner.single_rank:
            return logits.argmax(-1)
        tokens = logits.argmax(-1) if logits is not None else \
            torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return broadcast(tokens, src=runner.driver)
