"""The pooling runner's routes (``pagoda serve --runner pooling``; a classifier's default), as
vLLM's: POST /v1/embeddings (OpenAI's Embeddings API), /classify (a classifier's class
probabilities), /v1/score (also /score) and /rerank (also /v1/rerank, /v2/rerank): pairs of
texts scored as LLM.score scores them (a cross-encoder's output, or the cosine of two
embeddings)."""
import base64
import time
import uuid

from fastapi.responses import JSONResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.config import class_labels
from pagoda.entrypoints.openai.protocol import ClassificationRequest, EmbeddingRequest, RerankRequest, ScoreRequest
from pagoda.entrypoints.openai.serving import error_response, input_prompts, start
from pagoda.outputs import PoolingRequestOutput, ScoringRequestOutput
from pagoda.pooling_params import PoolingParams, pair_scores, score_pairs, score_prompts


class OpenAIServingPooling:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names

    async def embed(self, request: EmbeddingRequest):
        request_id, outputs = await self._encode_input(request, "embd")
        if isinstance(outputs, JSONResponse):
            return outputs
        data = [{"index": i, "object": "embedding", "embedding": _encoded(out.outputs.data, request.encoding_format)}
                for i, out in enumerate(outputs)]
        return self._response(request, request_id, data, outputs)

    async def classify(self, request: ClassificationRequest):
        request_id, outputs = await self._encode_input(request, "classify")
        if isinstance(outputs, JSONResponse):
            return outputs
        labels = class_labels(self.engine.model_config.arch)
        data = [{"index": i, "label": labels[int(out.outputs.data.argmax())], "probs": out.outputs.data.tolist(),
                 "num_classes": len(labels)} for i, out in enumerate(outputs)]
        return self._response(request, request_id, data, outputs)

    async def _encode_input(self, request, prefix: str) -> tuple[str | None, list | JSONResponse]:
        """(the request's id, the outputs of its ``input`` prompts), or the response that refuses
        it: an unknown model, the wrong runner, a bad parameter or prompt."""
        if (refusal := self._refusal(request)) is not None:
            return None, refusal
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            return request_id, await self._encode(input_prompts(request.input, "input"), request.pooling_params(),
                                                  request_id, request.priority)
        except ValueError as e:
            return request_id, error_response(str(e), 400)

    async def score(self, request: ScoreRequest):
        if (refusal := self._refusal(request)) is not None:
            return refusal
        request_id = f"score-{uuid.uuid4().hex}"
        try:
            first, second = score_pairs(input_prompts(request.text_1, "text_1"), input_prompts(request.text_2, "text_2"),
                                        ("text_1", "text_2"))
            scores, outputs = await self._scores(first, second, request, request_id)
        except ValueError as e:
            return error_response(str(e), 400)
        data = [{"index": i, "object": "score", "score": s.outputs.score} for i, s in enumerate(scores)]
        return self._response(request, request_id, data, outputs)

    async def rerank(self, request: RerankRequest):
        if (refusal := self._refusal(request)) is not None:
            return refusal
        request_id = f"rerank-{uuid.uuid4().hex}"
        try:
            if not request.documents:
                raise ValueError("documents must not be empty.")
            if request.top_n < 0:
                raise ValueError(f"top_n must be at least 0 (0: all), got {request.top_n}.")
            scores, outputs = await self._scores([request.query] * len(request.documents), request.documents,
                                                 request, request_id)
        except ValueError as e:
            return error_response(str(e), 400)
        results = sorted(({"index": i, "document": {"text": doc}, "relevance_score": s.outputs.score}
                          for i, (doc, s) in enumerate(zip(request.documents, scores))),
                         key=lambda r: -r["relevance_score"])
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return JSONResponse({"id": request_id, "model": request.model or self.served_model_names[0],
                             "usage": {"total_tokens": tokens}, "results": results[:request.top_n or None]})

    async def _scores(self, first: list, second: list, request,
                      request_id: str) -> tuple[list[ScoringRequestOutput], list[PoolingRequestOutput]]:
        """The pairs' scores, as LLM.score gives them, and the engine's outputs they came from."""
        prompts = score_prompts(self.engine.model_config.pooling_task, self.engine.tokenizer, first, second)
        params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens, task="score")
        outputs = await self._encode(prompts, params, request_id, request.priority)
        return pair_scores(outputs, len(first)), outputs

    def _refusal(self, request) -> JSONResponse | None:
        if request.model is not None and request.model not in self.served_model_names:
            return error_response(f"The model `{request.model}` does not exist.", 404, "model")
        if self.engine.model_config.runner != "pooling":
            return error_response("This model does not serve embeddings, classes or scores: start the server "
                                  "with --runner pooling.", 400)
        return None

    async def _encode(self, prompts: list, params: PoolingParams, request_id: str,
                      priority: int) -> list[PoolingRequestOutput]:
        """Each prompt's vector; a bad request raises its ValueError."""
        gens = [self.engine.encode(p, params, f"{request_id}-{i}", priority) for i, p in enumerate(prompts)]
        outputs = await start(gens)        # (a pooling request's first output is its last)
        for g in gens:
            await g.aclose()
        return outputs

    def _response(self, request, request_id: str, data: list, outputs: list[PoolingRequestOutput]) -> JSONResponse:
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": request.model or self.served_model_names[0], "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encoded(vector, encoding_format: str):
    """A list of floats, or (``base64``) the float32 values' little-endian bytes in base64, as
    OpenAI's client decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()
