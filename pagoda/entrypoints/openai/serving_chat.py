"""POST /v1/chat/completions: the messages (and tools) rendered with the model's chat template;
with ``--enable-auto-tool-choice --tool-call-parser NAME``, tool calls found in the answer."""
import json

from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving import OpenAIServing, finite_logprob
from pagoda.entrypoints.openai.tool_parsers import StreamingToolCalls, get_tool_parser
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, *args, enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None):
        super().__init__(*args)
        self.tool_parser = get_tool_parser(tool_call_parser) if enable_auto_tool_choice else None

    def engine_prompts(self, request: ChatCompletionRequest) -> list:
        self._check_tool_choice(request)
        messages = [_plain(m.model_dump(exclude_none=True)) for m in request.messages]
        return [self.engine.tokenizer.chat_prompt(
            messages, add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            tools=request.tools, **(request.chat_template_kwargs or {}))]

    def _check_tool_choice(self, request: ChatCompletionRequest) -> None:
        """As vLLM: tools are rendered into the prompt whatever the choice; "auto" (the choice
        when tools come without one) needs a parser. Forcing a call ("required", a named
        function) is not done yet."""
        choice = request.tool_choice or "auto"
        if choice == "none" or not request.tools:
            return
        if choice == "auto":
            if self.tool_parser is None:
                raise ValueError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                 "to be set")
            return
        raise ValueError(f"tool_choice={json.dumps(choice)} forces a tool call, which pagoda does not do yet "
                         '(it would hold the answer to a tool-call grammar); use "auto" or "none".')

    def _parses_tools(self, request: ChatCompletionRequest) -> bool:
        return self.tool_parser is not None and bool(request.tools) and request.tool_choice in (None, "auto")

    def choice(self, request: ChatCompletionRequest, out: RequestOutput, c: CompletionOutput,
               index: int, state: dict) -> dict | None:
        logprobs = None
        if c.logprobs is not None:
            k = request.top_logprobs or 0
            logprobs = {"content": [_token_logprob(lps[t], sorted((lp for lp in lps.values() if lp.rank <= k),
                                                                  key=lambda lp: lp.rank))
                                    for t, lps in zip(c.token_ids, c.logprobs)]}
        text, calls, finish = c.text, [], c.finish_reason
        if self._parses_tools(request):
            if request.stream:
                tools = state.setdefault("tools", StreamingToolCalls(self.tool_parser))
                text, calls = tools.feed(c.text, final=finish is not None)
                first_call = tools.num_calls - len(calls)
                calls = [{"index": first_call + i, **call} for i, call in enumerate(calls)]
                called = tools.num_calls > 0
            else:
                text, calls = self.tool_parser.extract(c.text)
                called = bool(calls)
            if called and finish is not None:
                finish = "tool_calls"
        if request.stream:
            if not text and not calls and finish is None and logprobs is None and "started" in state:
                return None                 # (held back: it may begin a tool call)
            delta = {"content": text}
            if "started" not in state:      # a choice's first chunk names the role
                delta, state["started"] = {"role": "assistant", "content": text}, True
            if calls:
                delta["tool_calls"] = calls
            body = {"delta": delta}
        else:
            message = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            body = {"message": message}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": c.stop_reason}


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
