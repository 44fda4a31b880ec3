"""The OpenAI-compatible server with the real SmolLM2: in-process through the ASGI app, and
through a uvicorn socket with httpx and the official openai client. Outputs are compared with
the offline LLM's (the conftest `llm`, built with the same engine arguments)."""
import asyncio
import json
import re
import os
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import pytest
from fastapi.testclient import TestClient

from pagoda import SamplingParams
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.entrypoints.openai.api_server import build_app
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import RequestOutputKind
from tests.conftest import TEST_KV_BYTES

MODEL = "smol"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "My favourite colour is"]
CHAT = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = AsyncLLM.from_engine_args(EngineArgs(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
                                               max_model_len=2048))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, [MODEL])) as c:
        yield c


@pytest.fixture(scope="module")
def base_url(engine):
    """A real uvicorn server on a free port, in a thread."""
    import uvicorn
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, [MODEL]), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)


def sse_events(text: str) -> list:
    """The data events of a Server-Sent Events body; asserts it ends with [DONE]."""
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def wait_until_idle(engine, timeout=20.0):
    end = time.time() + timeout
    while time.time() < end:
        s = engine.stats
        if s.num_running == s.num_waiting == 0 and s.kv_blocks_in_use == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the engine still holds requests or blocks: {engine.stats}")


def test_completions_greedy_equal_llm_generate_with_usage(client, llm):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == [o.outputs[0].text for o in ref]
    assert [c["finish_reason"] for c in body["choices"]] == [o.outputs[0].finish_reason for o in ref]
    prompt_tokens = sum(len(o.prompt_token_ids) for o in ref)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in ref)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}


def test_allowed_token_ids_and_truncated_prompts(client, llm):
    """vLLM's extra request fields: the tokens sampled among allowed_token_ids, the prompt cut to
    its last truncate_prompt_tokens (usage counts what the engine read)."""
    tok = llm.get_tokenizer()
    allowed = sorted({t for w in (" yes", " no") for t in tok.encode(w)})
    body = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 1.0, "seed": 1,
                                                "allowed_token_ids": allowed}).json()
    assert set(tok.encode(body["choices"][0]["text"])) <= set(allowed)
    body = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0,
                                                "truncate_prompt_tokens": 3}).json()
    ref = llm.generate({"prompt_token_ids": tok.encode(PROMPTS[1])[-3:]}, SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0].outputs[0]
    assert body["choices"][0]["text"] == ref.text and body["usage"]["prompt_tokens"] == 3
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "allowed_token_ids": []})
    assert r.status_code == 400 and "allowed_token_ids" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "priority": 1})   # (an fcfs engine)
    assert r.status_code == 400 and "priority scheduling is not enabled" in r.json()["error"]["message"]


def test_token_id_prompt_and_echo(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 6, "temperature": 0, "echo": True})
    choice = r.json()["choices"][0]
    assert choice["text"] == llm.get_tokenizer().decode(ids) + ref.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_greedy_equals_llm_chat(client, llm):
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 24,
                                                   "temperature": 0})
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ref.outputs[0].text}
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.outputs[0].token_ids)


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 20}),
])
def test_stream_deltas_concatenate_to_the_whole_text(client, route, body):
    body = {**body, "temperature": 0}
    whole = client.post(route, json=body).json()
    r = client.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    chunks, usage = events[:-1], events[-1]
    assert len(chunks) > 3 and usage["choices"] == [] and usage["usage"] == whole["usage"]
    if route == "/v1/completions":
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = whole["choices"][0]["text"]
    else:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[0]["object"] == "chat.completion.chunk"
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        expected = whole["choices"][0]["message"]["content"]
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_n_and_seed_reproducible_and_equal_llm(client, llm):
    body = {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0.9, "n": 3, "seed": 11, "ignore_eos": True}
    a, b = (client.post("/v1/completions", json=body).json() for _ in range(2))
    texts = [c["text"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2] and len(set(texts)) > 1
    assert texts == [c["text"] for c in b["choices"]]
    ref = llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=0.9, max_tokens=10, seed=11, ignore_eos=True),
                       use_tqdm=False)[0]
    assert texts == [c.text for c in ref.outputs]
    assert a["usage"]["completion_tokens"] == 30


