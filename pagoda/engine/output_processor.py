"""Turns the scheduler's new tokens into RequestOutputs: incremental detokenization, stop
strings, logprobs, and the gathering of n parallel samples into one output."""
import time

from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.detokenizer import IncrementalDetokenizer
from pagoda.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput
from pagoda.sampling_params import RequestOutputKind, SamplingParams


class RequestState:
    """One sequence (one of a parent's n samples)."""

    def __init__(self, req: Request, parent: "ParentState", index: int, tokenizer):
        self.req = req
        self.parent = parent
        self.index = index
        p = req.sampling_params
        self.detok = (IncrementalDetokenizer(tokenizer, req.prompt_token_ids, p.skip_special_tokens,
                                             p.spaces_between_special_tokens)
                      if p.detokenize and tokenizer is not None else None)
        self.text = ""
        self.sent_tokens = 0
        self.sent_text = 0
        self.token_ids: list[int] = []
        self.logprobs = [] if p.logprobs is not None else None
        # As in vLLM, only requests that ask for logprobs get one (the sampler skips the rest).
        self.cumulative_logprob = 0.0 if p.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.max_stop_len = max((len(s) for s in p.stop), default=0)

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        delta = kind == RequestOutputKind.DELTA
        text = self.text[self.sent_text:] if delta else self.text
        tokens = self.token_ids[self.sent_tokens:] if delta else list(self.token_ids)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self.logprobs[self.sent_tokens:] if delta else list(self.logprobs)
        self.sent_text, self.sent_tokens = len(self.text), len(self.token_ids)
        return CompletionOutput(self.index, text, tokens, self.cumulative_logprob, logprobs,
                                self.finish_reason, self.stop_reason)


class ParentState:
    """A user request: its prompt and its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.children: list[RequestState] = []
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None else None
        self.metrics = RequestMetrics(arrival_time=arrival_time)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)

    def output(self) -> RequestOutput:
        kind = self.params.output_kind
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.prompt_logprobs,
                             [c.completion(kind) for c in self.children], self.finished, self.metrics,
                             num_cached_tokens=self.children[0].req.num_cached_tokens,
                             lora_request=self.children[0].req.lora_request)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}       # child request id -> state
        self.parents: dict[str, ParentState] = {}
        # Each request's time from its last token to the one it got now, a step at a time, for
        # the server's inter-token latency metric (vLLM's, over every request): taken by it.
        self.inter_token_latencies: list[float] = []

    def add(self, parent: ParentState, children: list[Request]) -> None:
        self.parents[parent.request_id] = parent
        for i, req in enumerate(children):
            state = RequestState(req, parent, i, self.tokenizer)
            parent.children.append(state)
            self.states[req.request_id] = state

    def remove(self, parent_id: str) -> list[str]:
        """Forget a user request; returns its child ids for the scheduler."""
        parent = self.parents.pop(parent_id, None)
        if parent is None:
            return []
        for c in parent.children:
            self.states.pop(c.req.request_id, None)
        return [c.req.request_id for c in parent.children]

    def process(self, updated: list[Request], runner_out: ModelRunnerOutput) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand out and the child ids stopped by a stop string (the
        scheduler must free them)."""
        now = time.time()
        outputs: list = []
        touched: dict[str, ParentState] = {}
        ended: set[str] = set()          # parents with a sequence that ended this step
        stopped: list[str] = []
        for req_id, first, *rest in ((k, *v) for k, v in runner_out.prompt_logprobs.items()):
            state = self.states.get(req_id)
            if state is not None:
                self._add_prompt_logprobs(state.parent, first, *rest)
        for req in updated:
            state = self.states.get(req.request_id)
            if state is None:
                continue
            if req.pooling_params is not None:
                self.remove(state.parent.request_id)
                outputs.append(PoolingRequestOutput(state.parent.request_id,
                                                    PoolingOutput(runner_out.pooler_output[req.request_id]),
                                                    state.parent.prompt_token_ids, True, req.num_cached_tokens))
                continue
            # One token a step, or with speculative decoding the drafts kept and one more.
            num_tokens = len(state.token_ids)
            tokens = req.all_token_ids[req.num_prompt_tokens + num_tokens:]
            finished = req.is_finished
            if finished:
                state.finish_reason, state.stop_reason = req.status.finish_reason, req.stop_reason
            if self._append(state, tokens, finished):
                stopped.append(req.request_id)
                finished = True
            if state.logprobs is not None:       # (those of the tokens kept: not past a stop)
                for ids, lps, rank in runner_out.logprobs[req.request_id][:len(state.token_ids) - num_tokens]:
                    state.cumulative_logprob += lps[0]
                    state.logprobs.append(self._logprob_dict(ids, lps, rank))
            parent = state.parent
            m = parent.metrics
            if m.last_token_time is not None and parent.request_id not in touched:
                self.inter_token_latencies.append(now - m.last_token_time)
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
            touched[parent.request_id] = parent
            if finished:
                ended.add(parent.request_id)
        for parent_id, parent in touched.items():
            if parent_id in ended and parent.finished:
                parent.metrics.finished_time = now
                self.remove(parent.request_id)
                outputs.append(parent.output())
            elif parent.params.output_kind != RequestOutputKind.FINAL_ONLY:
                outputs.append(parent.output())
        return outputs, stopped

    def _append(self, state: RequestState, tokens: list[int], finished: bool) -> bool:
        """The step's new tokens into the output, and their text, a token at a time: with
        speculative decoding a step brings several, and those after a stop string are dropped.
        True when a stop string ended the sequence."""
        if state.detok is None:
            state.token_ids += tokens
            return False
        for i, token in enumerate(tokens):
            state.token_ids.append(token)
            delta = state.detok.push([token])
            if finished and i == len(tokens) - 1:      # nothing follows: emit any held-back bytes too
                delta += state.detok.flush()
            state.text += delta
            if delta and state.max_stop_len and self._check_stop_strings(state, len(delta)):
                return True
        return False

    def _check_stop_strings(self, state: RequestState, delta_len: int) -> bool:
        params = state.req.sampling_params
        # Only text that the new delta could have completed needs searching.
        start = max(0, len(state.text) - delta_len - state.max_stop_len + 1)
        hits = [(state.text.find(s, start), s) for s in params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        i, s = min(hits)
        state.text = state.text[:i + len(s)] if params.include_stop_str_in_output else state.text[:i]
        state.finish_reason, state.stop_reason = "stop", s
        return True

    def _logprob_dict(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        # ids[0] is the sampled token (with its true rank); then the top-k in rank order.
        d = {ids[0]: Logprob(lps[0], rank, self._decode(ids[0]))}
        for r, (t, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
            d.setdefault(t, Logprob(lp, r, self._decode(t)))
        return d

    def _decode(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else None

    def _add_prompt_logprobs(self, parent: ParentState, first: int, targets, lps, ranks, topk_ids, topk_lps):
        plp = parent.prompt_logprobs
        if plp is None or len(plp) != first:   # already have these (a recompute after preemption)
            return
        for t, lp, r, ids, tlps in zip(targets, lps, ranks, topk_ids, topk_lps):
            plp.append(self._logprob_dict([t] + ids, [lp] + tlps, r))
