"""Tool calls in a chat model's text, as vLLM's ``--tool-call-parser`` finds them (with
``--enable-auto-tool-choice``). ``hermes``: the format of Hermes, Qwen2.5 and Qwen3 models,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; the text before the first block is the message's content. ``llama3_json``:
Llama 3.1-3.3's, the whole answer is the calls, JSON objects separated by ";" after an optional
``<|python_tag|>``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

Calls become OpenAI's ``tool_calls`` (``arguments`` a JSON string); text that is not a JSON
object with a name stays as it was, content."""
import json
import uuid

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


def check_tool_call_parser(name: str | None) -> None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; known: {list(TOOL_CALL_PARSERS)}.")


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"

    def stream(self) -> "StreamingToolCalls":
        return StreamingToolCalls(self)

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message."""
        head, sep, rest = text.partition(self.start)
        calls = []
        while sep:
            body, closed, after = rest.partition(self.end)
            call = _tool_call(body)
            if call is None:
                return text, []
            calls.append(call)
            if not closed:
                break
            _, sep, rest = after.partition(self.start)
        if not calls:
            return text, []
        return head.strip() or None, calls


class StreamingToolCalls:
    """A streamed message's deltas as (content delta, tool calls completed by it): text that may
    start a tool-call block is held back until it is known not to; each call is sent whole once
    its block closes (a client sums tool-call deltas by index, so one delta a call is valid)."""

    def __init__(self, parser: HermesToolParser):
        self.parser = parser
        self.held = ""               # text not yet sent: a possible start tag, or an open block
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += delta
        content, calls = "", []
        start, end = self.parser.start, self.parser.end
        while True:
            if self.in_call:
                body, closed, after = self.held.partition(end)
                if not closed and not final:
                    break
                call = _tool_call(body)
                if call is None:             # not a call after all: say it as text
                    content += start + body + closed
                else:
                    calls.append(call)
                self.in_call, self.held = False, after
                if not closed:
                    break
            else:
                head, sep, after = self.held.partition(start)
                if sep:
                    content += head if not self.num_calls and not calls else ""
                    self.in_call, self.held = True, after
                    continue
                keep = 0 if final else _partial_suffix(self.held, start)
                sent = self.held[:len(self.held) - keep]
                content += sent if not self.num_calls and not calls else ""
                self.held = self.held[len(sent):]
                break
        self.num_calls += len(calls)
        return content, calls


class Llama3JsonToolParser:
    tag = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message: calls only if all of it is calls."""
        body = text.strip()
        if body.startswith(self.tag):
            body = body[len(self.tag):].lstrip()
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            call = _call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in " \t\n;":
                i += 1
        return (None, calls) if calls else (text, [])

    def may_be_calls(self, head: str) -> bool:
        """Whether a message that begins with ``head`` (stripped) may still be tool calls."""
        return head.startswith(("{", self.tag)) or self.tag.startswith(head)

    def stream(self) -> "HeldToolCalls":
        return HeldToolCalls(self)


class HeldToolCalls:
    """A streamed message whose calls are the whole of it (llama3_json), as (content delta,
    tool calls): held while it may be calls, parsed when it ends; once it cannot be, sent as it
    comes."""

    def __init__(self, parser: Llama3JsonToolParser):
        self.parser = parser
        self.held = ""
        self.passing = False
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        if self.passing:
            return delta, []
        self.held += delta
        head = self.held.lstrip()
        if head and not self.parser.may_be_calls(head):
            self.passing, text, self.held = True, self.held, ""
            return text, []
        if not final:
            return "", []
        content, calls = self.parser.extract(self.held)
        self.num_calls = len(calls)
        return content or "", calls


class ForcedCallStream:
    """A forced answer's tool calls as it streams, as OpenAI streams calls: a call's first delta
    with its id, type and name, the next ones with its arguments' text as it comes. ``name``: the
    named function's (the whole answer is its arguments), or None for tool_choice "required"
    (the answer is a JSON list of {"name", "parameters"}; serving_chat holds it to that)."""

    def __init__(self, name: str | None):
        self.name = name
        self.text = ""
        self.sent: list[int] = []    # arguments characters sent, per call begun

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        calls = [(self.name, self.text)] if self.name is not None else _listed_calls(self.text)
        deltas = []
        for i, (name, arguments) in enumerate(calls):
            if name is None:         # (not known yet: this call waits, and those after it)
                break
            if i == len(self.sent):
                deltas.append({"index": i, **make_tool_call(name, arguments)})
                self.sent.append(len(arguments))
            elif len(arguments) > self.sent[i]:
                deltas.append({"index": i, "function": {"arguments": arguments[self.sent[i]:]}})
                self.sent[i] = len(arguments)
        return deltas


def _listed_calls(text: str) -> list[tuple[str | None, str]]:
    """(name, the text of its parameters so far) of each call begun in a partial JSON list of
    {"name": ..., "parameters": {...}} objects; the name None until its string is complete."""
    calls: list[list] = []           # [name, parameters' first index, index past their end]
    depth, in_string, escaped, string_start = 0, False, False, 0
    key, expect_key = None, True     # the key being read or valued in a call's object (depth 2)
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 2 and calls:
                    value = json.loads(text[string_start:i + 1])
                    if expect_key:
                        key = value
                    elif key == "name":
                        calls[-1][0] = value
            continue
        if ch == '"':
            in_string, string_start = True, i
        elif ch in "[{":
            depth += 1
            if depth == 2 and ch == "{":
                calls.append([None, None, None])
                key, expect_key = None, True
            elif depth == 3 and key == "parameters" and not expect_key and calls[-1][1] is None:
                calls[-1][1] = i
        elif ch in "]}":
            if depth == 3 and key == "parameters" and calls and calls[-1][2] is None:
                calls[-1][2] = i + 1
            depth -= 1
        elif depth == 2:
            if ch == ":":
                expect_key = False
            elif ch == ",":
                key, expect_key = None, True
    return [(name, "" if start is None else text[start:end]) for name, start, end in calls]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _tool_call(body: str) -> dict | None:
    try:
        return _call_of(json.loads(body))
    except json.JSONDecodeError:
        return None


def _call_of(obj) -> dict | None:
    """A JSON object {"name", "arguments" or "parameters"} as an OpenAI tool call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return make_tool_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def make_tool_call(name: str, arguments: str) -> dict:
    """One of OpenAI's ``tool_calls`` (``arguments``: JSON text)."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def get_tool_parser(name: str) -> HermesToolParser | Llama3JsonToolParser:
    check_tool_call_parser(name)
    return Llama3JsonToolParser() if name == "llama3_json" else HermesToolParser()