def test_chat_n_streams_every_choice(client):
    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6, "n": 2, "temperature": 1.0,
                                                   "seed": 3, "ignore_eos": True, "stream": True})
    events = sse_events(r.text)
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant" and mine[-1]["finish_reason"] == "length"


def test_stop_string(client, llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = base[10:14]
    assert stop.strip(), base
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0,
                                              "ignore_eos": True, "stop": [stop, "@@never@@"]})
    choice = r.json()["choices"][0]
    assert choice["text"] == base[:base.index(stop)]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop


def test_logprobs_shapes(client, llm):
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0,
                                              "logprobs": 3, "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for got, tok, want in zip(lp["token_logprobs"], ref.token_ids, ref.logprobs):
        assert got == pytest.approx(want[tok].logprob, abs=1e-4)
    assert all(3 <= len(top) <= 4 for top in lp["top_logprobs"])

    r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                                   "logprobs": True, "top_logprobs": 2}).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for entry in content:
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert top[0]["token"] == entry["token"]           # greedy: the chosen token ranks first
        assert bytes(entry["bytes"]).decode() == entry["token"]
    no_lp = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
    assert no_lp["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("route, body, status, message", [
    ("/v1/completions", {"prompt": "hello " * 3000}, 400, "maximum model length"),
    ("/v1/completions", {"prompt": "hello " * 1000, "max_tokens": 2000}, 400, "maximum context length is 2048"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "gpt-4"),
])
def test_bad_requests_answer_an_openai_error_and_the_server_goes_on(client, engine, route, body, status, message):
    r = client.post(route, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["code"] == status
    assert client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    wait_until_idle(engine)


def test_models_health_version(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 2048
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]


def test_tokenize_and_detokenize(client, engine):
    """/tokenize (vLLM's): a prompt as the tokenizer encodes it, or messages rendered as a chat
    completion renders them (the prompt LLM.chat runs), with the tokens' strings on request;
    /detokenize reads them back; bad bodies answer 400 / 404."""
    tok = engine.tokenizer
    body = client.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert body["tokens"] == tok.encode(PROMPTS[0]) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 2048 and body["token_strs"] == [tok.id_to_token(i) for i in body["tokens"]]
    plain = client.post("/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(PROMPTS[0], add_special_tokens=False) and plain["token_strs"] is None
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == tok.chat_prompt(CHAT, add_generation_prompt=True)["prompt_token_ids"]
    text = client.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == tok.decode(chat["tokens"], skip_special_tokens=False) and "Name three fruits." in text
    for route, body, status, message in [
            ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "Give a prompt or messages"),
            ("/tokenize", {}, 400, "Give a prompt or messages"),
            ("/tokenize", {"prompt": "a", "model": "other"}, 404, "does not exist"),
            ("/detokenize", {"tokens": [1, -3]}, 400, "Token ids must be in"),
            ("/detokenize", {"tokens": [1], "model": "other"}, 404, "does not exist")]:
        r = client.post(route, json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.json()


def test_api_key(engine):
    with TestClient(build_app(engine, [MODEL], api_key="sekrit")) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/health").status_code == 200


def test_concurrent_requests_all_answered(engine, llm):
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]

    async def run():
        transport = httpx.ASGITransport(app=build_app(engine, [MODEL]))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json={
                "prompt": p, "max_tokens": 8, "temperature": 0, "stream": i % 2 == 1}) for i, p in enumerate(prompts)))
        return rs

    rs = asyncio.run(run())
    ref = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    for i, (r, o) in enumerate(zip(rs, ref)):
        assert r.status_code == 200
        text = ("".join(e["choices"][0]["text"] for e in sse_events(r.text)) if i % 2
                else r.json()["choices"][0]["text"])
        assert text == o.outputs[0].text
    wait_until_idle(engine)


