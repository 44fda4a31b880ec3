"""Incremental detokenization: text deltas as tokens arrive, never splitting a UTF-8 character.

Byte-level BPE tokens can end in the middle of a character (Chinese, emoji). Decoding each token alone
gives U+FFFD; decoding everything each step is O(n^2). The prefix/read-offset method decodes a small
window instead: the window's first `read` ids were already emitted (their text is `prefix_text`), the
rest are pending; text past `prefix_text` is new unless it ends in U+FFFD (an unfinished character),
in which case it waits for more tokens. Decoding from a few tokens of context, not from the pending
token alone, also keeps sentencepiece's "strip the leading space" decoder from eating real spaces.

`tokenizers.decoders.DecodeStream` does the same in Rust, but cannot flush the held-back tail at the
end of a sequence and raises on some invalid byte sequences, so this is done here in a few lines.
"""
from __future__ import annotations

from typing import Iterable

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first output token, for context (as vLLM)


class IncrementalDetokenizer:
    """Feed output token ids with `push`; `output_text` is all text emitted so far.

    `spaces_between_special_tokens` only matters for HF's slow tokenizers; a `tokenizers` decode never
    inserts such spaces, so it is accepted for API compatibility and has no effect (as in vLLM).
    """

    def __init__(self, tokenizer, prompt_token_ids: Iterable[int] | None = None, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True):
        inner = getattr(tokenizer, "inner", tokenizer)  # a pagoda Tokenizer or a bare tokenizers.Tokenizer
        self._decode_ids = inner.decode
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        context = list(prompt_token_ids or ())[-_PROMPT_CONTEXT:]
        if self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends inside a character: output bytes cannot be split from it
        self._ids: list[int] = context  # the window: already-emitted context, then pending tokens
        self._read = len(context)  # where the pending (not yet emitted) tokens start
        self._prefix_text = self._decode(context)
        self.output_text = ""
        self.num_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add output tokens; return the text they complete (possibly "")."""
        new = list(token_ids)
        if not new:
            return ""
        self._ids.extend(new)
        self.num_tokens += len(new)
        text = self._decode(self._ids)
        if text == self._prefix_text:
            # The new tokens add no text (skipped special tokens): drop them, or a long run of them
            # (ignore_eos) would grow the window and make every step O(n).
            del self._ids[self._read:]
            return ""
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT):
            return ""  # a character is not finished yet: wait for its remaining bytes
        return self._emit(text[len(self._prefix_text):])

    def flush(self) -> str:
        """At the end of a sequence: emit any held-back tail, even an unfinished character (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids)
        return self._emit(text[len(self._prefix_text):])

    def _emit(self, delta: str) -> str:
        # The next window starts where this one's new tokens began; older ids are never needed again.
        del self._ids[:self._read]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self.output_text += delta
        return delta


def decoded_token(tokenizer, token_id: int) -> str:
    """One token's text for logprobs, special tokens included (a lone partial character is U+FFFD)."""
    inner = getattr(tokenizer, "inner", tokenizer)
    return inner.decode([token_id], skip_special_tokens=False)
