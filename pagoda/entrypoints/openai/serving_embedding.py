"""POST /v1/embeddings and /v1/score (also /score): an engine with the pooling runner (``pagoda
serve --runner pooling``) answers as OpenAI's Embeddings API does, and scores pairs of texts as
vLLM scores them with an embedding model (the cosine of their embeddings)."""
import base64
import time
import uuid

from fastapi.responses import JSONResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import EmbeddingRequest, ScoreRequest
from pagoda.entrypoints.openai.serving import error_response, input_prompts, start
from pagoda.outputs import PoolingRequestOutput, ScoringRequestOutput
from pagoda.pooling_params import PoolingParams, score_pairs


class OpenAIServingPooling:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names

    async def embed(self, request: EmbeddingRequest):
        if (refusal := self._refusal(request)) is not None:
            return refusal
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            outputs = await self._encode(input_prompts(request.input, "input"), request.pooling_params(), request_id,
                                         request.priority)
        except ValueError as e:
            return error_response(str(e), 400)
        data = [{"index": i, "object": "embedding", "embedding": _encoded(out.outputs.data, request.encoding_format)}
                for i, out in enumerate(outputs)]
        return self._response(request, request_id, data, outputs)

    async def score(self, request: ScoreRequest):
        if (refusal := self._refusal(request)) is not None:
            return refusal
        request_id = f"score-{uuid.uuid4().hex}"
        try:
            first, second = score_pairs(input_prompts(request.text_1, "text_1"), input_prompts(request.text_2, "text_2"),
                                        ("text_1", "text_2"))
            params = PoolingParams(truncate_prompt_tokens=request.truncate_prompt_tokens)
            outputs = await self._encode(first + second, params, request_id, request.priority)
        except ValueError as e:
            return error_response(str(e), 400)
        n = len(first)
        scores = [ScoringRequestOutput.from_pair(str(i), a, b).outputs.score
                  for i, (a, b) in enumerate(zip(outputs[:n], outputs[n:]))]
        data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
        return self._response(request, request_id, data, outputs)

    def _refusal(self, request) -> JSONResponse | None:
        if request.model is not None and request.model not in self.served_model_names:
            return error_response(f"The model `{request.model}` does not exist.", 404, "model")
        if self.engine.model_config.runner != "pooling":
            return error_response("This model does not serve embeddings or scores: start the server with "
                                  "--runner pooling.", 400)
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
