"""``--reasoning-parser qwen3 | deepseek_r1 | granite``: a reasoning model's thinking returned apart from
its answer (the message's ``reasoning`` and ``reasoning_content``), whole and streamed in any
pieces; tool calls read from the answer after it; a grammar holding only the answer after it
(the engine's part on the real SmolLM2); bad names refused."""
import json
import random
import re

import pytest

from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser
from tests.test_tool_calls import CALLS_TEXT, TEMPLATE, _chat, _client, _names_args

THOUGHT = "<think>\nThe user wants Paris. <maybe> 2 < 3.\n</think>\n\nParis is sunny."
QWEN_THINKING_PROMPT = TEMPLATE + "<think>\n"
GRANITE_THOUGHT = "Here's my thought process:\nThe user wants Paris.\nHere's my response:\nParis is sunny."     # a template that opens the block (Qwen3's thinking releases)


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
    ("granite", None, GRANITE_THOUGHT, ("\nThe user wants Paris.\n", "\nParis is sunny.")),
    ("granite", None, "Here is my thought process: a. Here is my response: b.", (" a. ", " b.")),
    ("granite", None, "Paris is sunny.", (None, "Paris is sunny.")),            # thinking off
    ("granite", None, "Here's my thought process: cut off", (" cut off", None)),
    ("granite", None, "<think>x</think>y", (None, "<think>x</think>y")),         # not its tags
])
def test_extract(name, prompt, text, want):
    assert ReasoningParser(name).extract(text, prompt) == want


@pytest.mark.parametrize("seed", range(30))
def test_streamed_in_any_pieces_gives_the_whole_answers_parts(seed):
    rng = random.Random(seed)
    name = rng.choice(["qwen3", "deepseek_r1", "granite"])
    text = rng.choice([THOUGHT, "Paris is sunny.", "Before</think>after", "<think>never closes <", "\n\n<thi"]
                      if name != "granite" else [GRANITE_THOUGHT, "Paris is sunny.", "Here is my thought process: x Here",
                                                 "\n Here's my thou"])
    prompt = rng.choice([None, "x<think>\n"])
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    want = ReasoningParser(name).extract(text, prompt)
    stream = ReasoningParser(name).stream(prompt)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        if "think>" not in (want[1] or "") and "my thou" not in (want[1] or ""):
            assert "think>" not in r + c and "my thou" not in r + c and "my resp" not in r + c   # never a piece of a tag
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


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_held_to_a_grammar_thinks_first(tokenizer, stream):
    """The grammar holds the answer after the thinking (the engine's part, below): the JSON is
    the content, and a forced call's arguments are read from it."""
    answer = 'The user wants JSON.</think>\n{"city": "Paris"}'
    engine, client = _client(tokenizer, answer, reasoning_parser="deepseek_r1")
    with client:
        message = client.post("/v1/chat/completions", json=_chat(
            tools=None, response_format={"type": "json_object"})).json()["choices"][0]["message"]
        forced = _chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
        if stream:
            deltas = [c["delta"] for c in _stream(client, forced)]
            arguments = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
            reasoning = "".join(d.get("reasoning") or "" for d in deltas)
        else:
            called = client.post("/v1/chat/completions", json=forced).json()["choices"][0]["message"]
            arguments, reasoning = called["tool_calls"][0]["function"]["arguments"], called["reasoning"]
    assert (message["reasoning"], message["content"]) == ("The user wants JSON.", '\n{"city": "Paris"}')
    assert engine.params[0].structured_outputs is not None
    assert json.loads(arguments) == {"city": "Paris"} and reasoning == "The user wants JSON."


def test_thinking_end_by_the_prompt(smollm_path):
    """The engine's grammar waits for </think> unless the prompt closed the block (thinking off)."""
    from pagoda.engine.structured_output import StructuredOutputs
    from pagoda.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm_path)
    think = StructuredOutputs(tok, tok.vocab_size, [2], reasoning=True)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    ids = lambda text: tok.encode(text, add_special_tokens=False)   # noqa: E731
    assert think.thinking_end(ids("<|im_start|>assistant\n")) == end              # the model opens it
    assert think.thinking_end(ids("<|im_start|>assistant\n<think>\n")) == end    # the prompt opened it
    assert think.thinking_end(ids("assistant\n<think>\n\n</think>\n\n")) is None    # thinking off
    assert think.thinking_end(ids("<think>a</think>\n\nuser\n<think>\n")) == end     # the last tag counts
    assert StructuredOutputs(tok, tok.vocab_size, [2]).thinking_end(ids("<think>\n")) is None


def test_the_grammar_holds_the_answer_after_the_thinking(smollm_path, monkeypatch):
    """SmolLM2 (no thinking tags of its own), its third greedy token standing for </think>: the
    tokens up to it come unconstrained, as without a grammar, and then the grammar's answer."""
    from pagoda import LLM, SamplingParams, StructuredOutputsParams
    from pagoda.engine.structured_output import StructuredOutputs
    from tests.conftest import TEST_KV_BYTES
    llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512,
              reasoning_parser="qwen3")
    prompt = "The year the first man walked on the moon was"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    marker = (free[2],)
    assert marker[0] not in free[:2]
    monkeypatch.setattr(StructuredOutputs, "thinking_end", lambda self, ids: marker)
    held = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    out = llm.generate(prompt, held, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == free
    answer = llm.get_tokenizer().decode(out.token_ids[3:])
    assert re.fullmatch("[0-9]{4}", answer) and out.finish_reason == "stop"
    monkeypatch.setattr(StructuredOutputs, "thinking_end", lambda self, ids: None)   # no thinking: held throughout
    assert re.fullmatch("[0-9]{4}", llm.generate(prompt, held, use_tqdm=False)[0].outputs[0].text)
    del llm


def test_granite_thinking_and_a_grammar_refused(smollm_path):
    """Granite's thinking ends at a sentence, not a token: a structured output with the granite
    parser is a ValueError naming it (vLLM has none either), and the engine runs on."""
    from pagoda import LLM, SamplingParams, StructuredOutputsParams
    from tests.conftest import TEST_KV_BYTES
    llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512,
              reasoning_parser="granite")
    held = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]{4}"))
    with pytest.raises(ValueError, match="Structured outputs do not run with the 'granite' reasoning parser"):
        llm.generate("The year", held, use_tqdm=False)
    assert len(llm.generate("The year", SamplingParams(max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert not llm.llm_engine.has_unfinished_requests()
    del llm


def test_serve_refuses_an_unknown_reasoning_parser(capsys):
    from pagoda.entrypoints.cli import main
    assert main(["serve", "--reasoning-parser", "nope"]) == 1
    assert "Unknown reasoning parser 'nope'" in capsys.readouterr().err
