"""``--reasoning-parser NAME``: a reasoning model's thinking, written between ``<think>`` and
``</think>``, returned apart from its answer, in the chat message's ``reasoning`` field (and
``reasoning_content``, the field's older name, which clients still read), as vLLM does.

- ``qwen3`` (Qwen3, QwQ-style templates that let the model open the block itself): the answer is
  reasoning from a ``<think>`` that opens it (or from the start, where the prompt ends with one:
  Qwen3's "thinking" releases put it there) to ``</think>``; without either, all content
  (``enable_thinking=False`` in ``chat_template_kwargs``).
- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose template opens the block in the prompt):
  the answer is reasoning from its start to ``</think>``, a ``<think>`` the model writes anyway
  dropped.
- ``granite`` (IBM Granite 3.2 / 3.3, ``thinking=True`` in ``chat_template_kwargs``): as qwen3,
  the block opened by "Here's my thought process:" (or "Here is ...") and ended by "Here's my
  response:" (or "Here is ...").

A reasoning block that never closes (``max_tokens`` reached while thinking) is all reasoning.
The content after it is what tool-call parsing then reads. Streamed, a tag cut between two
deltas is held back until it is known.
"""
from pagoda.entrypoints.openai.tool_parsers import partial_suffix
from pagoda.reasoning import REASONING_FORMATS, ThinkingFormat, check_reasoning_parser


class ReasoningParser:
    def __init__(self, name: str):
        check_reasoning_parser(name)
        self.format = REASONING_FORMATS[name]

    def thinking_at_start(self, prompt: str | None) -> bool:
        """Whether the answer begins inside a reasoning block (the prompt opened it)."""
        return self.format.opens_in_prompt or (prompt or "").rstrip().endswith(self.format.starts)

    def extract(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """A whole answer as (reasoning, content); None for a part that is empty or absent."""
        reasoning, content = self.stream(prompt).feed(text, final=True)
        return reasoning or None, content or None

    def stream(self, prompt: str | None = None) -> "StreamingReasoning":
        return StreamingReasoning(self.format, self.thinking_at_start(prompt))


class StreamingReasoning:
    """One streamed answer's deltas as (reasoning delta, content delta)."""

    def __init__(self, fmt: ThinkingFormat, thinking: bool):
        self.format = fmt
        # "thinking" (in the block), "content" (to the end), or "open?": the answer may still
        # begin with the block's start tag
        self.state = "thinking" if thinking else "open?"
        self.fresh = True          # nothing said yet: a leading start tag is the block's own
        self.held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.held += delta
        starts, ends = self.format.starts, self.format.ends
        if self.fresh:
            text = self.held.lstrip()
            start = next((t for t in starts if text.startswith(t)), None)
            if start is not None:
                self.state, self.held = "thinking", text[len(start):]
            elif any(t.startswith(text) for t in starts) and not final:
                return "", ""           # (whitespace, or part of the tag: not known yet)
            elif self.state == "open?":
                self.state = "content"
            self.fresh = False
        reasoning = content = ""
        if self.state == "thinking":
            found = [(self.held.find(t), t) for t in ends if t in self.held]
            if found:
                at, end = min(found)
                reasoning, self.state, self.held = self.held[:at], "content", self.held[at + len(end):]
            else:
                keep = 0 if final else max(partial_suffix(self.held, t) for t in ends)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if self.state == "content":
            content, self.held = self.held, ""
        return reasoning, content