def test_async_llm_abort_when_the_caller_leaves(engine):
    before = engine.stats.num_generation_tokens

    async def run():
        gen = engine.generate(PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True,
                                                         output_kind=RequestOutputKind.DELTA), "leaver")
        for _ in range(3):
            assert not (await anext(gen)).finished
        await gen.aclose()

    asyncio.run(run())
    stats = wait_until_idle(engine)
    assert stats.num_generation_tokens - before < 100


def test_cancelled_stream_frees_its_kv_blocks(engine, base_url):
    before = engine.stats.num_generation_tokens
    with httpx.Client(base_url=base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPTS[0] * 20, "max_tokens": 1000,
                                                       "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data: "))
            assert engine.stats.kv_blocks_in_use > 0
    stats = wait_until_idle(engine)
    assert stats.num_generation_tokens - before < 500


def test_client_gone_before_a_whole_response_frees_its_kv_blocks(engine, base_url):
    before = engine.stats.num_generation_tokens
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1000, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=1.5))
    stats = wait_until_idle(engine)
    assert stats.num_generation_tokens - before < 500


def test_metrics_counters_move(client, llm):
    def scrape() -> dict:
        text = client.get("/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    label = f'{{model_name="{MODEL}"}}'
    before = scrape()
    client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 7, "ignore_eos": True})
    after = scrape()
    n_prompt = len(llm.get_tokenizer().encode(PROMPTS[1]))
    assert after[f"vllm:prompt_tokens_total{label}"] - before[f"vllm:prompt_tokens_total{label}"] == n_prompt
    assert after[f"vllm:generation_tokens_total{label}"] - before[f"vllm:generation_tokens_total{label}"] == 7
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count"):
        assert after[name + label] == before.get(name + label, 0) + 1
    # One inter-token latency a step after the first token's, 6 for 7 tokens, together less than
    # the request took: streamed or not (the engine measures them)
    itl, e2e = "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds_sum"
    assert after[f"{itl}_count{label}"] - before.get(f"{itl}_count{label}", 0) == 6
    client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 7, "ignore_eos": True, "stream": True})
    streamed = scrape()
    assert streamed[f"{itl}_count{label}"] - after[f"{itl}_count{label}"] == 6
    assert 0 < streamed[f"{itl}_sum{label}"] - after[f"{itl}_sum{label}"] < streamed[e2e + label] - after[e2e + label]
    key = f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}}'
    assert after[key] == before.get(key, 0) + 1
    assert after[f"vllm:num_requests_running{label}"] == 0 and f"vllm:kv_cache_usage_perc{label}" in after


def test_openai_client_over_a_socket(base_url, llm):
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=base_url + "/v1", api_key="none")
    assert [m.id for m in c.models.list()] == [MODEL]
    ref = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    chat = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16)
    assert chat.choices[0].message.content == ref.text
    stream = c.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=16, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == ref.text
    comp = c.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=8)
    assert comp.choices[0].text == llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8),
                                                use_tqdm=False)[0].outputs[0].text
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="x", temperature=-2)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt="x")


