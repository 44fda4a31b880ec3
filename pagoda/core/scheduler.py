"""Continuous batching, vLLM v1 style: each step spends one token budget on the running
requests first (a decode token each, or their next prefill chunk), then admits waiting ones.
Prefill and decode tokens share the step; a prompt longer than the budget is chunked. When the
KV cache runs out, the newest running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed from its tokens later. With the "priority"
policy (vLLM's) the queue is kept in (priority, arrival) order, lowest first, and the running
request preempted is the one that comes last in that order.

At admission a request starts from the longest cached prefix of its tokens (prefix caching),
or, for the samples of one prompt (n > 1), from the KV of the sample that computed the prompt.
With LoRA, a waiting request whose adapter would make more than max_loras adapters run at once
waits (later requests of running adapters go ahead of it), so every step fits the runner's slots.

With async scheduling the engine schedules step N+1 before step N's sampled tokens reach the
host. A request that samples in step N carries one output placeholder until then: it is
scheduled as if that token were known (the runner feeds it from the device), and never past
max_tokens / max_model_len. With several steps in flight (pipeline parallelism: one a stage),
such a request waits for its token instead, and each step takes its share of the running
requests, so that the others fill the next step.

With speculative decoding (n-gram drafts, or a draft model's), a decoding request may be
scheduled with draft tokens after its last one: the step computes them all, and the runner
keeps the longest run of drafts the model itself would have sampled, plus the token it sampled
after them. The drafts it rejects are taken back from num_computed_tokens (their KV slots are
written again later). A draft model runs k tokens past the step's last one: each request's
blocks reach that far (vLLM's lookahead slots)."""
import bisect
import time
from collections import deque
from dataclasses import dataclass

