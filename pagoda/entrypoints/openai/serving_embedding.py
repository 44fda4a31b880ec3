"""The pooling runner's routes (``pagoda serve --runner pooling``; a classifier's default), as
vLLM's: POST /v1/embeddings (OpenAI's Embeddings API), /classify (a classifier's class
probabilities), /v1/score (also /score) and /rerank (also /v1/rerank, /v2/rerank): pairs of
texts scored as LLM.score scores them (a cross-encoder's output, or the cosine of two
embeddings); /pooling, LLM.encode's output for a task (the token-level ones too)."""
import base64
import time
import uuid

from fastapi.responses import JSONResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.config import class_labels
from pagoda.entrypoints.openai.protocol import (ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                               ScoreRequest)
from pagoda.entrypoints.openai.serving import error_response, input_prompts, start
from pagoda.entrypoints.openai.serving_models import OpenAIServingModels
from pagoda.outputs import PoolingRequestOutput, ScoringRequestOutput
from pagoda.pooling_params import PoolingParams, pair_scores, score_pairs, score_prompts


class OpenAIServingPooling:
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels):
        self.engine = engine
        self.models = models

    async def embed(self, request: EmbeddingRequest):
        return await self._vectors(request, "embd", "embedding", "embedding")

    async def classify(self, request: ClassificationRequest):
        async def respond(request_id):
            outputs = await self._encode_input(request, request_id)
            labels = class_labels(self.engine.model_config.arch)
            data = [{"index": i, "label": labels[int(out.outputs.data.argmax())], "probs": out.outputs.data.tolist(),
                     "num_classes": len(labels)} for i, out in enumerate(outputs)]
            return self._response(request, request_id, data, outputs)
        return await self._answer(request, "classify", respond)

    async def pool(self, request: PoolingRequest):
        """vLLM's /pooling: each input's output of the pooling ``task`` as it comes (a vector, or a
        row for every prompt token: nested lists, or base64 of the float32 values)."""
        return await self._vectors(request, "pool", "pooling", "data")

    async def _vectors(self, request, prefix: str, kind: str, field: str):
        """Each input's output under ``field`` of an object ``kind``: floats, or base64
        (``encoding_format``)."""
        async def respond(request_id):
            outputs = await self._encode_input(request, request_id)
            data = [{"index": i, "object": kind, field: _encoded(out.outputs.data, request.encoding_format)}
                    for i, out in enumerate(outputs)]
            return self._response(request, request_id, data, outputs)
        return await self._answer(request, prefix, respond)

    async def score(self, request: ScoreRequest):
        async def respond(request_id):
            first, second = score_pairs(input_prompts(request.text_1, "text_1"),
                                        input_prompts(request.text_2, "text_2"), ("text_1", "text_2"))
            scores, outputs = await self._scores(first, second, request, request_id)
            data = [{"index": i, "object": "score", "score": s.outputs.score} for i, s in enumerate(scores)]
            return self._response(request, request_id, data, outputs)
        return await self._answer(request, "score", respond)

    async def rerank(self, request: RerankRequest):
        async def respond(request_id):
            if not request.documents:
                raise ValueError("documents must not be empty.")
            if request.top_n < 0:
                raise ValueError(f"top_n must be at least 0 (0: all), got {request.top_n}.")
            scores, outputs = await self._scores([request.query] * len(request.documents), request.documents,
                                                 request, request_id)
            results = sorted(({"index": i, "document": {"text": doc}, "relevance_score": s.outputs.score}
                              for i, (doc, s) in enumerate(zip(request.documents, scores))),
                             key=lambda r: -r["relevance_score"])
            tokens = sum(len(out.prompt_token_ids) for out in outputs)
            return JSONResponse({"id": request_id, "model": request.model or self.models.served_model_names[0],
                                 "usage": {"total_tokens": tokens}, "results": results[:request.top_n or None]})
        return await self._answer(request, "rerank", respond)

    async def _answer(self, request, prefix: str, respond) -> JSONResponse:
        """What ``respond(request_id)`` answers, or the response that refuses the request: an
        unknown model, the wrong runner, a bad parameter or prompt (its ValueError: 400)."""
        if (refusal := self.models.check_model(request.model)) is not None:
            return refusal
        if self.engine.model_config.runner != "pooling":
            return error_response("This model does not serve embeddings, classes or scores: start the server "
                                  "with --runner pooling.", 400)
        try:
            return await respond(f"{prefix}-{uuid.uuid4().hex}")
        except ValueError as e:
            return error_response(str(e), 400)

    async def _encode_input(self, request, request_id: str) -> list[PoolingRequestOutput]:
        """The outputs of the request's ``input`` prompts, with its PoolingParams."""
        return await self._encode(input_prompts(request.input, "input"), request.pooling_params(), request,
                                  request_id)

    async def _scores(self, first: list, second: list, request,
                      request_id: str) -> tuple[list[ScoringRequestOutput], list[PoolingRequestOutput]]:
        """The pairs' scores, as LLM.score gives them, and the engine's outputs they came from."""
        prompts = score_prompts(self.engine.model_config.pooling_task, self.engine.tokenizer, first, second)
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, task="score")
        outputs = await self._encode(prompts, params, request, request_id)
        return pair_scores(outputs, len(first)), outputs

    async def _encode(self, prompts: list, params: PoolingParams, request,
                      request_id: str) -> list[PoolingRequestOutput]:
        """Each prompt's vector, with the request's adapter and priority; a bad request raises its
        ValueError."""
        lora_request = self.models.lora_request(request.model)
        gens = [self.engine.encode(p, params, f"{request_id}-{i}", lora_request, request.priority)
                for i, p in enumerate(prompts)]
        outputs = await start(gens)        # (a pooling request's first output is its last)
        for g in gens:
            await g.aclose()
        return outputs

    def _response(self, request, request_id: str, data: list, outputs: list[PoolingRequestOutput]) -> JSONResponse:
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": request.model or self.models.served_model_names[0], "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector, encoding_format: str):
    """A list of floats, or (``base64``) the float32 values' little-endian bytes in base64, as
    OpenAI's client decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
