"""POST /tokenize and /detokenize (vLLM's): the server's tokenizer and chat template, without
running the model (clients count a prompt's tokens, or read ids back as text)."""
from fastapi.responses import JSONResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from pagoda.entrypoints.openai.serving import error_response
from pagoda.entrypoints.openai.serving_chat import render_chat
from pagoda.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization:
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels):
        self.engine = engine
        self.models = models

    def tokenize(self, request: TokenizeRequest) -> JSONResponse | dict:
        """{"count", "max_model_len", "tokens", "token_strs" (with return_token_strs)}."""
        if (refusal := self._refusal(request)) is not None:
            return refusal
        tok = self.engine.tokenizer
        try:
            if (request.prompt is None) == (request.messages is None):
                raise ValueError("Give a prompt or messages (one of them).")
            if request.messages is not None:
                prompt = render_chat(tok, request)
                ids = prompt["prompt_token_ids"] if not request.add_special_tokens \
                    else tok.encode(prompt["prompt"], add_special_tokens=True)
            else:
                ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens is not False)
        except ValueError as e:     # (a conversation the template refuses, too)
            return error_response(str(e), 400)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": [tok.id_to_token(i) for i in ids] if request.return_token_strs else None}

    def detokenize(self, request: DetokenizeRequest) -> JSONResponse | dict:
        if (refusal := self._refusal(request)) is not None:
            return refusal
        vocab = self.engine.tokenizer.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            return error_response(f"Token ids must be in [0, {vocab}); got {bad[:8]}.", 400, "tokens")
        return {"prompt": self.engine.tokenizer.decode(request.tokens, skip_special_tokens=False)}

    def _refusal(self, request) -> JSONResponse | None:
        if (refusal := self.models.check_model(request.model)) is not None:
            return refusal
        if self.engine.tokenizer is None:
            return error_response("This server has no tokenizer (skip_tokenizer_init).", 400)
        return None
