"""What completions and chat share: the model-name check, one request per prompt sent to the
engine, the outputs of several prompts merged, the whole response or its Server-Sent Events
stream, usage. The subclasses say what a prompt is and how a choice looks."""
import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.protocol import SamplingRequest, error_body
from pagoda.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from pagoda.entrypoints.openai.serving_models import OpenAIServingModels


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


class OpenAIServing:
    object_name = ""              # "text_completion", "chat.completion"
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, engine: AsyncLLM, models: "OpenAIServingModels"):
        self.engine = engine
        self.models = models

    # ------------------------------------------------------------------ the subclasses' part
    def engine_prompts(self, request) -> list:
        raise NotImplementedError

    def sampling_params(self, request):
        return request.sampling_params(self.engine.model_config.sampling_defaults)

    def choice(self, request, out: RequestOutput, c: CompletionOutput, index: int, state: dict) -> dict | None:
        """One choice of the response, or of one stream chunk (``state`` is the choice's own,
        kept across its chunks; None: no chunk for this output)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ one request
    async def create(self, request: SamplingRequest):
        if (refusal := self.models.check_model(request.model)) is not None:
            return refusal
        lora_request = self.models.lora_request(request.model)
        try:
            params = self.sampling_params(request)
            prompts = await self._fitted(self.engine_prompts(request), params)
            request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
            gens = [self.engine.generate(p, params, f"{request_id}-{i}", lora_request, request.priority)
                    for i, p in enumerate(prompts)]
            firsts = await start(gens)
        except ValueError as e:
            return error_response(str(e), 400)
        outputs = _merge(gens, firsts)
        header = {"id": request_id, "created": int(time.time()),
                  "model": request.model or self.models.served_model_names[0]}
        if request.stream:
            return StreamingResponse(self._stream(request, header, outputs), media_type="text/event-stream")
        return JSONResponse(await self._full(request, header, outputs))

    async def _fitted(self, prompts: list, params) -> list[dict]:
        """The prompts tokenized (once: the engine then takes the ids), and vLLM's server rule:
        a prompt that fits but leaves no room for ``max_tokens`` is refused (400), where the
        offline engine would stop it at the model's length."""
        limit = self.engine.max_model_len
        fitted = []
        for prompt, ids in zip(prompts, await self.engine.prompt_token_ids(prompts)):
            if params.max_tokens is not None and len(ids) <= limit < len(ids) + params.max_tokens:
                raise ValueError(f"This model's maximum context length is {limit} tokens. However, you requested "
                                 f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                                 f"{params.max_tokens} in the completion). Please reduce the length of the "
                                 "prompt or the completion.")
            text = prompt if isinstance(prompt, str) else prompt.get("prompt")
            fitted.append({"prompt": text, "prompt_token_ids": ids})
        return fitted


    async def _full(self, request, header: dict, outputs) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for i, out in outputs:
            finals[i] = out
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i in sorted(finals):
            out = finals[i]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(self.choice(request, out, c, i * request.n + c.index, {}))
        return {**header, "object": self.object_name, "choices": choices,
                "usage": _usage(prompt_tokens, completion_tokens)}

    async def _stream(self, request, header: dict, outputs) -> AsyncIterator[str]:
        states: dict[int, dict] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        try:
            async for i, out in outputs:
                prompt_tokens[i] = len(out.prompt_token_ids)
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue            # this sample had nothing new in this step
                    completion_tokens += len(c.token_ids)
                    index = i * request.n + c.index
                    choice = self.choice(request, out, c, index, states.setdefault(index, {}))
                    if choice is not None:
                        yield _sse({**header, "object": self.chunk_object_name, "choices": [choice]})
        except Exception as e:             # noqa: BLE001 - the headers are gone: say it in the stream
            yield _sse(error_body(str(e), 500))
        opts = request.stream_options
        if opts is not None and opts.include_usage:
            yield _sse({**header, "object": self.chunk_object_name, "choices": [],
                        "usage": _usage(sum(prompt_tokens.values()), completion_tokens)})
        yield "data: [DONE]\n\n"


def input_prompts(given, field: str) -> list:
    """A request's prompts (completions' ``prompt``, embeddings' ``input``): a text, a list of
    token ids, or a list of either; one engine prompt each."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        given = [given]
    if not given:
        raise ValueError(f"{field} must not be empty.")
    return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in given]


def finite_logprob(logprob: float) -> float:
    # JSON has no -inf; as vLLM, a token the filters removed gets -9999.
    return max(logprob, -9999.0)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def start(gens: list) -> list:
    """Each prompt's first output. The engine validates a request when it adds it, so a bad one
    raises here (an HTTP 400) before any response has started; the others are then aborted."""
    firsts = await asyncio.gather(*(anext(g) for g in gens), return_exceptions=True)
    errors = [f for f in firsts if isinstance(f, BaseException)]
    if errors:
        for g in gens:
            await g.aclose()
        raise errors[0]
    return firsts


async def _merge(gens: list, firsts: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) as each prompt's outputs come. Closing this early (the client went
    away) cancels the readers, which closes each generator, which aborts its request."""
    if len(gens) == 1:                  # the usual case: no tasks needed
        try:
            yield 0, firsts[0]
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def read(i: int, gen):
        try:
            async for out in gen:
                queue.put_nowait((i, out))
        except Exception as e:         # noqa: BLE001 - raised by the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))

    for i, first in enumerate(firsts):
        queue.put_nowait((i, first))
    tasks = [asyncio.create_task(read(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
