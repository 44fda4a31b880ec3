"""Tool calls in a chat model's text, as vLLM's ``--tool-call-parser`` finds them (with
``--enable-auto-tool-choice``). ``hermes``: the format of Hermes, Qwen2.5 and Qwen3 models,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call; the text before the first block is the message's content. ``llama3_json``:
Llama 3.1-3.3's, the whole answer is the calls, JSON objects separated by ";" after an optional
``<|python_tag|>``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}

``mistral``: Mistral's, the text after ``[TOOL_CALLS]`` is the calls, a JSON list (v0.3
tokenizers) or ``name[ARGS]{...}`` per call (v11 and later), the text before it content:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

``pythonic``: Llama 3.2's and 4's, the whole answer is a Python list of calls with keyword
arguments of literal values (inside ``<|python_start|>`` ... ``<|python_end|>`` for Llama 4):

    [get_weather(city="Paris"), get_time(tz="Europe/Paris")]

``qwen3_coder``: Qwen3-Coder's, hermes' blocks holding a function and its parameters as tags,
each value as text, typed by the request's tool schema (integers, numbers, booleans, null,
objects and arrays; strings and parameters the schema does not know stay text):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

``granite``: IBM Granite 3's, the whole answer a JSON list of calls, after ``<|tool_call|>`` (3.0)
or ``<tool_call>`` (3.1 and later) or alone; ``phi4_mini_json``: Phi-4-mini's, the list after
``functools``:

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]

``internlm``: InternLM2.5's and 3's, hermes' blocks between special tokens (which the request's
text then keeps), the call's arguments as "parameters":

    <|action_start|><|plugin|>
    {"name": "get_weather", "parameters": {"city": "Paris"}}<|action_end|>

Calls become OpenAI's ``tool_calls`` (``arguments`` a JSON string); text that is not calls in
the parser's format stays as it was, content."""
import ast
import json
import re
import uuid

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "granite", "phi4_mini_json",
                     "internlm", "llama4_json", "llama4_pythonic")     # (the last two: vLLM's names for Llama 4)


def check_tool_call_parser(name: str | None) -> None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"Unknown tool call parser {name!r}; known: {list(TOOL_CALL_PARSERS)}.")


class HermesToolParser:
    start, end = "<tool_call>", "</tool_call>"

    def stream(self, tools: list[dict] | None = None) -> "StreamingToolCalls":
        return StreamingToolCalls(self, tools)

    def parse_block(self, body: str, tools: list[dict] | None = None) -> list[dict] | None:
        """The calls of the text between a start tag and its end, or None if it is not calls."""
        call = _tool_call(body)
        return None if call is None else [call]

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message (``tools``: the request's, for parsers
        that type arguments by their schema)."""
        head, sep, rest = text.partition(self.start)
        calls = []
        while sep:
            body, closed, after = rest.partition(self.end)
            found = self.parse_block(body, tools)
            if found is None:
                return text, []
            calls += found
            if not closed:
                break
            _, sep, rest = after.partition(self.start)
        if not calls:
            return text, []
        return head.strip() or None, calls


class Qwen3CoderToolParser(HermesToolParser):
    """Hermes' blocks, each a function and its parameters as tags (module docstring)."""
    function = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*|$)", re.DOTALL)
    parameter = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def parse_block(self, body: str, tools: list[dict] | None = None) -> list[dict] | None:
        m = self.function.fullmatch(body)
        if m is None:
            return None
        name = m[1].strip()
        schema = _parameters_schema(tools, name)
        arguments = {}
        for key, value in self.parameter.findall(m[2]):
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key.strip()] = _typed(value, schema.get(key.strip(), {}).get("type"))
        return [make_tool_call(name, json.dumps(arguments, ensure_ascii=False))]


class InternLMToolParser(HermesToolParser):
    """Hermes' blocks between InternLM's action tokens (module docstring)."""
    start, end = "<|action_start|><|plugin|>", "<|action_end|>"
    reads_special_tokens = True


class StreamingToolCalls:
    """A streamed message's deltas as (content delta, tool calls completed by it): text that may
    start a tool-call block is held back until it is known not to; each call is sent whole once
    its block closes (a client sums tool-call deltas by index, so one delta a call is valid). A
    parser whose ``end`` is None (mistral) has one block, to the message's end."""

    def __init__(self, parser: "HermesToolParser | MistralToolParser", tools: list[dict] | None = None):
        self.parser, self.tools = parser, tools
        self.held = ""               # text not yet sent: a possible start tag, or an open block
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.held += delta
        content, calls = "", []
        start, end = self.parser.start, self.parser.end
        while True:
            if self.in_call:
                body, closed, after = self.held.partition(end) if end else (self.held, "", "")
                if not closed and not final:
                    break
                found = self.parser.parse_block(body, self.tools)
                if found is None:            # not calls after all: say it as text
                    content += start + body + closed
                else:
                    calls += found
                self.in_call, self.held = False, after
                if not closed:
                    break
            else:
                head, sep, after = self.held.partition(start)
                if sep:
                    content += head if not self.num_calls and not calls else ""
                    self.in_call, self.held = True, after
                    continue
                keep = 0 if final else partial_suffix(self.held, start)
                sent = self.held[:len(self.held) - keep]
                content += sent if not self.num_calls and not calls else ""
                self.held = self.held[len(sent):]
                break
        self.num_calls += len(calls)
        return content, calls


