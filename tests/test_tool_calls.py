"""Tool calling in the chat route (``--enable-auto-tool-choice --tool-call-parser hermes``):
the parser on whole and streamed answers, tools rendered into the prompt, OpenAI's tool_calls
in responses and stream chunks; forced choices ("required", a named function) as a JSON schema
the answer is held to; the requests pagoda refuses."""
import json
import random
from unittest.mock import ANY

import pytest
from fastapi.testclient import TestClient

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.entrypoints.openai.tool_parsers import (ForcedCallStream, GraniteToolParser, HermesToolParser,
                                                    Llama3JsonToolParser, MistralToolParser, Phi4MiniJsonToolParser,
                                                    PythonicToolParser, StreamingToolCalls, get_tool_parser)
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import RequestOutputKind
from tests.stub_engine import StubEngine

CALLS_TEXT = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}\n</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# A template that shows what it was given: the tools' names, and a call's argument.
TEMPLATE = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
            "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} city={{ c.function.arguments.city }}]"
            "{% endfor %}{% endfor %}<assistant>")


def _names_args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _summed(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas summed by index, as a client sums them: the first of a call has
    its id, type and name, each of them a piece of its arguments."""
    calls: dict[int, dict] = {}
    for d in deltas:
        if d["index"] not in calls:
            assert d["id"] and d["type"] == "function" and d["function"]["name"]
            calls[d["index"]] = {"function": {"name": d["function"]["name"], "arguments": ""}}
        calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return [calls[i] for i in sorted(calls)]


def test_hermes_extract():
    p = HermesToolParser()
    content, calls = p.extract(CALLS_TEXT)
    assert content == "I will check both."
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "fmt": "24h"})]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert p.extract("No tools needed.") == ("No tools needed.", [])
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert p.extract(bad) == (bad, [])                               # not a call: the text stays
    content, calls = p.extract('<tool_call>{"name": "f", "arguments": {}}')   # cut off by max_tokens
    assert content is None and _names_args(calls) == [("f", {})]


@pytest.mark.parametrize("seed", range(20))
def test_streamed_answer_gives_the_whole_answers_calls(seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(CALLS_TEXT)), rng.randint(1, 40)))
    pieces = [CALLS_TEXT[a:b] for a, b in zip([0] + cuts, cuts + [len(CALLS_TEXT)])]
    stream = StreamingToolCalls(HermesToolParser())
    content, calls = "", []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        assert "<" not in text                                       # never a piece of a tag
        content += text
        calls += new
    assert content.strip() == "I will check both."
    assert _names_args(calls) == _names_args(HermesToolParser().extract(CALLS_TEXT)[1])
    assert stream.num_calls == 2


def test_streamed_plain_answer_is_sent_whole():
    stream = StreamingToolCalls(HermesToolParser())
    got = [stream.feed(p) for p in ("a < b", " and <", "tool", " x")] + [stream.feed("", final=True)]
    assert "".join(t for t, _ in got) == "a < b and <tool x" and not any(c for _, c in got)
    assert got[1][0] == " and "                                      # "<" held until it could not be a tag


LLAMA3_CALLS = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}')


def test_llama3_json_extract():
    p = Llama3JsonToolParser()
    content, calls = p.extract(LLAMA3_CALLS)
    assert content is None
    assert _names_args(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "fmt": "24h"})]
    assert _names_args(p.extract(' {"name": "f", "parameters": {}}\n')[1]) == [("f", {})]     # no tag
    for text in ("No tools needed.", '{"name": "f", "parameters": {}} and then text', '{"city": "Paris"}',
                 '{"name": "f", "parameters": {', ""):
        assert p.extract(text) == (text, [])                        # not (only) calls: the text stays


def test_granite_and_phi4_mini_json_extract():
    """Granite 3's list of calls (after <|tool_call|>, <tool_call> or none) and Phi-4-mini's
    (after functools, which it needs); anything else stays text."""
    listed = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
             '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}]'
    for parser, tags in ((GraniteToolParser(), ("<|tool_call|>", "<tool_call>", "")), (Phi4MiniJsonToolParser(),
                                                                                      ("functools",))):
        for tag in tags:
            content, calls = parser.extract(f" {tag}{listed}\n")
            assert content is None and _names_args(calls) == WEATHER_AND_TIME
        for text in ("No tools needed.", listed + " and then text", '[{"city": "Paris"}]', "[]", "functools",
                     '{"name": "f", "arguments": {}}', "<tool_call>[{"):
            assert parser.extract(text) == (text, [])
    assert Phi4MiniJsonToolParser().extract(listed) == (listed, [])        # (its tag is not optional)
    stream = Phi4MiniJsonToolParser().stream()
    assert stream.feed("func") == ("", []) and stream.feed("tools[") == ("", [])     # held: it may be calls
    assert _names_args(stream.feed(listed[1:], final=True)[1]) == WEATHER_AND_TIME
    stream = GraniteToolParser().stream()
    assert stream.feed("The answer") == ("The answer", [])


@pytest.mark.parametrize("seed", range(10))
def test_llama3_json_streamed_in_pieces(seed):
    """Held while it may be calls, then parsed whole; a plain answer passes as it comes."""
    rng = random.Random(seed)
    for answer, plain in ((LLAMA3_CALLS, False), ("The weather is {sunny}.", True), ("  {not json}", False)):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, min(12, len(answer) - 1))))
        pieces = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
        stream, content, calls = Llama3JsonToolParser().stream(), "", []
        for i, piece in enumerate(pieces):
            text, new = stream.feed(piece, final=i == len(pieces) - 1)
            if not plain and i < len(pieces) - 1:
                assert text == "" and new == []                     # held: it may be calls
            content += text
            calls += new
        expected = Llama3JsonToolParser().extract(answer)
        assert (content or None, _names_args(calls)) == (expected[0], _names_args(expected[1]))
        assert stream.num_calls == len(expected[1])
    stream = Llama3JsonToolParser().stream()
    assert stream.feed("Hi") == ("Hi", []) and stream.feed(" {x") == (" {x", [])    # sent at once


WEATHER_AND_TIME = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris", "fmt": "24h"})]
MISTRAL_CALLS = ('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}]')
MISTRAL_V11_CALLS = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris", "fmt": "24h"}'
PYTHONIC_CALLS = '[get_weather(city="Paris"), get_time(tz="Europe/Paris", fmt="24h")]'
GRANITE_CALLS = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                 '{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "24h"}}]')
PHI4_MINI_CALLS = GRANITE_CALLS.replace("<tool_call>", "functools")
INTERNLM_CALLS = ('<|action_start|><|plugin|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>\n'
                  '<|action_start|><|plugin|>\n{"name": "get_time", "parameters": {"tz": "Europe/Paris", "fmt": "24h"}}'
                  '<|action_end|>')
QWEN3_CODER_CALLS = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                     "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nEurope/Paris\n</parameter>\n"
                     "<parameter=fmt>\n24h\n</parameter>\n</function>\n</tool_call>")


def test_mistral_extract():
    """Both of Mistral's formats; the text before [TOOL_CALLS] is content; what is not calls stays."""
    p = MistralToolParser()
    assert (p.extract(MISTRAL_CALLS)[0], _names_args(p.extract(MISTRAL_CALLS)[1])) == ("Checking.", WEATHER_AND_TIME)
    assert (p.extract(MISTRAL_V11_CALLS)[0], _names_args(p.extract(MISTRAL_V11_CALLS)[1])) == (None, WEATHER_AND_TIME)
    assert _names_args(p.extract('[TOOL_CALLS]{"name": "f", "arguments": {}}')[1]) == [("f", {})]
    for text in ("No tools.", "[TOOL_CALLS][{not json}]", '[TOOL_CALLS][{"city": "Paris"}]', "[TOOL_CALLS]f[ARGS]{",
                 "[TOOL_CALLS]f{}", "[TOOL_CALLS][]"):
        assert p.extract(text) == (text, [])


def test_pythonic_extract():
    """A Python list of calls with literal keyword arguments (JSON's true / null from Python's),
    in Llama 4's tags or not; anything else stays text."""
    p = PythonicToolParser()
    assert p.extract(PYTHONIC_CALLS)[0] is None and _names_args(p.extract(PYTHONIC_CALLS)[1]) == WEATHER_AND_TIME
    content, calls = p.extract('<|python_start|>[search(q="x", n=3, exact=True, lang=None, tags=["a", 1.5])]<|python_end|>')
    assert content is None and _names_args(calls) == [("search", {"q": "x", "n": 3, "exact": True, "lang": None,
                                                                  "tags": ["a", 1.5]})]
    for text in ("No tools.", "[f(x)]", "[f(x=y)]", "[f(**kw)]", "[1, 2]", "[]", "get_weather(city='Paris')", "[f(x=1"):
        assert p.extract(text) == (text, [])


def test_qwen3_coder_extract():
    """Qwen3-Coder's tags: each value typed by the request's schema (integer, number, boolean,
    null, object, array; a string stays text, digits and all, inner lines kept), a parameter the
    schema does not know and every value without tools stay text; a block that is not a function
    leaves the message text."""
    p = get_tool_parser("qwen3_coder")
    assert p.extract(QWEN3_CODER_CALLS)[0] is None and _names_args(p.extract(QWEN3_CODER_CALLS)[1]) == WEATHER_AND_TIME
    props = {"zip": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
             "metric": {"type": "boolean"}, "opts": {"type": "object"}, "ids": {"type": "array"},
             "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": props}}}]
    values = {"zip": "07001", "days": "3", "temp": "21.5", "metric": "True", "opts": '{"a": [1, "b"]}',
              "ids": "[1, 'two']", "note": "two\nlines", "limit": "null", "extra": "42"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"Searching.\n<tool_call>\n<function=search>\n{body}</function>\n</tool_call>"
    content, calls = p.extract(text, tools)
    assert content == "Searching." and _names_args(calls) == [("search", {
        "zip": "07001", "days": 3, "temp": 21.5, "metric": True, "opts": {"a": [1, "b"]}, "ids": [1, "two"],
        "note": "two\nlines", "limit": None, "extra": "42"})]
    assert _names_args(p.extract(text)[1]) == [("search", values)]
    bad = {"days": "three", "metric": "yes", "opts": "{not json"}      # (kept as the text they are)
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in bad.items())
    assert _names_args(p.extract(f"<tool_call>\n<function=search>\n{body}</function>\n</tool_call>", tools)[1]) == [
        ("search", bad)]
    for text in ("No tools.", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<tool_call>\nplain\n</tool_call>"):
        assert p.extract(text) == (text, [])


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name, answer, want_content", [("mistral", MISTRAL_CALLS, "Checking."),
                                                        ("mistral", MISTRAL_V11_CALLS, ""),
                                                        ("mistral", "Plain [text] here.", "Plain [text] here."),
                                                        ("pythonic", PYTHONIC_CALLS, ""),
                                                        ("pythonic", "Plain (text).", "Plain (text)."),
                                                        ("qwen3_coder", "Let me see. " + QWEN3_CODER_CALLS,
                                                         "Let me see."),
                                                        ("internlm", "Checking. " + INTERNLM_CALLS, "Checking."),
                                                        ("internlm", "A <|action_start|> alone.",
                                                         "A <|action_start|> alone.")])
