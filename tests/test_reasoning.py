"""``--reasoning-parser qwen3 | deepseek_r1``: a reasoning model's thinking returned apart from
its answer (the message's ``reasoning`` and ``reasoning_content``), whole and streamed in any
pieces; tool calls read from the answer after it; none under a grammar; bad names refused."""
import json
import random

import pytest

from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser
from tests.test_tool_calls import CALLS_TEXT, TEMPLATE, _chat, _client, _names_args

THOUGHT = "<think>\nThe user wants Paris. <maybe> 2 < 3.\n</think>\n\nParis is sunny."
QWEN_THINKING_PROMPT = TEMPLATE + "<think>\n"     # a template that opens the block (Qwen3's thinking releases)


@pytest.mark.parametrize("name, prompt, text, want", [
    ("qwen3", None, THOUGHT, ("\nThe user wants Paris. <maybe> 2 < 3.\n", "\n\nParis is sunny.")),
    ("qwen3", None, "Paris is sunny.", (None, "Paris is sunny.")),               # enable_thinking=False
    ("qwen3", None, "Before</think>after", (None, "Before</think>after")),        # no block opened
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Before</think>after", ("Before", "after")),
    ("qwen3", None, "<think>cut off by max_tokens", ("cut off by max_tokens", None)),
    ("qwen3", None, "\n<think>x</think>", ("x", None)),
    ("deepseek_r1", None, "Before</think>after", ("Before", "after")),            # the prompt opened it
    ("deepseek_r1", None, THOUGHT, ("\nThe user wants Paris. <maybe> 2 < 3.\n", "\n\nParis is sunny.")),
    ("deepseek_r1", None, "still thinking", ("still thinking", None)),
])
def test_extract(name, prompt, text, want):
    assert ReasoningParser(name).extract(text, prompt) == want


@pytest.mark.parametrize("seed", range(30))
def test_streamed_in_any_pieces_gives_the_whole_answers_parts(seed):
    rng = random.Random(seed)
    name = rng.choice(["qwen3", "deepseek_r1"])
    text = rng.choice([THOUGHT, "Paris is sunny.", "Before</think>after", "<think>never closes <", "\n\n<thi"])
    prompt = rng.choice([None, "x<think>\n"])
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    want = ReasoningParser(name).extract(text, prompt)
    stream = ReasoningParser(name).stream(prompt)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        if "think>" not in (want[1] or ""):
            assert "think>" not in r + c                   # never a piece of a tag
        reasoning, content = reasoning + r, content + c
    assert (reasoning or None, content or None) == want


def _stream(client, body) -> list[dict]:
    text = client.post("/v1/chat/completions", json={**body, "stream": True}).text
    return [json.loads(line[6:])["choices"][0] for line in text.splitlines() if line.startswith("data: {")]


def test_chat_returns_the_thinking_apart(tokenizer):
    _, client = _client(tokenizer, THOUGHT, reasoning_parser="qwen3")
    body = _chat(tools=None)
    with client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        chunks = _stream(client, body)
    assert message["reasoning"] == message["reasoning_content"] == "\nThe user wants Paris. <maybe> 2 < 3.\n"
    assert message["content"] == "\n\nParis is sunny."
    deltas = [c["delta"] for c in chunks]
    assert "".join(d.get("reasoning") or "" for d in deltas) == message["reasoning"]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert deltas[0]["role"] == "assistant" and chunks[-1]["finish_reason"] == "stop"


def test_without_the_parser_the_answer_is_all_content(tokenizer):
    _, client = _client(tokenizer, THOUGHT)
    with client:
        message = client.post("/v1/chat/completions", json=_chat(tools=None)).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": THOUGHT}


def test_a_template_that_opens_the_block(tokenizer):
    """Qwen3's thinking releases end the prompt with <think>: the answer starts inside the block."""
    _, client = _client(tokenizer, "Weighing it.</think>Paris.", reasoning_parser="qwen3")
    with client:
        message = client.post("/v1/chat/completions", json=_chat(tools=None, chat_template=QWEN_THINKING_PROMPT)
                              ).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Weighing it.", "Paris.")


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_are_read_after_the_thinking(tokenizer, stream):
    """A call the model only thinks about is not made; the calls after the block are."""
    thinking = '<think>Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>? No.</think>'
    _, client = _client(tokenizer, thinking + CALLS_TEXT, enable_auto_tool_choice=True, tool_call_parser="hermes",
                        reasoning_parser="qwen3")
    with client:
        if stream:
            chunks = _stream(client, _chat())
            deltas = [c["delta"] for c in chunks]
            reasoning = "".join(d.get("reasoning") or "" for d in deltas)
            content = "".join(d.get("content") or "" for d in deltas)
            calls, finish = [tc for d in deltas for tc in d.get("tool_calls", [])], chunks[-1]["finish_reason"]
        else:
            choice = client.post("/v1/chat/completions", json=_chat()).json()["choices"][0]
            reasoning, content = choice["message"]["reasoning"], choice["message"]["content"]
            calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert reasoning == thinking[len("<think>"):-len("</think>")]
    assert content.strip() == "I will check both." and finish == "tool_calls"
    assert [name for name, _ in _names_args(calls)] == ["get_weather", "get_time"]
    assert _names_args(calls)[0][1] == {"city": "Paris"}


def test_an_answer_held_to_a_grammar_has_no_thinking(tokenizer):
    """A grammar constrains the answer from its first token (no room to think), so deepseek_r1,
    whose answers begin inside the block, does not read the JSON as thinking."""
    engine, client = _client(tokenizer, '{"city": "Paris"}', reasoning_parser="deepseek_r1")
    with client:
        message = client.post("/v1/chat/completions", json=_chat(
            tools=None, response_format={"type": "json_object"})).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"city": "Paris"}'}
    assert engine.params[0].structured_outputs is not None


def test_serve_refuses_an_unknown_reasoning_parser(capsys):
    from pagoda.entrypoints.cli import main
    assert main(["serve", "--reasoning-parser", "nope"]) == 1
    assert "Unknown reasoning parser 'nope'" in capsys.readouterr().err