class Llama3JsonToolParser:
    """A message that is all calls in JSON, after one of ``tags`` (or, where ``openers`` allow,
    none): call objects separated by ";" or blanks, or JSON lists of them."""
    tags: tuple[str, ...] = ("<|python_tag|>",)
    openers: tuple[str, ...] = ("{",)     # what an untagged message of calls begins with

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message: calls only if all of it is calls."""
        body = text.strip()
        tag = next((t for t in self.tags if body.startswith(t)), None)
        if tag is None and not body.startswith(self.openers):
            return text, []
        body = body.removeprefix(tag or "").lstrip()
        calls, decoder, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return text, []
            found = [_call_of(o) for o in obj] if isinstance(obj, list) else [_call_of(obj)]
            if not found or None in found:
                return text, []
            calls += found
            while i < len(body) and body[i] in " \t\n;":
                i += 1
        return (None, calls) if calls else (text, [])

    def may_be_calls(self, head: str) -> bool:
        """Whether a message that begins with ``head`` (stripped) may still be tool calls."""
        return head.startswith(self.openers + self.tags) or any(t.startswith(head) for t in self.tags)

    def stream(self, tools: list[dict] | None = None) -> "HeldToolCalls":
        return HeldToolCalls(self)


class GraniteToolParser(Llama3JsonToolParser):
    tags = ("<|tool_call|>", "<tool_call>")     # (Granite 3.0's; 3.1's and later)
    openers = ("[",)


class Phi4MiniJsonToolParser(Llama3JsonToolParser):
    tags = ("functools",)
    openers = ()


class MistralToolParser:
    start, end = "[TOOL_CALLS]", None
    args_tag = "[ARGS]"
    # Its tags are special tokens (Mistral's tokenizers since v0.3): the request's text keeps them.
    reads_special_tokens = True

    def stream(self, tools: list[dict] | None = None) -> StreamingToolCalls:
        return StreamingToolCalls(self)

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message."""
        head, sep, rest = text.partition(self.start)
        calls = self.parse_block(rest) if sep else None
        return (text, []) if calls is None else (head.strip() or None, calls)

    def parse_block(self, body: str, tools: list[dict] | None = None) -> list[dict] | None:
        """The calls after the first [TOOL_CALLS]: a JSON list (or object), or name[ARGS]{...}
        each, joined by more [TOOL_CALLS]; None if it is neither."""
        body = body.strip()
        if body[:1] in ("[", "{"):
            try:
                found = json.loads(body)
            except json.JSONDecodeError:
                return None
            calls = [_call_of(obj) for obj in (found if isinstance(found, list) else [found])]
            return calls if calls and None not in calls else None
        calls = []
        for part in body.split(self.start):
            name, sep, arguments = part.partition(self.args_tag)
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                return None
            if not sep or not name.strip():
                return None
            calls.append(make_tool_call(name.strip(), arguments.strip()))
        return calls


class PythonicToolParser:
    start, end = "<|python_start|>", "<|python_end|>"

    def extract(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a whole message: calls only if all of it is calls."""
        body = text.strip().removeprefix(self.start).removesuffix(self.end).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if (not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)) or node.args
                    or any(k.arg is None for k in node.keywords)):
                return text, []
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:           # (not a literal: a name, an expression)
                return text, []
            calls.append(make_tool_call(ast.unparse(node.func), json.dumps(arguments, ensure_ascii=False)))
        return None, calls

    def may_be_calls(self, head: str) -> bool:
        return head.startswith(("[", self.start)) or self.start.startswith(head)

    def stream(self, tools: list[dict] | None = None) -> "HeldToolCalls":
        return HeldToolCalls(self)


class HeldToolCalls:
    """A streamed message whose calls are the whole of it (llama3_json, granite, phi4_mini_json,
    pythonic), as (content delta, tool calls): held while it may be calls, parsed when it ends;
    once it cannot be, sent as it comes."""

    def __init__(self, parser: "Llama3JsonToolParser | PythonicToolParser"):
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


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parameters_schema(tools: list[dict] | None, name: str) -> dict:
    """The JSON schema properties of the request's function ``name`` ({} if it has none)."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return (function.get("parameters") or {}).get("properties") or {}
    return {}


def _typed(value: str, kind) -> object:
    """A parameter's text as its schema's type says (a list of types: the first not null); text
    that does not parse as that type, a string type and no type stay the text."""
    kinds = kind if isinstance(kind, list) else [kind]
    if "null" in kinds and value.strip().lower() == "null":
        return None
    kind = next((k for k in kinds if k != "null"), None)
    text = value.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in ("object", "array"):
            try:
                return json.loads(text)
            except json.JSONDecodeError:
                return ast.literal_eval(text)      # (Python literals: single quotes, True / None)
    except (ValueError, SyntaxError):
        pass
    return value


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


def get_tool_parser(name: str):
    check_tool_call_parser(name)
    return {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
            "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser, "granite": GraniteToolParser,
            "phi4_mini_json": Phi4MiniJsonToolParser, "internlm": InternLMToolParser,
            "llama4_json": Llama3JsonToolParser, "llama4_pythonic": PythonicToolParser}[name]()