def test_mistral_and_pythonic_streamed_in_pieces(seed, name, answer, want_content):
    """Streamed in random pieces, an answer gives its whole extraction: the content, never a
    piece of a tag or of a call, then the calls."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(1, min(12, len(answer) - 1))))
    pieces = [answer[a:b] for a, b in zip([0] + cuts, cuts + [len(answer)])]
    stream, content, calls = get_tool_parser(name).stream(), "", []
    for i, piece in enumerate(pieces):
        text, new = stream.feed(piece, final=i == len(pieces) - 1)
        content += text
        calls += new
    expected = get_tool_parser(name).extract(answer)
    assert content.strip() == want_content and (expected[0] or "") == want_content
    assert _names_args(calls) == _names_args(expected[1]) and stream.num_calls == len(expected[1])


@pytest.mark.parametrize("seed", range(4))
def test_forced_call_stream(seed):
    """A "required" answer (a JSON list of calls, keys in either order, strings with escapes and
    brackets, nested parameters) in random pieces: each call's name once it is whole, then its
    parameters' text as it comes; summed, the answer's calls."""
    answer = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}"}},\n {"parameters": {"tz": "CET", '
              '"n": [1, {"a": "]"}]}, "name": "get_time"}]')
    rng, stream, deltas, i = random.Random(seed), ForcedCallStream(None), [], 0
    while i < len(answer):
        j = i + rng.randint(1, 6)
        deltas += stream.feed(answer[i:j])
        i = j
    assert [d["index"] for d in deltas if "id" in d] == [0, 1]
    assert _names_args(_summed(deltas)) == [(c["name"], c["parameters"]) for c in json.loads(answer)]
    named = ForcedCallStream("get_weather")
    assert named.feed('{"ci') == [{"index": 0, "id": ANY, "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert named.feed("") == [] and named.feed('ty": 1}') == [{"index": 0, "function": {"arguments": 'ty": 1}'}}]


class ScriptedEngine(StubEngine):
    """Answers every request with ``answer``, a few characters a step; records the prompts and
    sampling parameters it got."""

    def __init__(self, tokenizer, answer: str, piece: int = 7, step_s: float = 0.0):
        super().__init__(tokenizer=tokenizer, max_model_len=4096, step_s=step_s)
        self.answer, self.piece = answer, piece
        self.prompts: list[dict] = []
        self.params: list = []

    def add_request(self, request_id, prompt, params, priority=0, lora_request=None):
        self.prompts.append(prompt)
        self.params.append(params)
        super().add_request(request_id, prompt, params, priority, lora_request)

    def _output(self, rid: str, prompt, params, n: int) -> RequestOutput | None:
        sent, end = (n - 1) * self.piece, n * self.piece
        done = end >= len(self.answer)
        delta = params.output_kind == RequestOutputKind.DELTA
        if not done and not delta:
            return None
        text = self.answer[sent:end] if delta else self.answer
        return RequestOutput(rid, prompt["prompt"], prompt["prompt_token_ids"], None,
                             [CompletionOutput(0, text, [1], None, None, "stop" if done else None)], done)


def _client(tokenizer, answer: str, step_s: float = 0.0, **tool_flags):
    engine = ScriptedEngine(tokenizer, answer, step_s=step_s)
    return engine, TestClient(build_app(AsyncLLM(engine), ["m"], **tool_flags))


def _chat(**extra) -> dict:
    return {"model": "m", "chat_template": TEMPLATE, "tools": TOOLS,
            "messages": [{"role": "user", "content": "Weather and time in Paris?"}], **extra}


def test_chat_returns_tool_calls(tokenizer):
    engine, client = _client(tokenizer, CALLS_TEXT, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        body = client.post("/v1/chat/completions", json=_chat()).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I will check both."
    assert _names_args(choice["message"]["tool_calls"])[0] == ("get_weather", {"city": "Paris"})
    assert engine.prompts[0]["prompt"].startswith("[tool get_weather]<user>")    # the tools reach the template


def test_streamed_chat_returns_tool_call_deltas(tokenizer):
    _, client = _client(tokenizer, CALLS_TEXT, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        text = client.post("/v1/chat/completions", json=_chat(stream=True)).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas).strip() == "I will check both."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [tc["index"] for tc in calls] == [0, 1]
    assert _names_args(calls) == _names_args(HermesToolParser().extract(CALLS_TEXT)[1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parser, answer", [("llama3_json", LLAMA3_CALLS), ("pythonic", PYTHONIC_CALLS),
                                            ("mistral", MISTRAL_V11_CALLS), ("qwen3_coder", QWEN3_CODER_CALLS),
                                            ("granite", GRANITE_CALLS), ("phi4_mini_json", PHI4_MINI_CALLS),
                                            ("internlm", INTERNLM_CALLS), ("llama4_json", LLAMA3_CALLS),
                                            ("llama4_pythonic", PYTHONIC_CALLS)])
def test_chat_whole_answer_tool_calls(tokenizer, stream, parser, answer):
    """--tool-call-parser llama3_json / pythonic / mistral / qwen3_coder / granite /
    phi4_mini_json / internlm (and vLLM's Llama 4 names, llama4_json and llama4_pythonic): an
    answer that is all calls gives tool_calls, no content."""
    _, client = _client(tokenizer, answer, enable_auto_tool_choice=True, tool_call_parser=parser)
    with client:
        r = client.post("/v1/chat/completions", json=_chat(stream=stream))
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert not "".join(d.get("content") or "" for d in deltas)
        calls, finish = [tc for d in deltas for tc in d.get("tool_calls", [])], chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] is None
        calls, finish = choice["message"]["tool_calls"], choice["finish_reason"]
    assert finish == "tool_calls" and [tc.get("index", i) for i, tc in enumerate(calls)] == [0, 1]
    assert _names_args(calls) == WEATHER_AND_TIME


def test_mistral_parser_keeps_special_tokens_in_the_text(tokenizer):
    """Mistral's [TOOL_CALLS] and InternLM's action tags are special tokens: with their parsers
    and tools (auto choice) the request's text keeps special tokens, as vLLM's parsers ask; not
    without tools, nor with tool_choice "none", nor for parsers whose tags are text."""
    for parser, extra, keeps in [("mistral", {}, True), ("mistral", {"tool_choice": "none"}, False),
                                 ("mistral", {"tools": None}, False), ("hermes", {}, False), ("internlm", {}, True)]:
        engine, client = _client(tokenizer, MISTRAL_V11_CALLS, enable_auto_tool_choice=True, tool_call_parser=parser)
        with client:
            assert client.post("/v1/chat/completions", json=_chat(**extra)).status_code == 200
        assert engine.params[0].skip_special_tokens is not keeps, (parser, extra)


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_coder_types_arguments_by_the_requests_tools(tokenizer, stream):
    """The route hands the request's tools to the parser: an integer parameter arrives as a
    number, streamed or not."""
    answer = "<tool_call>\n<function=get_forecast>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "get_forecast", "parameters": {
        "type": "object", "properties": {"days": {"type": "integer"}}}}}]
    _, client = _client(tokenizer, answer, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder")
    with client:
        r = client.post("/v1/chat/completions", json={**_chat(stream=stream), "tools": tools})
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    else:
        calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert _names_args(calls) == [("get_forecast", {"days": 3})]


def test_plain_answer_and_tool_history(tokenizer):
    """No call in the answer: plain content, finish "stop". An assistant turn's call (arguments
    as OpenAI's JSON string) reaches the template as an object."""
    engine, client = _client(tokenizer, "It is sunny.", enable_auto_tool_choice=True, tool_call_parser="hermes")
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with client:
        body = client.post("/v1/chat/completions", json=_chat(messages=history)).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "[call get_weather city=Oslo]<tool>sunny<assistant>" in engine.prompts[0]["prompt"]


def test_auto_tool_choice_needs_the_flags(tokenizer):
    _, plain = _client(tokenizer, CALLS_TEXT)                         # no --enable-auto-tool-choice
    with plain:
        r = plain.post("/v1/chat/completions", json=_chat())
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = plain.post("/v1/chat/completions", json=_chat(tool_choice="none"))      # tools shown, none parsed
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_serve_refuses_a_bad_tool_parser_setup(capsys):
    from pagoda.entrypoints.cli import main
    assert main(["serve", "--enable-auto-tool-choice"]) == 1
    assert "--tool-call-parser" in capsys.readouterr().err
    assert main(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "nope"]) == 1
    assert "Unknown tool call parser 'nope'" in capsys.readouterr().err


