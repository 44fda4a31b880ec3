"""POST /v1/chat/completions: the messages rendered with the model's chat template."""
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest
from pagoda.entrypoints.openai.serving import OpenAIServing, finite_logprob
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def engine_prompts(self, request: ChatCompletionRequest) -> list:
        messages = [_plain(m.model_dump(exclude_none=True)) for m in request.messages]
        return [self.engine.tokenizer.chat_prompt(
            messages, add_generation_prompt=request.add_generation_prompt and not request.continue_final_message,
            continue_final_message=request.continue_final_message, chat_template=request.chat_template,
            **(request.chat_template_kwargs or {}))]

    def choice(self, request: ChatCompletionRequest, out: RequestOutput, c: CompletionOutput,
               index: int, state: dict) -> dict:
        logprobs = None
        if c.logprobs is not None:
            k = request.top_logprobs or 0
            logprobs = {"content": [_token_logprob(lps[t], sorted((lp for lp in lps.values() if lp.rank <= k),
                                                                  key=lambda lp: lp.rank))
                                    for t, lps in zip(c.token_ids, c.logprobs)]}
        if request.stream:
            delta = {"content": c.text}
            if not state:                   # a choice's first chunk names the role
                delta, state["started"] = {"role": "assistant", "content": c.text}, True
            body = {"delta": delta}
        else:
            body = {"message": {"role": "assistant", "content": c.text}}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


def _plain(message: dict) -> dict:
    """Text parts ([{"type": "text", "text": ...}]) joined into one string, as the templates expect."""
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = "\n".join(p["text"] for p in content if p.get("type") == "text")
    return message


def _token_logprob(lp: Logprob, top: list[Logprob]) -> dict:
    def entry(x: Logprob) -> dict:
        token = x.decoded_token or ""
        return {"token": token, "logprob": finite_logprob(x.logprob), "bytes": list(token.encode())}
    return {**entry(lp), "top_logprobs": [entry(x) for x in top]}
