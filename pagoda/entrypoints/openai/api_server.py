"""The OpenAI-compatible HTTP server, as vLLM's ``vllm serve``:

  pagoda serve [MODEL] --port 8000 [--api-server-count N]
  python -m pagoda.entrypoints.openai.api_server --model MODEL

Endpoints: /v1/completions, /v1/chat/completions (tool calls with --enable-auto-tool-choice
--tool-call-parser hermes, llama3_json, mistral, pythonic, qwen3_coder, granite or
phi4_mini_json; the thinking apart with --reasoning-parser qwen3 or deepseek_r1), /v1/embeddings,
/classify,
/v1/score, /rerank and /pooling (with --runner pooling), /tokenize, /detokenize, /v1/models, /health,
/version, /metrics, /start_profile and /stop_profile; with VLLM_SERVER_DEV_MODE=1 (as vLLM) also
/sleep, /wake_up, /is_sleeping and /reset_prefix_cache; with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1
/v1/load_lora_adapter and /v1/unload_lora_adapter. A request whose model is a LoRA adapter's name
(--enable-lora --lora-modules NAME=PATH) runs with that adapter."""
import argparse
import asyncio
import logging
import multiprocessing as mp
import os
import signal
import socket
from multiprocessing.connection import wait

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagoda
from pagoda.engine.async_llm import AsyncLLM, engine_core_makers
from pagoda.engine.engine_core import EngineCoreProc
from pagoda.engine.llm_engine import EngineAsleepError, load_tokenizer
from pagoda.entrypoints.openai.metrics import ServerMetrics
from pagoda.entrypoints.openai.protocol import (ChatCompletionRequest, ClassificationRequest, CompletionRequest,
                                               DetokenizeRequest, EmbeddingRequest, LoadLoRAAdapterRequest,
                                               PoolingRequest, RerankRequest, ScoreRequest, TokenizeRequest,
                                               UnloadLoRAAdapterRequest)