def test_openai_client_reads_the_tool_calls(tokenizer):
    """The official client parses the response and sums the streamed tool-call deltas."""
    OpenAI = pytest.importorskip("openai", reason="the openai client (a test dependency) is not installed").OpenAI
    _, client = _client(tokenizer, CALLS_TEXT, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with client:
        api = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
        kwargs = dict(model="m", messages=[{"role": "user", "content": "Paris?"}], tools=TOOLS,
                      extra_body={"chat_template": TEMPLATE})
        message = api.chat.completions.create(**kwargs).choices[0].message
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
            _names_args(HermesToolParser().extract(CALLS_TEXT)[1])
        names = {}
        for chunk in api.chat.completions.create(stream=True, **kwargs):
            for tc in chunk.choices[0].delta.tool_calls or []:
                names[tc.index] = tc.function.name
        assert names == {0: "get_weather", 1: "get_time"}


def test_forced_tool_choices_hold_the_answer_to_the_calls_schema(tokenizer):
    """tool_choice "required" / a named function: the engine gets the calls' JSON schema as its
    structured output, and the answer comes back as tool_calls (no parser needed)."""
    required = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    engine, client = _client(tokenizer, required)
    with client:
        body = client.post("/v1/chat/completions", json=_chat(tool_choice="required")).json()
        schema = engine.params[0].structured_outputs.json
        assert schema["type"] == "array" and schema["minItems"] == 1
        assert schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert _names_args(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    # (steps of 20 ms: the reader keeps up, so each step's delta is a chunk of its own)
    engine, client = _client(tokenizer, '{"city": "Oslo"}', step_s=0.02)
    named = {"type": "function", "function": {"name": "get_weather"}}
    with client:
        body = client.post("/v1/chat/completions", json=_chat(tool_choice=named)).json()
        assert engine.params[0].structured_outputs.json == TOOLS[0]["function"]["parameters"]
        assert _names_args(body["choices"][0]["message"]["tool_calls"]) == [("get_weather", {"city": "Oslo"})]
        # Streamed: the call's name first, then its arguments as they come (ScriptedEngine: 7
        # characters a step)
        text = client.post("/v1/chat/completions", json=_chat(tool_choice=named, stream=True)).text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        assert len(calls) == 3 and calls[0]["function"]["arguments"] == '{"city"'
        assert _names_args(_summed(calls)) == [("get_weather", {"city": "Oslo"})]
        for choice, message in [({"type": "function", "function": {"name": "nope"}}, "not among the request's tools"),
                                ("sometimes", "Unknown tool_choice")]:
            r = client.post("/v1/chat/completions", json=_chat(tool_choice=choice))
            assert r.status_code == 400 and message in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json=_chat(tool_choice="required", response_format={"type": "json_object"}))
        assert r.status_code == 400 and "cannot be combined" in r.json()["error"]["message"]
    engine, client = _client(tokenizer, required, step_s=0.02)
    with client:
        text = client.post("/v1/chat/completions", json=_chat(tool_choice="required", stream=True)).text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        assert len(calls) > 2 and _names_args(_summed(calls)) == [("get_weather", {"city": "Paris"})]
        assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
        assert r.status_code == 400 and "cannot be combined" in r.json()["error"]["message"]
