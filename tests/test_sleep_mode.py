"""vLLM's sleep mode (LLM.sleep / wake_up, enable_sleep_mode=True): an idle engine frees its KV
cache and moves its weights to the host (level 1) or drops them (level 2, new ones loaded after
waking them, as an RL trainer does); after wake_up it generates what it did before. In one
process (on the default device: the GPU's CUDA graphs freed and captured again there) and over
tensor-parallel ranks and data-parallel replicas (CPU)."""
import gc
import weakref

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.loader import iter_safetensors, load_weights
from tests.conftest import TEST_KV_BYTES
from tests.test_architectures import save_tiny
from tests.test_tensor_parallel import write_tiny_llama

SMALL = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
             enable_sleep_mode=True)
# (the second fills two blocks: the prefix cache would hold them but for sleep's reset)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": list(range(9, 45))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


def kv_cache_and_weight_sizes(worker) -> tuple[int, int]:
    runner = worker.runner
    return len(runner.kv_caches), sum(p.numel() for m in runner._models() for p in m.parameters())


def reload_weights(worker, folder):
    """An RL trainer's weight update, on each rank (the loaders shard them)."""
    load_weights(worker.runner.model, iter_safetensors(folder))


def poison_kv_cache(worker):
    """What a cache allocated over reused memory may hold: NaN in every block but the null one
    (block 0, zeroed at allocation). A block handed out is zeroed first (the torch path) or read
    under masks (the Triton kernels)."""
    for cache in worker.runner.kv_caches:
        cache[:, 1:] = float("nan")


def greedy(llm) -> list:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("layout", [{}, {"tensor_parallel_size": 2, "device": "cpu"},
                                    {"data_parallel_size": 2, "device": "cpu"}, {"draft_model": True}])
def test_sleep_and_wake_up(tmp_path, layout):
    """(With a draft model, here the model itself, its weights move to the host at either level
    and come back with the target's: the caller reloads the target's only.)"""
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    if layout.get("draft_model"):
        layout = {"speculative_config": {"model": folder, "num_speculative_tokens": 2}}
    llm = LLM(folder, **SMALL, **layout)
    try:
        want = greedy(llm)
        awake = llm.collective_rpc(kv_cache_and_weight_sizes)
        assert all(n == (4 if layout.get("speculative_config") else 2) and size > 0 for n, size in awake)
        llm.sleep(level=1)
        assert llm.is_sleeping() and all(s == (0, 0) for s in llm.collective_rpc(kv_cache_and_weight_sizes))
        with pytest.raises(RuntimeError, match="asleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.wake_up()
        assert not llm.is_sleeping() and llm.collective_rpc(kv_cache_and_weight_sizes) == awake
        llm.collective_rpc(poison_kv_cache)
        assert greedy(llm) == want and llm.get_stats().prefix_cache_hits == 0
        llm.sleep(level=2)                              # the weights dropped: new ones loaded
        llm.wake_up(["weights"])
        llm.collective_rpc(reload_weights, args=(folder,))
        llm.wake_up(["kv_cache"])
        llm.collective_rpc(poison_kv_cache)
        assert greedy(llm) == want and llm.get_stats().prefix_cache_hits == 0
        assert greedy(llm) == want and llm.get_stats().prefix_cache_hits > 0     # (awake, the cache works)
    finally:
        del llm
        gc.collect()


def test_sleep_mode_errors(tmp_path):
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    llm = LLM(folder, **{**SMALL, "enable_sleep_mode": False, "device": "cpu"})
    try:
        with pytest.raises(RuntimeError, match="enable_sleep_mode=True"):
            llm.sleep()
    finally:
        del llm
        gc.collect()
    llm = LLM(folder, device="cpu", **SMALL)
    try:
        want = greedy(llm)
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level=3)
        llm.llm_engine.add_request("r", PROMPTS[0], GREEDY)
        with pytest.raises(RuntimeError, match="only when idle; 1 requests"):
            llm.sleep()
        while llm.llm_engine.has_unfinished_requests():
            llm.llm_engine.step()
        llm.sleep(level=2)
        with pytest.raises(RuntimeError, match="asleep already"):
            llm.sleep()
        with pytest.raises(RuntimeError, match="wakes after the weights"):
            llm.wake_up(["kv_cache"])
        with pytest.raises(ValueError, match="Unknown wake_up tags"):
            llm.wake_up(["cache"])
        llm.wake_up(["weights"])
        llm.collective_rpc(reload_weights, args=(folder,))
        llm.wake_up()
        assert greedy(llm) == want
        assert torch.is_tensor(llm.llm_engine.executor.runner.kv_caches[0])
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("arch, extra", [("llama", {}), ("qwen3_moe", {}), ("llama", {"enable_lora": True})])
def test_dropped_engine_frees_its_memory(tmp_path, arch, extra):
    """An RL trainer or a benchmark drops an engine and builds another (or loads HF's model):
    after ``del llm`` every weight and KV cache tensor is gone. (The engine freezes what it holds
    out of the cyclic GC, so a reference cycle through a parameter would keep it for good.)"""
    folder = write_tiny_llama(str(tmp_path / "tiny")) if arch == "llama" else save_tiny(tmp_path, arch)[0]
    cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if cuda else 0
    llm = LLM(folder, **{**SMALL, "enable_sleep_mode": False, **extra})
    greedy(llm)
    runner = llm.llm_engine.executor.runner
    held = [weakref.ref(t) for t in [*runner.model.parameters(), *runner.kv_caches]]
    del llm, runner
    gc.collect()
    assert sum(ref() is not None for ref in held) == 0
    if cuda:
        assert torch.cuda.memory_allocated() - before < 1 << 20


