"""POST /v1/completions: prompts as text, token ids, or lists of either."""
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving import OpenAIServing, finite_logprob, input_prompts
from pagoda.outputs import CompletionOutput, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def engine_prompts(self, request: CompletionRequest) -> list:
        return input_prompts(request.prompt, "prompt")

    def choice(self, request: CompletionRequest, out: RequestOutput, c: CompletionOutput,
               index: int, state: dict) -> dict:
        text, offset = c.text, state.get("text_len", 0)
        if request.echo and "text_len" not in state:
            prompt = out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)
            text, offset = prompt + text, len(prompt)
        state["text_len"] = offset + len(c.text)
        logprobs = None
        if c.logprobs is not None:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for token_id, lps in zip(c.token_ids, c.logprobs):
                token = lps[token_id].decoded_token or ""
                logprobs["tokens"].append(token)
                logprobs["token_logprobs"].append(finite_logprob(lps[token_id].logprob))
                logprobs["top_logprobs"].append({lp.decoded_token: finite_logprob(lp.logprob) for lp in lps.values()})
                logprobs["text_offset"].append(offset)
                offset += len(token)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

