"""LoRA adapters through the OpenAI-compatible server, as vLLM serves them: ``--lora-modules``
adapters named as the request's model (answers equal LLM.generate's with the same adapter),
/v1/models, bad adapters, vLLM's runtime load / unload routes, and the CLI's flags."""
import argparse
import asyncio
import json
import os

import httpx
import pytest
from fastapi.testclient import TestClient

from pagoda import LLM, SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints import cli
from pagoda.entrypoints.openai.api_server import _app, build_app
from pagoda.entrypoints.openai.serving_models import LoRAModulePath
from pagoda.lora.request import LoRARequest
from tests.conftest import TEST_KV_BYTES
from tests.lora_utils import write_adapter
from tests.test_server import CHAT, MODEL, PROMPTS, wait_until_idle
from tests.test_tensor_parallel import SMALL, write_tiny_llama

ENGINE = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=1024, enable_lora=True,
              max_loras=2, max_lora_rank=8)
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT_IDS = {"prompt_token_ids": [5, 6, 7]}
RUNTIME_FLAGS = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "PAGODA_ALLOW_RUNTIME_LORA_UPDATING")


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = AsyncLLM.from_engine_args(EngineArgs(smollm_path, **ENGINE))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def lora_llm(smollm_path):
    """The offline engine with the server's arguments: the reference answers."""
    llm = LLM(smollm_path, **ENGINE)
    yield llm
    del llm


@pytest.fixture(scope="module")
def adapters(engine, tmp_path_factory) -> dict[str, str]:
    """Two random adapters' folders: every projection at rank 8; q and v at rank 4."""
    arch = engine.model_config.arch
    return {"sql": write_adapter(str(tmp_path_factory.mktemp("sql")), arch, seed=1),
            "poem": write_adapter(str(tmp_path_factory.mktemp("poem")), arch, r=4, targets=("q_proj", "v_proj"),
                                  seed=2, scale=0.3)}


def modules(adapters: dict[str, str]) -> list[LoRAModulePath]:
    """``--lora-modules sql=PATH '{"name": "poem", ...}'``: ids 1 and 2 in every app here (the apps
    share one engine, where an id names one adapter)."""
    return [LoRAModulePath("sql", adapters["sql"]), LoRAModulePath("poem", adapters["poem"], MODEL)]


@pytest.fixture(scope="module")
def client(engine, adapters):
    app = build_app(engine, [MODEL], lora_modules=modules(adapters))
    asyncio.run(app.state.models.init_static_loras())
    with TestClient(app) as c:
        yield c


def lora_app(engine, adapters, monkeypatch, flag: str | None = "1"):
    """The server, its runtime routes on with ``flag`` (None: the variable unset)."""
    for name in RUNTIME_FLAGS:
        monkeypatch.delenv(name, raising=False)
    if flag is not None:
        monkeypatch.setenv(RUNTIME_FLAGS[0], flag)
    return build_app(engine, [MODEL], lora_modules=modules(adapters))


def complete(client, model: str, prompts=PROMPTS) -> list[str]:
    r = client.post("/v1/completions", json={"model": model, "prompt": prompts, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return [c["text"] for c in r.json()["choices"]]


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_an_adapter_named_as_the_model_answers_as_llm_generate(client, lora_llm, adapters):
    """Completions and chat with model=<adapter> give LLM.generate / chat's greedy answers with
    that adapter; the base model's name runs without one (other answers)."""
    params = SamplingParams(**GREEDY)
    base = complete(client, MODEL)
    for i, name in enumerate(("sql", "poem")):
        lora = LoRARequest(name, i + 1, adapters[name])
        assert complete(client, name) == texts(lora_llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora))
        assert complete(client, name) != base
        r = client.post("/v1/chat/completions", json={"model": name, "messages": CHAT, **GREEDY})
        want = lora_llm.chat(CHAT, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    assert base == texts(lora_llm.generate(PROMPTS, params, use_tqdm=False))
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and "`nope` does not exist" in r.json()["error"]["message"]


def test_models_lists_the_adapters_after_the_base_model(client, adapters):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, "sql", "poem"]
    for m in data[1:]:
        assert (m["object"], m["root"], m["parent"]) == ("model", adapters[m["id"]], MODEL)
    assert [lora.lora_int_id for lora in client.app.state.models.lora_requests.values()] == [1, 2]
    assert client.post("/tokenize", json={"model": "sql", "prompt": "Hi"}).status_code == 200


def test_a_bad_adapter_is_refused_with_the_engines_reason(engine, adapters, tmp_path):
    """At start-up (`pagoda serve`'s check) a bad --lora-modules folder raises its ValueError; a
    request naming one that was not checked answers 400, and the engine goes on."""
    bad = modules(adapters) + [LoRAModulePath("bad", str(tmp_path / "missing"))]
    args = argparse.Namespace(served_model_name=[MODEL], model=None, api_key=None, enable_auto_tool_choice=False,
                              tool_call_parser=None, lora_modules=bad, reasoning_parser=None)
    with pytest.raises(ValueError, match="--lora-modules bad: No LoRA adapter at .*adapter_config.json"):
        _app(engine, args)
    with pytest.raises(ValueError, match="is the base model's"):
        build_app(engine, [MODEL], lora_modules=[LoRAModulePath(MODEL, adapters["sql"])])
    with TestClient(build_app(engine, [MODEL], lora_modules=bad)) as c:
        r = c.post("/v1/completions", json={"model": "bad", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 400 and "No LoRA adapter at" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    wait_until_idle(engine)


def test_load_use_unload(engine, lora_llm, adapters, monkeypatch, tmp_path):
    """vLLM's runtime routes: a load the engine checks (400: a bad folder, a name taken), its
    requests, an unload refused while one runs, then 404 for the name."""
    app = lora_app(engine, adapters, monkeypatch)
    load = {"lora_name": "poem2", "lora_path": adapters["poem"]}

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
            assert r.status_code == 400 and "No LoRA adapter at" in r.json()["error"]["message"]
            r = await c.post("/v1/load_lora_adapter", json=load)
            assert r.status_code == 200 and "poem2" in r.text
            r = await c.post("/v1/load_lora_adapter", json=load)
            assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
            r = await c.post("/v1/completions", json={"model": "poem2", "prompt": PROMPTS, **GREEDY})
            got = [choice["text"] for choice in r.json()["choices"]]
            assert "poem2" in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
            # A request in the engine holds the adapter.
            lora = app.state.models.lora_requests["poem2"]
            gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True), "held", lora)
            await anext(gen)
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "poem2"})
            assert r.status_code == 400 and "still has requests" in r.json()["error"]["message"]
            await gen.aclose()
            assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "poem2"})).status_code == 200
            r = await c.post("/v1/completions", json={"model": "poem2", "prompt": "Hi"})
            assert r.status_code == 404
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "poem2"})
            assert r.status_code == 404 and "cannot be found" in r.json()["error"]["message"]
            assert lora.lora_int_id not in await engine.list_loras()
        return got

    got = asyncio.run(run())
    poem = LoRARequest("poem", 2, adapters["poem"])         # (the same folder)
    assert got == texts(lora_llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False, lora_request=poem))
    wait_until_idle(engine)


