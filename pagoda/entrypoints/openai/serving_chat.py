"""POST /v1/chat/completions: the messages (and tools) rendered with the model's chat template;
with ``--reasoning-parser NAME``, the model's thinking returned apart (``reasoning``); with
``--enable-auto-tool-choice --tool-call-parser NAME``, tool calls found in the answer (after the
thinking); with tool_choice "required" or a named function, the answer held to the calls' JSON
schema."""
import json

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagoda.entrypoints.openai.serving import OpenAIServing, finite_logprob
from pagoda.entrypoints.openai.tool_parsers import ForcedCallStream, get_tool_parser, make_tool_call
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import StructuredOutputsParams


def render_chat(tokenizer, request) -> dict:
    """A request's messages (and tools) rendered with the chat template as an engine prompt (a
    chat completion's, or /tokenize's with messages): the text holds the special tokens already."""
    messages = [_plain(m.model_dump(exclude_none=True)) for m in request.messages]
    return tokenizer.chat_prompt(
        messages, add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
        continue_final_message=request.continue_final_message, chat_template=request.chat_template,
        tools=request.tools, **(request.chat_template_kwargs or {}))


class OpenAIServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, *args, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None):
        super().__init__(*args)
        self.tool_parser = get_tool_parser(tool_call_parser) if enable_auto_tool_choice else None
        self.reasoning_parser = ReasoningParser(reasoning_parser) if reasoning_parser else None

    def engine_prompts(self, request: ChatCompletionRequest) -> list:
        return [render_chat(self.engine.tokenizer, request)]

    def sampling_params(self, request: ChatCompletionRequest):
        """As vLLM: tools are rendered into the prompt whatever the choice. "auto" (the choice when
        tools come without one) needs a parser; "required" and a named function hold the answer
        to a JSON schema (a list of {"name", "parameters"}, or the function's parameters), whatever
        the model's own tool-call format."""
        params = super().sampling_params(request)
        choice = _tool_choice(request)
        if choice == "auto" and self.tool_parser is None:
            raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        if choice == "auto" and request.tools and getattr(self.tool_parser, "reads_special_tokens", False):
            # (as vLLM: the parser's tags are special tokens, Mistral's [TOOL_CALLS] and InternLM's
            # action tags, which the text would leave out)
            params.skip_special_tokens = False
        if choice not in ("auto", "none"):
            if params.structured_outputs is not None:
                raise ValueError("A forced tool_choice cannot be combined with response_format or structured_outputs.")
            params.structured_outputs = StructuredOutputsParams(json=_forced_schema(request, choice))
        return params

    def choice(self, request: ChatCompletionRequest, out: RequestOutput, c: CompletionOutput,
               index: int, state: dict) -> dict | None:
        logprobs = None
        if c.logprobs is not None:
            k = request.top_logprobs or 0
            logprobs = {"content": [_token_logprob(lps[t], sorted((lp for lp in lps.values() if lp.rank <= k),
                                                                  key=lambda lp: lp.rank))
                                    for t, lps in zip(c.token_ids, c.logprobs)]}
        text, calls, finish, reasoning = c.text, [], c.finish_reason, None
        if "tool_choice" not in state:      # (once a choice, not once a streamed chunk)
            state["tool_choice"] = _tool_choice(request)
        choice = state["tool_choice"]
        # (the thinking first: a grammar holds only the answer after it, the engine knowing the
        # same reasoning_parser)
        if self.reasoning_parser is not None and request.stream:
            thinking = state.setdefault("reasoning", self.reasoning_parser.stream(out.prompt))
            reasoning, text = thinking.feed(text, final=finish is not None)
        elif self.reasoning_parser is not None:
            reasoning, text = self.reasoning_parser.extract(text, out.prompt)
        if choice not in ("auto", "none") and request.stream:
            # A forced call: the answer is its JSON, streamed as the calls' names and arguments.
            forced = state.setdefault("forced", ForcedCallStream(None if choice == "required"
                                                                 else choice["function"]["name"]))
            text, calls = None, forced.feed(text or "")
            if choice == "required" and forced.sent and finish == "stop":
                finish = "tool_calls"
        elif choice not in ("auto", "none"):
            text, calls = None, _forced_calls(choice, text or "")
            if choice == "required" and calls and finish == "stop":
                finish = "tool_calls"
        elif choice == "auto" and self.tool_parser is not None:
            if request.stream:
                tools = state.setdefault("tools", self.tool_parser.stream(request.tools))
                text, calls = tools.feed(text or "", final=finish is not None)
                first_call = tools.num_calls - len(calls)
                calls = [{"index": first_call + i, **call} for i, call in enumerate(calls)]
                called = tools.num_calls > 0
            else:
                text, calls = self.tool_parser.extract(text or "", request.tools)
                called = bool(calls)
            if called and finish is not None:
                finish = "tool_calls"
        if request.stream:
            if not text and not reasoning and not calls and finish is None and logprobs is None \
                    and "started" in state:
                return None                 # (held back: it may begin a tool call or a tag)
            delta = {"content": text}
            if "started" not in state:      # a choice's first chunk names the role
                delta, state["started"] = {"role": "assistant", "content": text}, True
            if reasoning:
                delta.update(reasoning=reasoning, reasoning_content=reasoning)
            if calls:
                delta["tool_calls"] = calls
            body = {"delta": delta}
        else:
            message = {"role": "assistant", "content": text}
            if self.reasoning_parser is not None:   # (vLLM's field, and its older name)
                message.update(reasoning=reasoning, reasoning_content=reasoning)
            if calls:
                message["tool_calls"] = calls
            body = {"message": message}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop_reason}


def _tool_choice(request: ChatCompletionRequest) -> str | dict:
    """"none", "auto", "required" or the named function's dict."""
    if not request.tools:
        return "none"
    choice = request.tool_choice or "auto"
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise ValueError(f'Unknown tool_choice {choice!r}; known: "none", "auto", "required" or a named function.')
    return choice


def _function(tool: dict) -> dict:
    return tool.get("function") or {}


def _forced_schema(request: ChatCompletionRequest, choice) -> dict:
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [_function(t).get("name")]},
                                                   "parameters": _function(t).get("parameters") or {"type": "object"}},
                  "required": ["name", "parameters"]} for t in request.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return schema if request.parallel_tool_calls else {**schema, "maxItems": 1}
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    for t in request.tools:
        if _function(t).get("name") == name:
            return _function(t).get("parameters") or {"type": "object"}
    raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools.")


def _forced_calls(choice, answer: str) -> list[dict]:
    """The calls in a forced answer (the grammar made it valid JSON, unless max_tokens cut it off:
    then a named function's arguments are that text, and "required" gives no call)."""
    if choice != "required":
        return [make_tool_call(choice["function"]["name"], answer)]
    try:
        items = json.loads(answer)
    except json.JSONDecodeError:
        return []
    return [make_tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]


def _plain(message: dict) -> dict:
    """Text parts ([{"type": "text", "text": ...}]) joined into one string, and tool calls'
    arguments as objects (OpenAI sends JSON strings), as the templates expect."""
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "\n".join(p["text"] for p in content if p.get("type") == "text")
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass                        # (left as the client sent it)
    return message


def _token_logprob(lp: Logprob, top: list[Logprob]) -> dict:
    def entry(x: Logprob) -> dict:
        token = x.decoded_token or ""
        return {"token": token, "logprob": finite_logprob(x.logprob), "bytes": list(token.encode())}
    return {**entry(lp), "top_logprobs": [entry(x) for x in top]}