def start_serve(tmp_path, flags: list[str]) -> tuple[subprocess.Popen, str, object]:
    """`pagoda serve FLAGS` as a subprocess on a free port, once /health answers: (process,
    its URL, its log file)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--port", str(port),
                             "--host", "127.0.0.1", *flags], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + 120
    while time.time() < end:
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    return proc, url, log


def test_pagoda_serve_command(tmp_path):
    """`pagoda serve` as a subprocess: the embedded model under its own name, one completion."""
    proc, url, log = start_serve(tmp_path, ["--max-model-len", "256"])
    try:
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        r = httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_several_api_servers_over_one_engine(tmp_path, llm):
    """`pagoda serve --api-server-count 2`: two API server processes on one port, fronts of one
    engine core. Concurrent completions equal LLM.generate's; every scrape of /metrics, whichever
    server answers it, counts every request (the engine core sends its figures to both); SIGTERM
    stops the supervisor, both servers and the engine core."""
    import concurrent.futures
    proc, url, log = start_serve(tmp_path, ["--max-model-len", "512", "--dtype", "float32", "--api-server-count", "2",
                                            "--served-model-name", MODEL])
    prompts = [f"{p} ({i})" for i in range(3) for p in PROMPTS]
    try:
        children = subprocess.run(["ps", "--ppid", str(proc.pid), "-o", "pid="], capture_output=True,
                                  text=True).stdout.split()
        assert len(children) >= 3             # two API servers and the engine core (and Python's helpers)

        def complete(prompt):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0})
            return r.json()["choices"][0]["text"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(complete, prompts))
        want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        assert texts == [o.outputs[0].text for o in want]
        e2e = f'vllm:e2e_request_latency_seconds_count{{model_name="{MODEL}"}} {len(prompts)}.0'
        for _ in range(6):                    # (a new connection each: either server may answer)
            end = time.time() + 10            # (the other server reads the last step's events a moment later)
            while True:
                metrics = httpx.get(url + "/metrics").text
                success = sum(float(line.split()[-1]) for line in metrics.splitlines()
                              if line.startswith("vllm:request_success_total"))
                if (success == len(prompts) and e2e in metrics) or time.time() > end:
                    break
                time.sleep(0.05)
            assert success == len(prompts) and e2e in metrics
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, (tmp_path / "serve.log").read_text()
        log.close()
    end = time.time() + 20                    # (orphans are reaped by init in a moment)
    while time.time() < end and any(_alive(int(pid)) for pid in children):
        time.sleep(0.2)
    assert not [pid for pid in children if _alive(int(pid))]


def _alive(pid: int) -> bool:
    state = subprocess.run(["ps", "-p", str(pid), "-o", "stat="], capture_output=True, text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


def test_a_slow_reader_gets_the_steps_it_missed_merged(engine, llm):
    """A reader that lags the engine gets one output for the steps it missed: tokens, text and
    logprobs are those of the whole run, in order, and fewer outputs than tokens arrive."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                            output_kind=RequestOutputKind.DELTA)

    async def run():
        outs = []
        async for out in engine.generate(PROMPTS[1], params, "slow-reader"):
            outs.append(out)
            await asyncio.sleep(0.3)         # several engine steps on the CPU
        return outs

    outs = asyncio.run(run())
    ref = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    assert len(outs) < 24 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert [t for o in outs for t in o.outputs[0].token_ids] == ref.token_ids
    assert "".join(o.outputs[0].text for o in outs) == ref.text
    merged = [lp for o in outs for lp in o.outputs[0].logprobs]
    assert [sorted(lp) for lp in merged] == [sorted(lp) for lp in ref.logprobs]
    assert outs[-1].outputs[0].finish_reason == "length"


def test_a_slow_reader_of_cumulative_outputs_gets_the_latest(engine, llm):
    """Cumulative outputs are not merged: a lagging reader's next output is the latest one, so
    its last is the whole run (it had all its chunks concatenated when this was wrong)."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)      # CUMULATIVE

    async def run():
        outs = []
        async for out in engine.generate(PROMPTS[1], params, "slow-cumulative"):
            outs.append(out)
            await asyncio.sleep(0.3)
        return outs

    outs = asyncio.run(run())
    ref = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert len(outs) < 24 and outs[-1].finished
    assert outs[-1].outputs[0].token_ids == ref.token_ids and outs[-1].outputs[0].text == ref.text


def test_request_output_add_folds_deltas():
    def delta(tokens, text, finish=None, lps=None, index=0):
        return CompletionOutput(index, text, tokens, -1.0 * len(tokens), lps, finish)

    a = RequestOutput("r", None, [1], None, [delta([5], "a", lps=[{5: Logprob(-0.5)}])], False)
    a.add(RequestOutput("r", None, [1], None, [delta([6, 7], "bc", lps=[{6: Logprob(-1)}, {7: Logprob(-2)}]),
                                               delta([9], "z", index=1)], False))
    a.add(RequestOutput("r", None, [1], None, [delta([8], "d", "length", lps=[{8: Logprob(-3)}])], True))
    first, second = a.outputs
    assert (first.token_ids, first.text, first.finish_reason, a.finished) == ([5, 6, 7, 8], "abcd", "length", True)
    assert [list(lp) for lp in first.logprobs] == [[5], [6], [7], [8]] and first.cumulative_logprob == -1.0
    assert (second.index, second.token_ids, second.text) == (1, [9], "z")


def test_w3_client_streams_every_token(base_url):
    """benchmarks/serve.py's client (raw asyncio streams) against a real server: every request
    completes with its max_tokens, and the latencies it reports are consistent."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import serve
    args = types.SimpleNamespace(base_url=base_url, served_model_name=MODEL, seed=0, slo_ttft_ms=1e9, slo_tpot_ms=1e9)
    prompts, lens = [[5, 6, 7], list(range(10, 40)), [300, 2, 41, 9]], [6, 9, 3]
    row = asyncio.run(serve.run_rate(args, float("inf"), prompts, lens))
    assert row["completed"] == 3 and not row["errors"]
    assert row["output_tok_s"] * row["duration_s"] == pytest.approx(sum(lens))
    assert 0 < row["ttft_ms"]["p50"] <= row["e2e_ms"]["p50"] and row["tpot_ms"]["p50"] > 0
    wrong_model = types.SimpleNamespace(**{**vars(args), "served_model_name": "nope"})
    bad = asyncio.run(serve.run_rate(wrong_model, float("inf"), prompts[:1], [4]))
    assert bad["completed"] == 0 and "HTTP 404" in bad["errors"][0]


