"""POST /v1/embeddings: each input's vector, from an engine with the pooling runner (``pagoda
serve --runner pooling``), as OpenAI's (and vLLM's) Embeddings API answers."""
import base64
import time
import uuid

from fastapi.responses import JSONResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import EmbeddingRequest
from pagoda.entrypoints.openai.serving import error_response, input_prompts, start


class OpenAIServingEmbedding:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str]):
        self.engine = engine
        self.served_model_names = served_model_names

    async def create(self, request: EmbeddingRequest):
        if request.model is not None and request.model not in self.served_model_names:
            return error_response(f"The model `{request.model}` does not exist.", 404, "model")
        if self.engine.model_config.runner != "pooling":
            return error_response("This model does not serve the Embeddings API: start the server with "
                                  "--runner pooling.", 400)
        request_id = f"embd-{uuid.uuid4().hex}"
        try:
            params = request.pooling_params()
            gens = [self.engine.encode(p, params, f"{request_id}-{i}", request.priority)
                    for i, p in enumerate(input_prompts(request.input, "input"))]
            outputs = await start(gens)        # (a pooling request's first output is its last)
        except ValueError as e:
            return error_response(str(e), 400)
        for g in gens:
            await g.aclose()
        data = [{"index": i, "object": "embedding", "embedding": _encoded(out.outputs.data, request.encoding_format)}
                for i, out in enumerate(outputs)]
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
