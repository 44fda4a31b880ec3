"""What the engine and the server both know of reasoning models (vLLM's ``reasoning_parser``):
the parsers' names and the tags around the thinking. The engine holds a structured output's
grammar back until the thinking ends (``engine/structured_output.py``); the server returns the
thinking apart from the answer (``entrypoints/openai/reasoning_parsers.py``)."""
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkingFormat:
    """The text that opens a parser's thinking and the text that ends it (any of several
    spellings each), and whether the chat template opens it, so the answer starts inside it."""
    starts: tuple[str, ...] = (THINK_START,)
    ends: tuple[str, ...] = (THINK_END,)
    opens_in_prompt: bool = False

    @property
    def tagged(self) -> bool:
        """Tags of their own (<think>, one token each in Qwen3's and R1's vocabularies), which the
        engine finds among the tokens; Granite's are sentences, found in the text only."""
        return self.starts == (THINK_START,)


REASONING_FORMATS = {
    "deepseek_r1": ThinkingFormat(opens_in_prompt=True),
    "qwen3": ThinkingFormat(),
    # IBM Granite 3.2 / 3.3 with thinking=True in chat_template_kwargs
    "granite": ThinkingFormat(("Here's my thought process:", "Here is my thought process:"),
                              ("Here's my response:", "Here is my response:")),
}
REASONING_PARSERS = tuple(REASONING_FORMATS)


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {name!r}; known: {list(REASONING_PARSERS)}.")