def test_w3_runs_share_no_prompts():
    """Each of benchmarks/serve.py's runs sends prompts of the same lengths with new token ids:
    a prompt sent again would be served from the prefix cache without its prefill (the sixteenth
    session's W3 runs at their second and third rates were)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import serve
    prompts = [list(range(n)) for n in (3, 40, 17)]
    a, b = serve.fresh_token_ids(prompts, 1000, 1), serve.fresh_token_ids(prompts, 1000, 2)
    assert [len(p) for p in a] == [len(p) for p in b] == [3, 40, 17]
    assert all(0 <= t < 1000 for p in a + b for t in p)
    assert all(pa[:3] != pb[:3] for pa, pb in zip(a, b)) and a == serve.fresh_token_ids(prompts, 1000, 1)


def test_structured_outputs_over_http(client):
    """response_format (json_schema, json_object) in chat, vLLM's structured_outputs and
    guided_choice in completions; malformed ones answer 400."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city"}
    r = client.post("/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8, "temperature": 1.0, "seed": 1,
                                             "guided_choice": ["red", "blue"], "n": 3})
    assert {c["text"] for c in r.json()["choices"]} <= {"red", "blue"}
    r = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12,
                                             "structured_outputs": {"regex": "[A-Z][a-z]+"}})
    assert re.fullmatch("[A-Z][a-z]+", r.json()["choices"][0]["text"])
    for body, message in [({"response_format": {"type": "xml"}}, "Unknown response_format type"),
                          ({"structured_outputs": {"regx": "a"}}, "Unknown structured_outputs field"),
                          ({"guided_regex": "[0-9"}, "unclosed character class"),
                          ({"guided_regex": "a", "guided_choice": ["a"]}, "exactly one")]:
        r = client.post("/v1/completions", json={"prompt": PROMPTS[0], **body})
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)


