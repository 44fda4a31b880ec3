"""Structured outputs, as vLLM's: an answer held to a JSON schema, any JSON object, a regex, one
of several strings or a Lark grammar (``SamplingParams(structured_outputs=...)``; the server's
``response_format``). llguidance compiles the constraint into a matcher for each sequence. Each
step the engine asks the matchers of the scheduled sequences which tokens may come next (a bit
a token) and the runner masks those rows' logits before sampling (``sampler.apply_grammar_bitmasks``);
each sampled token then advances its matcher, and a matcher that has completed its grammar ends
the sequence ("stop"). The masks need the last step's tokens, so while such sequences run the
engine does not queue a step before the last one's tokens are back (no async overlap).

A reasoning model (``reasoning_parser``) thinks first: its grammar then holds the answer after the
``</think>`` that ends the thinking, unmasked until then (``Request.thinking_end``), unless the
prompt closed the block already (a chat template with thinking off)."""
import json
import re

import numpy as np

from pagoda.reasoning import THINK_END, THINK_START
from pagoda.sampling_params import StructuredOutputsParams


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need llguidance: pip install 'pagoda-llm[structured]'") from None
    return llguidance


def grammar_of(p: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar."""
    matcher = _llguidance().LLMatcher
    if p.json is not None or p.json_object:
        schema = p.json if p.json is not None else {"type": "object"}
        compact = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return matcher.grammar_from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                                defaults=compact if p.disable_any_whitespace else None)
    if p.regex is not None:
        return matcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        return matcher.grammar_from_regex("|".join(re.escape(c) for c in p.choice))
    return matcher.grammar_from_lark(p.grammar)


class StructuredOutputs:
    """The engine's side: matchers for new sequences, the step's masks, the sampled tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], reasoning: bool = False):
        llg = _llguidance()
        if tokenizer is None:
            raise ValueError("structured outputs need the tokenizer (skip_tokenizer_init=True was set).")
        self.tokenizer = llg.LLTokenizer(tokenizer.inner.to_str(), n_vocab=vocab_size,
                                         eos_token=eos_token_ids or None)
        self.words = (vocab_size + 31) // 32
        self.executor = llg.LLExecutor()
        # (the thinking block's tags as token ids: one added token each in Qwen3's and R1's vocabularies)
        self.think_tags = tuple(tuple(tokenizer.encode(t, add_special_tokens=False)) for t in (THINK_START, THINK_END)) \
            if reasoning else None

    def thinking_end(self, prompt_token_ids: list[int]) -> tuple[int, ...] | None:
        """The tokens a reasoning model's answer thinks up to before its grammar applies, or None:
        not a reasoning model, or the prompt closed the block already."""
        if self.think_tags is None:
            return None
        start, end = self.think_tags
        return None if _last(prompt_token_ids, end) > _last(prompt_token_ids, start) else end

    def compile(self, params: StructuredOutputsParams) -> str:
        """The request's grammar; a bad schema, regex or grammar raises ValueError naming it."""
        try:
            grammar = grammar_of(params)
        except Exception as e:        # noqa: BLE001 - llguidance's own errors: the user's input
            raise ValueError(f"Invalid structured_outputs: {e}") from None
        error = _llguidance().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"Invalid structured_outputs: {error.strip()}")
        return grammar

    def matcher(self, grammar: str):
        return _llguidance().LLMatcher(self.tokenizer, grammar, log_level=0)

    def bitmasks(self, req_ids, requests: dict) -> dict[str, np.ndarray]:
        """The allowed next tokens of each scheduled sequence that has a matcher, computed side by
        side on llguidance's threads (64 JSON-string masks of SmolLM2: 0.23-0.31 ms against
        0.57-0.65 one after another on the 2-core development machine)."""
        ids = [r for r in req_ids if r in requests and requests[r].matcher is not None
               and requests[r].thinking_end is None]
        if not ids:
            return {}
        out = np.empty((len(ids), self.words), dtype=np.int32)
        self.executor.unsafe_compute_mask_ptr([(requests[r].matcher, i) for i, r in enumerate(ids)],
                                              out.ctypes.data, self.words * 4, len(ids))
        return dict(zip(ids, out))

    @staticmethod
    def accept(updated) -> list[str]:
        """Advance the matchers of the sequences that got a token; returns the ids of those whose
        grammar is now complete (and that no other rule ended)."""
        done = []
        for req in updated:
            m = req.matcher
            if m is None or req.is_finished:
                continue
            if req.thinking_end is not None:   # the grammar starts after the thinking's last tag
                end = req.thinking_end
                if req.num_output_tokens >= len(end) and tuple(req.all_token_ids[-len(end):]) == end:
                    req.thinking_end = None
                continue
            m.consume_token(req.all_token_ids[-1])
            if m.is_stopped():
                done.append(req.request_id)
        return done


def _last(seq: list[int], sub: tuple[int, ...]) -> int:
    """Where ``sub`` last begins in ``seq`` (-1: nowhere)."""
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i] == sub[0] and tuple(seq[i:i + len(sub)]) == sub:
            return i
    return -1
