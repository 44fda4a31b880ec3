"""What the engine and the server both know of reasoning models (vLLM's ``reasoning_parser``):
the parsers' names and the tags around the thinking. The engine holds a structured output's
grammar back until the thinking ends (``engine/structured_output.py``); the server returns the
thinking apart from the answer (``entrypoints/openai/reasoning_parsers.py``)."""

REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK_START, THINK_END = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {name!r}; known: {list(REASONING_PARSERS)}.")