@pytest.mark.parametrize("flag", [None, "0", "false"])
def test_runtime_routes_only_with_the_variable(engine, adapters, monkeypatch, flag):
    with TestClient(lora_app(engine, adapters, monkeypatch, flag)) as c:
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/p"}).status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    cli.add_engine_args(parser)
    return parser.parse_args(argv)


def test_cli_lora_flags(capsys, monkeypatch):
    """`pagoda serve`'s --lora-modules in both of vLLM's forms; refused without --enable-lora, and
    with runtime updating over several API servers."""
    args = parse_serve(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules", "sql=/a/b",
                        '{"name": "poem", "path": "/c", "base_model_name": "smol"}'])
    assert args.lora_modules == [LoRAModulePath("sql", "/a/b"), LoRAModulePath("poem", "/c", "smol")]
    engine_args = cli.engine_args_from(args)
    assert (engine_args.enable_lora, engine_args.max_loras, engine_args.max_lora_rank) == (True, 3, 32)
    for bad, message in [("sql", "expected NAME=PATH"), ('{"name": "x"}', "with \"name\" and \"path\""),
                         ('{"name": "x", "path": "/p", "rank": 4}', "rank")]:
        with pytest.raises(SystemExit):
            parse_serve(["--lora-modules", bad])
        assert message in capsys.readouterr().err
    assert cli.main(["serve", "--lora-modules", "sql=/a"]) == 1
    assert "pagoda: error: --lora-modules needs --enable-lora." in capsys.readouterr().err
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert cli.main(["serve", "--enable-lora", "--api-server-count", "2"]) == 1
    assert "needs a single API server" in capsys.readouterr().err


def test_data_parallel_engine_cores(tmp_path):
    """`pagoda serve -dp 2`'s engine cores: an adapter is checked by both (either may get its
    requests), runs the same on both, and is removed from both once no request uses it."""
    tiny = write_tiny_llama(str(tmp_path / "tiny"))
    with open(os.path.join(tiny, "config.json")) as f:
        lora = LoRARequest("a", 1, write_adapter(str(tmp_path / "a"), json.load(f), r=4, scale=0.5))
    engine = AsyncLLM.from_engine_args(EngineArgs(tiny, data_parallel_size=2, enable_lora=True, max_lora_rank=8,
                                                  **SMALL))

    async def greedy(i: int, adapter):
        outs = [o async for o in engine.generate(PROMPT_IDS, SamplingParams(max_tokens=8, temperature=0), f"r{i}",
                                                 adapter)]
        return outs[-1].outputs[0].token_ids

    async def run():
        assert await engine.add_lora(lora)
        assert [await engine._call("list_loras", core=d) for d in range(2)] == [{1}, {1}]
        # (started together, the requests alternate between the cores: each runs one of either)
        answers = await asyncio.gather(*(greedy(i, lora if i >= 2 else None) for i in range(4)))
        held = engine.generate(PROMPT_IDS, SamplingParams(max_tokens=200, ignore_eos=True), "held", lora)
        await anext(held)
        with pytest.raises(ValueError, match="still has requests"):
            await engine.remove_lora(1)
        await held.aclose()
        assert await engine.remove_lora(1) and await engine.list_loras() == set()
        return answers

    try:
        base, _, adapted, _ = answers = asyncio.run(run())
        assert answers == [base, base, adapted, adapted] and base != adapted
    finally:
        engine.shutdown()