from pagoda.config import LoRAConfig, SchedulerConfig, SpeculativeConfig
from pagoda.core.kv_cache_manager import KVCacheManager, PrefixHit
from pagoda.core.model_drafts import ModelDrafts
from pagoda.core.ngram_proposer import NgramProposer
from pagoda.core.request import Request, RequestStatus
from pagoda.core.sched_output import (CachedRequestData, ModelRunnerOutput, NewRequestData,
                                      SchedulerOutput)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0        # tokens of admitted requests looked up in the cache
    prefix_cache_hits: int = 0           # of which were found there
    num_forked_tokens: int = 0           # prompt tokens parallel samples took from their parent
    num_prompt_tokens_computed: int = 0  # prompt positions the model actually ran on
    num_generation_tokens: int = 0       # tokens appended to requests' outputs
    num_drafts: int = 0                  # speculative decoding: steps of a request with drafts
    num_draft_tokens: int = 0            # draft tokens checked
    num_accepted_tokens: int = 0         # of which were kept


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 speculative: SpeculativeConfig | None = None, lora: LoRAConfig | None = None):
        self.config = config
        self.kv = kv_cache_manager
        self.proposer, self.num_lookahead = None, 0
        if speculative and speculative.uses_draft_model:
            self.proposer, self.num_lookahead = ModelDrafts(speculative), speculative.num_speculative_tokens
        elif speculative:
            self.proposer = NgramProposer(speculative)
        self.draft_batch_limit = (speculative and speculative.disable_by_batch_size) or float("inf")
        self.max_loras = lora.max_loras if lora else 0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.stats = SchedulerStats()
        self.first_scheduled_time: dict[str, float] = {}

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._enqueue(request, front=False)

    def _enqueue(self, req: Request, front: bool) -> None:
        """Into the waiting queue: at its back (or front: a preempted request) first come first
        served; in (priority, arrival) order by priority."""
        if self.config.policy != "priority":
            self.waiting.appendleft(req) if front else self.waiting.append(req)
            return
        key = lambda r: (r.priority, r.arrival_time)   # noqa: E731
        self.waiting.insert(bisect.bisect_right(self.waiting, key(req), key=key), req)

    def finish_requests(self, req_ids, status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string): free all they hold."""
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def _free(self, req: Request) -> None:
        self.kv.free(req)
        if self.proposer:
            self.proposer.forget(req.request_id)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.spec_token_ids = []
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        # The runner must forget it: on resumption it is sent again as a new request.
        self.finished_req_ids.add(req.request_id)
        self._enqueue(req, front=True)

    def _victim(self) -> Request:
        """The running request to preempt: the newest, or by priority the last in its order."""
        if self.config.policy != "priority":
            return self.running.pop()
        victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
        self.running.remove(victim)
        return victim

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        scheduled: list[tuple[Request, int]] = []     # the same, for the loop at the end
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        # With several steps in flight, each takes its share of the running requests: all of
        # them in one step would leave the next with none (they would all be in flight), and the
        # stages would take turns instead of working side by side.
        share = -(-len(self.running) // self.config.max_concurrent_batches)
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < share:
            req = self.running[i]
            if req.num_output_placeholders and (self.config.max_concurrent_batches > 1
                                                or self._last_token_in_flight(req)):
                i += 1
                continue
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, budget)
            if self.proposer and n == 1 and self._drafting():
                req.spec_token_ids = self._drafts(req, budget - 1)
                n += len(req.spec_token_ids)
            new_block_ids = self.kv.allocate_slots(req, n, None, self._lookahead(req, n))
            if new_block_ids is None and req.spec_token_ids:   # drafts never preempt anyone
                req.spec_token_ids, n = [], 1
                new_block_ids = self.kv.allocate_slots(req, n, None, self._lookahead(req, n))
            while new_block_ids is None:
                victim = self._victim()
                if victim.request_id in num_scheduled:     # (priority: one scheduled already this step)
                    budget += num_scheduled.pop(victim.request_id)
                    scheduled = [(r, m) for r, m in scheduled if r is not victim]
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    i -= 1
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
                new_block_ids = self.kv.allocate_slots(req, n, None, self._lookahead(req, n))
            if new_block_ids is None:     # req itself was preempted: the next one takes its place
                continue
            cached_reqs.append(CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens))
            num_scheduled[req.request_id] = n
            scheduled.append((req, n))
            budget -= n
            i += 1

        # Admit waiting requests only if nobody had to be preempted: the cache is tight.
        skipped = []
        loras = self._running_loras()
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting.popleft()
            if req.lora_id and req.lora_id not in loras and len(loras) >= self.max_loras:
                skipped.append(req)      # max_loras adapters run already: it waits for one to end
                continue
            hit = self._prefix_hit(req)
            if hit is None:              # a parallel sample waiting for its parent's prompt
                skipped.append(req)
                continue
            n = min(req.num_tokens - hit.num_tokens, budget)
            if ((not self.config.enable_chunked_prefill and n < req.num_tokens - hit.num_tokens)
                    or self.kv.allocate_slots(req, n, hit, self._lookahead(req, n, hit.num_tokens)) is None):
                self.waiting.appendleft(req)
                break
            self._count_hit(req, hit)
            if not req.num_preemptions:
                req.num_cached_tokens = hit.num_tokens
            req.num_computed_tokens = hit.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.lora_id:
                loras.add(req.lora_id)
            self.first_scheduled_time.setdefault(req.request_id, time.time())
            new_reqs.append(NewRequestData(
                req.request_id, list(req.all_token_ids), req.num_prompt_tokens,
                self.kv.get_block_ids(req), req.num_computed_tokens, req.sampling_params, req.pooling_params,
                req.lora_request))
            num_scheduled[req.request_id] = n
            scheduled.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        out = SchedulerOutput(new_reqs, cached_reqs, num_scheduled,
                              self.config.max_num_batched_tokens - budget, self.finished_req_ids,
                              self.kv.take_pending_copies())
        self.finished_req_ids = set()
        if self.num_lookahead and self._drafting():
            out.draft_req_ids = {req.request_id for req, _ in scheduled
                                 if self._takes_drafts(req) and not self._ends_by_length(req, 1)}
        for req, n in scheduled:
            start = req.num_computed_tokens
            if start < req.num_prompt_tokens:
                self.stats.num_prompt_tokens_computed += min(start + n, req.num_prompt_tokens) - start
            req.num_computed_tokens = start + n
            if req.spec_token_ids:
                out.spec_token_ids[req.request_id] = req.spec_token_ids
                n -= len(req.spec_token_ids)
            if start + n == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1       # this step samples its next token
        return out

    def _running_loras(self) -> set[int]:
        """The LoRA adapters of the running requests. Admission keeps them to max_loras, so that
        every step, whichever running requests it takes, fits the runner's adapter slots."""
        if not self.max_loras:
            return set()
        return {r.lora_id for r in self.running if r.lora_id}

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """Draft tokens to check after a decoding request's last token, for requests whose
        sampling the runner checks them under: plain sampling (temperature, top-k / top-p /
        min-p, seeds; logprobs too, each kept token's from its own position), no per-token extras
        or grammar. Never past max_tokens or max_model_len, nor the step's token budget. (Not
        with async scheduling: the last token must be known.)"""
        if req.num_output_placeholders or not self._takes_drafts(req):
            return []
        room = min(budget, req.max_tokens - req.num_output_tokens - 1,
                   self.config.max_model_len - req.num_tokens - 1)
        return self.proposer.propose(req.request_id, req.all_token_ids, room)

    def _drafting(self) -> bool:
        """Drafts this step: fewer requests in the engine than disable_by_batch_size."""
        return len(self.running) + len(self.waiting) < self.draft_batch_limit

    @staticmethod
    def _takes_drafts(req: Request) -> bool:
        p = req.sampling_params
        return not (req.matcher is not None or req.pooling_params is not None or p.needs_penalties
                    or p.logit_bias or p.allowed_token_ids or p.bad_words_token_ids
                    or req.num_output_tokens < p.min_tokens)

    def _lookahead(self, req: Request, n: int, start: int | None = None) -> int:
        """Slots past the step's tokens for the draft model's KV (never past max_model_len)."""
        end = (req.num_computed_tokens if start is None else start) + n
        return max(0, min(self.num_lookahead, self.config.max_model_len - end))

    def _last_token_in_flight(self, req: Request) -> bool:
        """The token still on the device will end the request by length: schedule nothing more."""
        return self._ends_by_length(req, req.num_output_placeholders)

    def _ends_by_length(self, req: Request, more: int) -> bool:
        """``more`` tokens beyond those the host knows end the request (max_tokens, max_model_len);
        with more=1, the token this step samples (a draft model proposes nothing after it)."""
        n = req.num_tokens + more
        return n - req.num_prompt_tokens >= req.max_tokens or n >= self.config.max_model_len

    def _prefix_hit(self, req: Request) -> PrefixHit | None:
        """What the request can start from; None if it should wait a step."""
        parent = req.fork_parent
        if parent is None or parent.status != RequestStatus.RUNNING:
            return self.kv.get_computed_blocks(req)
        # Fork the sample computing the prompt once it has all but the prompt's last token:
        # each sample computes that one itself, into its own copy of the last block. (Blocks
        # of a step still on the device are read by later steps only: stream order.)
        fork_at = req.num_prompt_tokens - 1
        if parent.num_computed_tokens < fork_at:
            return None                  # no cache lookup while waiting: it would be redone
        cached = self.kv.get_computed_blocks(req)
        # (no fork where the parent has given back blocks of the child's window: the cache's hit)
        forked = self.kv.fork_blocks(parent, fork_at) if fork_at > cached.num_tokens else None
        return forked or cached

    def _count_hit(self, req: Request, hit: PrefixHit) -> None:
        if hit.forked:
            self.stats.num_forked_tokens += hit.num_tokens
        elif self.kv.enable_caching and not req.skip_prefix_cache:
            self.stats.prefix_cache_queries += req.num_tokens
            self.stats.prefix_cache_hits += hit.num_tokens

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Append sampled tokens and apply the token-level stop rules; end the pooling requests
        that got their vector. Returns the requests that got a new token or vector (finished ones
        included, their status set and blocks freed)."""
        updated = []
        for req_id, token in out.sampled_token_ids.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue          # it finished while this step ran (async): the token is dropped
            req.num_output_placeholders -= 1
            tokens = [token]
            if req.spec_token_ids:
                tokens = self._take_drafts(req, out.num_accepted_drafts.get(req_id, 0)) + tokens
            queue = self.running if req.status == RequestStatus.RUNNING else self.waiting  # preempted
            for t in tokens:
                req.append_output_token(t)
                self.stats.num_generation_tokens += 1
                if self._check_stop(req, t):
                    queue.remove(req)
                    self._free(req)
                    break
            else:
                if req_id in out.draft_token_ids:
                    self.proposer.receive(req_id, req.num_tokens, out.draft_token_ids[req_id])
            updated.append(req)
        for req_id in out.pooler_output:        # pooling requests: their one output, then done
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue
            req.num_output_placeholders -= 1
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = RequestStatus.FINISHED_STOPPED
            self._free(req)
            updated.append(req)
        return updated

    def _take_drafts(self, req: Request, accepted: int) -> list[int]:
        """The drafts the runner kept; the rejected ones are computed no longer."""
        drafts, req.spec_token_ids = req.spec_token_ids, []
        req.num_computed_tokens -= len(drafts) - accepted
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += len(drafts)
        self.stats.num_accepted_tokens += accepted
        return drafts[:accepted]

    def _check_stop(self, req: Request, token: int) -> bool:
        params = req.sampling_params
        num_output = req.num_tokens - req.num_prompt_tokens
        if token in req.stop_token_ids and num_output >= params.min_tokens:
            req.status = RequestStatus.FINISHED_STOPPED
            if token != req.eos_token_id or params.ignore_eos:
                req.stop_reason = token
            return True
        if num_output >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