def test_forced_tool_calls_from_the_real_model(client):
    """SmolLM2 held to the calls' schema: a named function's arguments and "required"'s calls
    parse and name the request's tools."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}]
    base = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": tools,
            "max_tokens": 200, "temperature": 0}
    r = client.post("/v1/chat/completions", json={**base, "tool_choice": {"type": "function",
                                                                         "function": {"name": "get_weather"}}})
    call = r.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}
    r = client.post("/v1/chat/completions", json={**base, "tool_choice": "required"})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]][:1] == ["get_weather"]
    # Streamed, the same calls: names first, then their arguments as the model writes them
    from tests.test_tool_calls import _names_args, _summed
    text = client.post("/v1/chat/completions", json={**base, "tool_choice": "required", "stream": True}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert _names_args(_summed(deltas)) == _names_args(choice["message"]["tool_calls"])
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def embed_server(smollm_path):
    """A server of the pooling runner (`pagoda serve --runner pooling`), in-process."""
    eng = AsyncLLM.from_engine_args(EngineArgs(smollm_path, runner="pooling", dtype="float32",
                                               kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512))
    with TestClient(build_app(eng, [MODEL])) as c:
        yield c, eng
    eng.shutdown()


def test_embeddings_equal_llm_embed(embed_server, smollm_path):
    """/v1/embeddings: each input's vector as LLM.embed gives it, in input order, as floats or
    base64 (little-endian float32, as OpenAI's client decodes it), cut to `dimensions`."""
    import base64

    import numpy as np

    from pagoda import LLM
    client, engine = embed_server
    offline = LLM(smollm_path, runner="pooling", dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
                  max_model_len=512)
    expected = offline.embed(PROMPTS, use_tqdm=False)
    want, lengths = [o.outputs.embedding for o in expected], [len(o.prompt_token_ids) for o in expected]
    del offline
    body = client.post("/v1/embeddings", json={"model": MODEL, "input": PROMPTS}).json()
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("embd-")
    assert [d["index"] for d in body["data"]] == [0, 1, 2] and {d["object"] for d in body["data"]} == {"embedding"}
    for d, w in zip(body["data"], want):
        assert np.allclose(d["embedding"], w, atol=1e-5)
    assert body["usage"] == {"prompt_tokens": sum(lengths), "total_tokens": sum(lengths)}
    b64 = client.post("/v1/embeddings", json={"input": PROMPTS[0], "encoding_format": "base64"}).json()
    assert np.allclose(np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4"), want[0], atol=1e-5)
    cut = client.post("/v1/embeddings", json={"input": [[1, 2, 3, 4]], "dimensions": 32}).json()
    assert len(cut["data"][0]["embedding"]) == 32
    assert np.linalg.norm(cut["data"][0]["embedding"]) == pytest.approx(1.0, abs=1e-5)
    wait_until_idle(engine)


def test_embeddings_errors(embed_server, client):
    embed_client, engine = embed_server
    r = client.post("/v1/embeddings", json={"input": "Hello"})          # a generating server
    assert r.status_code == 400 and "--runner pooling" in r.json()["error"]["message"]
    for body, status, message in [
            ({"input": "Hi", "model": "nope"}, 404, "does not exist"),
            ({"input": []}, 400, "input must not be empty"),
            ({"input": [[5] * 600]}, 400, "longer than the maximum model length"),
            ({"input": "Hi", "dimensions": 100_000}, 400, "more than the model's hidden size"),
            ({"input": "Hi", "dimensions": 0}, 400, "dimensions must be at least 1"),
            ({"input": "Hi", "encoding_format": "int8"}, 400, "encoding_format")]:
        r = embed_client.post("/v1/embeddings", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.json()
    r = embed_client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"]
    wait_until_idle(engine)


def test_score_equals_llm_score(embed_server, smollm_path):
    """/v1/score (and /score): one text against several, or pairwise, as LLM.score gives them;
    /rerank orders the documents by those scores (an embedding model's: cosines)."""
    from pagoda import LLM
    client, engine = embed_server
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Bananas are yellow."]
    offline = LLM(smollm_path, runner="pooling", dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES,
                  max_model_len=512)
    want = [o.outputs.score for o in offline.score(query, docs, use_tqdm=False)]
    del offline
    for route in ("/v1/score", "/score"):
        body = client.post(route, json={"model": MODEL, "text_1": query, "text_2": docs}).json()
        assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["score", "score"]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    ranked = client.post("/rerank", json={"query": query, "documents": docs}).json()["results"]
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    pairwise = client.post("/v1/score", json={"text_1": docs, "text_2": docs[::-1]}).json()
    assert pairwise["data"][0]["score"] == pytest.approx(pairwise["data"][1]["score"], abs=1e-5)
    r = client.post("/v1/score", json={"text_1": [query] * 2, "text_2": docs * 2})
    assert r.status_code == 400 and "as many as text_2" in r.json()["error"]["message"]
    wait_until_idle(engine)