from pagoda.entrypoints.openai.serving import error_response
from pagoda.entrypoints.openai.serving_chat import OpenAIServingChat
from pagoda.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagoda.entrypoints.openai.serving_embedding import OpenAIServingPooling
from pagoda.entrypoints.openai.serving_models import LoRAModulePath, OpenAIServingModels
from pagoda.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagoda.entrypoints.openai.tool_parsers import TOOL_CALL_PARSERS, check_tool_call_parser
from pagoda.reasoning import check_reasoning_parser

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              lora_modules: list[LoRAModulePath] | None = None, reasoning_parser: str | None = None) -> FastAPI:
    """The server's routes over ``engine``. ``lora_modules``: adapters the requests may name
    (``app.state.models.init_static_loras()`` has the engine check them before serving)."""
    app = FastAPI(title="pagoda", version=pagoda.__version__)
    metrics = ServerMetrics(engine, served_model_names[0])
    models = app.state.models = OpenAIServingModels(engine, served_model_names, lora_modules)
    completion = OpenAIServingCompletion(engine, models)
    chat = OpenAIServingChat(engine, models, enable_auto_tool_choice=enable_auto_tool_choice,
                             tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
    pooling = OpenAIServingPooling(engine, models)
    tokenization = OpenAIServingTokenization(engine, models)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError):
        # OpenAI (and vLLM) answer a malformed body with 400, not FastAPI's 422.
        errors = "; ".join(f"{'.'.join(str(x) for x in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        return error_response(errors, 400)

    @app.exception_handler(EngineAsleepError)
    async def asleep(_: Request, exc: EngineAsleepError):
        return error_response("The engine is asleep: POST /wake_up first.", 503)

    if api_key:
        @app.middleware("http")
        async def check_key(request: Request, call_next):
            if request.url.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {api_key}":
                return error_response("Invalid or missing API key.", 401)
            return await call_next(request)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": pagoda.__version__}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_available_models():
        return models.show_available_models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await _until_disconnected(raw, completion.create(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await _until_disconnected(raw, chat.create(body))

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        return await _until_disconnected(raw, pooling.embed(body))

    @app.post("/v1/score")
    @app.post("/score")
    async def score(body: ScoreRequest, raw: Request):
        return await _until_disconnected(raw, pooling.score(body))

    @app.post("/classify")
    @app.post("/v1/classify")
    async def classify(body: ClassificationRequest, raw: Request):
        return await _until_disconnected(raw, pooling.classify(body))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request):
        return await _until_disconnected(raw, pooling.rerank(body))

    @app.post("/pooling")
    async def pooling_route(body: PoolingRequest, raw: Request):
        return await _until_disconnected(raw, pooling.pool(body))

    @app.post("/start_profile")
    @app.post("/stop_profile")
    async def profile(raw: Request):
        """vLLM's: the torch profiler on the engine's ranks, with $PAGODA_TORCH_PROFILER_DIR set."""
        try:
            await (engine.start_profile() if raw.url.path == "/start_profile" else engine.stop_profile())
        except RuntimeError as e:
            return error_response(str(e), 400)
        return Response(status_code=200)

    if env_flag("SERVER_DEV_MODE"):
        add_dev_routes(app, engine)
    if env_flag("ALLOW_RUNTIME_LORA_UPDATING"):
        add_lora_routes(app, models)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return tokenization.detokenize(body)

    return app


def env_flag(name: str) -> bool:
    """vLLM's switch VLLM_<name> (or PAGODA_<name>): on unless unset, empty, 0 or false."""
    value = os.environ.get(f"VLLM_{name}", os.environ.get(f"PAGODA_{name}", ""))
    return value.strip().lower() not in ("", "0", "false")


def add_dev_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """vLLM's development routes (sleep mode and the prefix cache), which any client could use
    to stop the service: only with VLLM_SERVER_DEV_MODE=1 (or PAGODA_SERVER_DEV_MODE=1).
    ``POST /sleep?level=1``, ``POST /wake_up`` (``?tags=weights&tags=kv_cache``: some; all by
    default), ``GET /is_sleeping``, ``POST /reset_prefix_cache``. Refused calls (sleep mode off,
    requests running, a bad level or tag) answer 400 and say why."""

    async def answer(call) -> Response:
        try:
            await call
        except (ValueError, RuntimeError) as e:
            return error_response(str(e), 400)
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(raw: Request):
        level = raw.query_params.get("level", "1")
        if not level.isdigit():
            return error_response(f"level must be 1 or 2, got {level!r}.", 400, "level")
        return await answer(engine.sleep(int(level)))

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        return await answer(engine.wake_up(raw.query_params.getlist("tags") or None))

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": await engine.is_sleeping()}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        async def reset():
            if not await engine.reset_prefix_cache():
                raise RuntimeError("The prefix cache was not reset: it resets only when no request holds blocks.")
        return await answer(reset())


def add_lora_routes(app: FastAPI, models: OpenAIServingModels) -> None:
    """vLLM's runtime LoRA updating, which lets any client have the server read a folder of its
    disk: only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or PAGODA_ALLOW_RUNTIME_LORA_UPDATING=1).
    ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` (400: the engine's reason, or a
    name taken), ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (404: unknown; 400: requests
    still use it)."""
    logger.warning("LoRA adapters may be loaded and unloaded through the API: use this for local development only.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        return await models.load_lora_adapter(body)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return await models.unload_lora_adapter(body)


async def _until_disconnected(raw: Request, handler):
    """Run ``handler``; if the client goes away first, cancel it (which aborts its requests). A
    stream is watched by its StreamingResponse once it has started."""
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_disconnected(raw))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=499)        # nobody reads it; nginx's "client closed request"
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def served_names(args) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        return [args.model]
    from pagoda.model.hub import default_model_path
    return [os.path.basename(default_model_path()).split(".")[0]]     # SmolLM2-135M-Instruct


def run_server(args) -> None:
    import uvicorn

    from pagoda.entrypoints.cli import engine_args_from
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (known: "
                         f"{', '.join(TOOL_CALL_PARSERS)}).")
    check_tool_call_parser(args.tool_call_parser)
    check_reasoning_parser(args.reasoning_parser)
    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora.")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}.")
    if args.api_server_count > 1 and env_flag("ALLOW_RUNTIME_LORA_UPDATING"):
        # Each API server keeps its own names and ids: an adapter loaded through one would be
        # unknown to the others, and two could give one id to different adapters.
        raise ValueError("VLLM_ALLOW_RUNTIME_LORA_UPDATING needs a single API server (--api-server-count 1).")
    if args.api_server_count > 1:
        run_api_servers(args, engine_args_from(args))
        return
    engine = AsyncLLM.from_engine_args(engine_args_from(args))
    try:
        uvicorn.run(_app(engine, args), host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        engine.shutdown()


def _app(engine: AsyncLLM, args) -> FastAPI:
    """The app, its --lora-modules adapters checked by the engine (a bad one raises its
    ValueError before the server listens)."""
    app = build_app(engine, served_names(args), args.api_key, args.enable_auto_tool_choice, args.tool_call_parser,
                    args.lora_modules, args.reasoning_parser)
    asyncio.run(app.state.models.init_static_loras())
    return app


def run_api_servers(args, engine_args) -> None:
    """``--api-server-count N``: N API servers, each a process of its own with its own event
    loop, accepting on one listening socket (the kernel hands each connection to one of them),
    fronts of the same engine cores over a pipe each. This process only supervises: when a
    server or a core exits, or on Ctrl-C / SIGTERM, it stops them all."""
    if os.environ.get("PAGODA_ENGINE_PROCESS", "1") == "0":
        raise ValueError("--api-server-count needs the engine in a process of its own (PAGODA_ENGINE_PROCESS=0 "
                         "keeps it on a thread of the one server).")
    n = args.api_server_count
    ctx = mp.get_context("spawn")
    make_engines, envs = engine_core_makers(engine_args)
    pipes = [[ctx.Pipe() for _ in range(n)] for _ in make_engines]   # [core][server]: (core end, server end)
    sock = socket.create_server((args.host, args.port))
    cores, servers = [], []
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        for d, make_engine in enumerate(make_engines):
            cores.append(EngineCoreProc(make_engine, None, d, envs[d] if envs else None, [p[0] for p in pipes[d]]))
        infos = [core.wait_ready() for core in cores]
        for i in range(n):
            server = ctx.Process(target=_api_server_main, name=f"pagoda-api-server{i}",
                                 args=(args, engine_args, sock, [p[i][1] for p in pipes], infos[0]))
            server.start()
            servers.append(server)
        for conn in (c for per_core in pipes for pair in per_core for c in pair):
            conn.close()                  # (the processes that use them have their own)
        logger.info("%d API servers on http://%s:%d", n, args.host, args.port)
        wait([p.sentinel for p in servers] + [core.procs[0].sentinel for core in cores])
    except KeyboardInterrupt:
        pass
    finally:
        for server in servers:
            server.terminate()            # (uvicorn's graceful shutdown)
        for server in servers:
            server.join(timeout=10)
            if server.is_alive():
                server.kill()
        for core in cores:
            core.shutdown()
        sock.close()


def _exit_on_signal(signum, frame):
    raise KeyboardInterrupt


def _api_server_main(args, engine_args, sock, conns: list, info: tuple) -> None:
    """One API server of several: its own front of the engine cores, on the shared socket."""
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    engine = AsyncLLM.connect(conns, info, load_tokenizer(engine_args, info[0].path))
    try:
        uvicorn.Server(uvicorn.Config(_app(engine, args), log_level=args.uvicorn_log_level)).run(sockets=[sock])
    finally:
        engine.shutdown()


def main(argv=None) -> None:
    from pagoda.entrypoints.cli import add_engine_args, add_serve_args
    parser = argparse.ArgumentParser(prog="python -m pagoda.entrypoints.openai.api_server",
                                     description="pagoda's OpenAI-compatible server")
    add_serve_args(parser)
    add_engine_args(parser)
    run_server(parser.parse_args(argv))


if __name__ == "__main__":
    main()