class Cyclic:
    def __init__(self):
        self.me, self.data = self, torch.zeros(1000)


def test_callers_cycles_freed_after_the_engine(tmp_path):
    """The engine freezes the process's objects out of the cyclic GC at start-up; a cycle of the
    caller's that was alive then and dies while the engine runs is freed once the engine is."""
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    cycle = Cyclic()
    held = weakref.ref(cycle.data)
    llm = LLM(folder, **{**SMALL, "enable_sleep_mode": False, "device": "cpu"})
    del cycle
    gc.collect()
    assert held() is not None          # (frozen: why the engine unfreezes when it goes)
    greedy(llm)
    del llm
    gc.collect()
    assert held() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's memory: CUDA only")
def test_sleep_frees_gpu_memory(tmp_path):
    """Asleep, the KV cache (256 MiB here), the weights and the graphs' memory are given back
    (what stays is the runner's input buffers); awake, as much is taken again, and the outputs
    are the same."""
    folder = write_tiny_llama(str(tmp_path / "tiny"), hidden=256, intermediate=512, vocab=4093)
    llm = LLM(folder, **{**SMALL, "kv_cache_memory_bytes": 256 << 20})
    try:
        want = greedy(llm)
        weights = sum(4 * size for _, size in llm.collective_rpc(kv_cache_and_weight_sizes))
        torch.cuda.synchronize()
        awake = torch.cuda.memory_allocated()
        llm.sleep()
        asleep = torch.cuda.memory_allocated()
        assert awake - asleep >= (256 << 20) + weights, (awake, asleep, weights)
        llm.wake_up()
        assert abs(torch.cuda.memory_allocated() - awake) < 32 << 20
        assert greedy(llm) == want
    finally:
        del llm
        gc.collect()


def test_server_dev_routes(smollm_path, monkeypatch):
    """vLLM's /sleep, /wake_up, /is_sleeping and /reset_prefix_cache, only with
    VLLM_SERVER_DEV_MODE=1; a request while asleep answers 503 and the engine goes on."""
    pytest.importorskip("fastapi", reason="the server's extra (fastapi) is not installed")
    from fastapi.testclient import TestClient

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app
    args = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=256)
    body = {"prompt": "Paris is the capital of France. " * 6, "max_tokens": 6, "temperature": 0}   # (3 blocks)
    engine = AsyncLLM.from_engine_args(EngineArgs(smollm_path, enable_sleep_mode=True, **args))
    try:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
        monkeypatch.delenv("PAGODA_SERVER_DEV_MODE", raising=False)
        with TestClient(build_app(engine, ["m"])) as client:
            assert client.post("/sleep").status_code == 404         # not without the dev mode
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
        with TestClient(build_app(engine, ["m"])) as client:
            want = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            assert len(want) > 5
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            for query, message in [("?level=3", "level must be 1"), ("?level=one", "level must be 1")]:
                r = client.post("/sleep" + query)
                assert r.status_code == 400 and message in r.json()["error"]["message"]
            assert client.post("/sleep?level=1").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": True}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 503 and "asleep" in r.json()["error"]["message"]
            r = client.post("/sleep")
            assert r.status_code == 400 and "asleep already" in r.json()["error"]["message"]
            r = client.post("/wake_up?tags=cache")
            assert r.status_code == 400 and "Unknown wake_up tags" in r.json()["error"]["message"]
            assert client.post("/wake_up?tags=weights&tags=kv_cache").status_code == 200
            assert client.get("/is_sleeping").json() == {"is_sleeping": False}
            assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
            assert engine.stats.kv_blocks_cached > 0
            assert client.post("/reset_prefix_cache").status_code == 200
            assert engine.stats.kv_blocks_cached == 0
        no_sleep = AsyncLLM.from_engine_args(EngineArgs(smollm_path, **args))
        try:
            with TestClient(build_app(no_sleep, ["m"])) as client:
                r = client.post("/sleep")
                assert r.status_code == 400 and "enable_sleep_mode=True" in r.json()["error"]["message"]
        finally:
            no_sleep.shutdown()
    finally:
        engine.shutdown()
