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

A reasoning block that never closes (``max_tokens`` reached while thinking) is all reasoning.
The content after it is what tool-call parsing then reads. Streamed, a tag cut between two
deltas is held back until it is known.
"""
from pagoda.entrypoints.openai.tool_parsers import partial_suffix
from pagoda.reasoning import THINK_END as END
from pagoda.reasoning import THINK_START as START
from pagoda.reasoning import check_reasoning_parser


class ReasoningParser:
    def __init__(self, name: str):
        check_reasoning_parser(name)
        self.opens_in_prompt = name == "deepseek_r1"     # (thinking begins with the answer)

    def thinking_at_start(self, prompt: str | None) -> bool:
        """Whether the answer begins inside a reasoning block (the prompt opened it)."""
        return self.opens_in_prompt or (prompt or "").rstrip().endswith(START)

    def extract(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """A whole answer as (reasoning, content); None for a part that is empty or absent."""
        reasoning, content = self.stream(prompt).feed(text, final=True)
        return reasoning or None, content or None

    def stream(self, prompt: str | None = None) -> "StreamingReasoning":
        return StreamingReasoning(self.thinking_at_start(prompt))


class StreamingReasoning:
    """One streamed answer's deltas as (reasoning delta, content delta)."""

    def __init__(self, thinking: bool):
        # "thinking" (in the block), "content" (to the end), or "open?": the answer may still
        # begin with <think>
        self.state = "thinking" if thinking else "open?"
        self.fresh = True          # nothing said yet: a leading <think> is the block's own tag
        self.held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.held += delta
        if self.fresh:
            text = self.held.lstrip()
            if text.startswith(START):
                self.state, self.held = "thinking", text[len(START):]
            elif START.startswith(text) and not final:
                return "", ""           # (whitespace, or part of the tag: not known yet)
            elif self.state == "open?":
                self.state = "content"
            self.fresh = False
        reasoning = content = ""
        if self.state == "thinking":
            head, sep, after = self.held.partition(END)
            if sep:
                reasoning, self.state, self.held = head, "content", after
            else:
                keep = 0 if final else partial_suffix(self.held, END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        if self.state == "content":
            content, self.held = self.held, ""
        return reasoning, content
