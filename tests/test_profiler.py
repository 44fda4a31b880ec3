"""vLLM's LLM.start_profile / stop_profile and the server's /start_profile, /stop_profile: the
torch profiler on every rank, one trace a rank in $PAGODA_TORCH_PROFILER_DIR holding the step's
operators; refused by name without the folder, or out of order."""
import gc
import glob
import gzip
import json

import pytest

from pagoda import LLM, SamplingParams
from tests.test_tensor_parallel import write_tiny_llama

SMALL = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
             device="cpu")
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def traces(folder) -> list[dict]:
    found = []
    for path in sorted(glob.glob(f"{folder}/*.pt.trace.json.gz")):
        with gzip.open(path) as f:
            found.append(json.load(f))
    return found


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2}])
def test_profile_every_rank(tmp_path, monkeypatch, layout):
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    monkeypatch.delenv("PAGODA_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    llm = LLM(folder, **SMALL, **layout)
    try:
        with pytest.raises(RuntimeError, match="Profiling is off: set PAGODA_TORCH_PROFILER_DIR"):
            llm.start_profile()
        monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))     # (vLLM's name too)
        with pytest.raises(RuntimeError, match="not running: start_profile first"):
            llm.stop_profile()
        llm.start_profile()
        with pytest.raises(RuntimeError, match="running already"):
            llm.start_profile()
        llm.generate(PROMPT, SamplingParams(max_tokens=3), use_tqdm=False)
        llm.stop_profile()
        assert len(llm.generate(PROMPT, SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    finally:
        del llm
        gc.collect()
    found = traces(tmp_path / "traces")
    assert len(found) == layout.get("tensor_parallel_size", 1)
    for trace in found:
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "aten::mm" in names or "aten::addmm" in names or "aten::linear" in names


def test_server_profile_routes(tmp_path, monkeypatch):
    pytest.importorskip("fastapi", reason="the server's extra (fastapi) is not installed")
    from fastapi.testclient import TestClient

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    engine = AsyncLLM.from_engine_args(EngineArgs(folder, **SMALL))
    try:
        with TestClient(build_app(engine, ["m"])) as client:
            monkeypatch.delenv("PAGODA_TORCH_PROFILER_DIR", raising=False)
            monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
            r = client.post("/start_profile")
            assert r.status_code == 400 and "Profiling is off" in r.json()["error"]["message"]
            monkeypatch.setenv("PAGODA_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
            assert client.post("/start_profile").status_code == 200
            body = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}).json()
            assert body["usage"]["completion_tokens"] == 3
            assert client.post("/stop_profile").status_code == 200
            assert client.post("/stop_profile").status_code == 400
    finally:
        engine.shutdown()
    assert len(traces(tmp_path / "traces")) == 1
