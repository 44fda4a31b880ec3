"""Bad input raises a clear error naming the problem, and the same engine keeps working."""
import json
import shutil

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.hub import ModelNotFoundError
from tests.conftest import assert_no_leaks

OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def still_works(llm):
    out = llm.generate("Hello", OK, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert_no_leaks(llm)


@pytest.mark.parametrize("kwargs, match", [
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(temperature=-0.1), "temperature"),
    (dict(n=0), "n must be"), (dict(max_tokens=0), "max_tokens"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-3), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be -1 or at least 1"),
    (dict(bad_words=["ok", " "]), "bad_words must be non-empty strings"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_longer_than_max_model_len(llm):
    limit = llm.llm_engine.config.scheduler.max_model_len
    with pytest.raises(ValueError, match=f"longer than the maximum model length of {limit}"):
        llm.generate({"prompt_token_ids": [5] * (limit + 1)}, OK, use_tqdm=False)
    still_works(llm)


def test_empty_prompts(llm):
    for bad in ("", {"prompt_token_ids": []}):
        with pytest.raises(ValueError, match="empty"):
            llm.generate(bad, OK, use_tqdm=False)
    still_works(llm)


def test_more_logprobs_than_max_logprobs(llm, tmp_path):
    """vLLM's max_logprobs (20 by default) caps a request's sample and prompt logprobs."""
    for kw, what in ((dict(logprobs=21), "sample"), (dict(prompt_logprobs=50), "prompt")):
        with pytest.raises(ValueError, match=f"Requested {what} logprobs of .*max allowed: 20"):
            llm.generate("Hello", SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    still_works(llm)
    from tests.test_tensor_parallel import write_tiny_llama
    tiny = write_tiny_llama(str(tmp_path / "m"))
    small = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=64)
    with pytest.raises(ValueError, match="max_logprobs must be"):
        LLM(tiny, max_logprobs=-2, **small)
    for cap in (-1, 40):
        out = LLM(tiny, max_logprobs=cap, **small).generate({"prompt_token_ids": [3, 4]}, SamplingParams(
            max_tokens=1, logprobs=30), use_tqdm=False)[0].outputs[0]
        assert len(out.logprobs[0]) >= 30


def test_out_of_vocab_token_and_wrong_types(llm):
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate({"prompt_token_ids": [1, 10**7]}, OK, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt must be"):
        llm.generate([3.5], OK, use_tqdm=False)
    for ids in ("some text", [1, "2"], [1.0, 2.0]):
        with pytest.raises(ValueError, match="prompt_token_ids must be a list of integer"):
            llm.generate({"prompt_token_ids": ids}, OK, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [OK, OK, OK], use_tqdm=False)
    still_works(llm)


def test_one_bad_prompt_in_a_batch_releases_the_others(llm):
    limit = llm.llm_engine.config.scheduler.max_model_len
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate(["fine", "also fine", {"prompt_token_ids": [7] * (limit + 5)}], OK, use_tqdm=False)
    assert_no_leaks(llm)
    still_works(llm)


def test_failure_mid_run_frees_everything(llm, monkeypatch):
    runner = llm.llm_engine.executor.runner
    calls = {"n": 0}
    real = runner.execute_model

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(sched)

    monkeypatch.setattr(runner, "execute_model", flaky)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["one", "two", "three"], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert_no_leaks(llm)
    monkeypatch.setattr(runner, "execute_model", real)
    still_works(llm)


def test_failed_step_leaves_no_cached_garbage(llm, monkeypatch):
    """A step that fails before its forward has already indexed the blocks it was to fill:
    no later request may take them as a cached prefix."""
    prompt = {"prompt_token_ids": list(range(200, 260))}                # 3 full blocks
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.reset_prefix_cache()
    expected = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.reset_prefix_cache()
    runner = llm.llm_engine.executor.runner
    real = runner.execute_model

    def fails_before_forward(sched):
        raise RuntimeError("simulated device failure")

    monkeypatch.setattr(runner, "execute_model", fails_before_forward)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(prompt, greedy, use_tqdm=False)
    monkeypatch.setattr(runner, "execute_model", real)
    assert llm.llm_engine.kv_cache_manager.pool.num_cached_blocks == 0
    hits = llm.get_stats().prefix_cache_hits
    out = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected and out.num_cached_tokens == 0
    assert llm.get_stats().prefix_cache_hits == hits
    assert_no_leaks(llm)


def test_abort_running_request_frees_blocks(llm):
    engine = llm.llm_engine
    rid = engine.add_request(None, "Tell me a long story", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache_manager.req_to_blocks
    engine.abort_request(rid)
    assert_no_leaks(llm)
    still_works(llm)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "vocab_size": 10,
        "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}))
    with pytest.raises(ValueError, match="FooForCausalLM.*not supported"):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True)


def test_weights_larger_than_the_device(tmp_path, monkeypatch):
    # As on a GPU with 100 MiB free: the allocation fails, and the error says what would fit.
    import torch

    from pagoda.model import loader
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 1024,
              "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 4, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    build = loader._build

    def out_of_memory(cls, config, device, gguf=None):
        if str(device) != "meta":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return build(cls, config, device, gguf)

    monkeypatch.setattr(loader, "_build", out_of_memory)
    monkeypatch.setattr(loader, "device_memory", lambda device: (100 << 20, 1 << 30))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(0\.19B parameters, 0\.3 GiB in bfloat16\) do not fit "
                                         r"in the 0\.1 GiB free.*at most about 0\.05B parameters would"):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")


def test_missing_and_truncated_weights(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen2")
    weights = next(p for p in (tmp_path / "qwen2").iterdir() if p.suffix == ".safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"{weights.name}.*truncated or corrupt"):
        LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    weights.unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


def test_truncated_gguf(tmp_path, smollm_path):
    bad = tmp_path / "broken.gguf"
    with open(smollm_path, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    with pytest.raises(ValueError, match="broken.gguf"):
        LLM(str(bad))


def test_model_not_found_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match="models--nobody--no-such-model.*does not download"):
        LLM("nobody/no-such-model")
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM(str(tmp_path / "nowhere"))


def test_hub_name_resolves_from_local_cache(tmp_path, monkeypatch, smollm_path):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(smollm_path, snap / "model.gguf")
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    llm = LLM("acme/tiny", dtype="float32", kv_cache_memory_bytes=1 << 26, max_model_len=256)
    assert llm.llm_engine.config.model.path.endswith("model.gguf")
    still_works(llm)


def test_bad_engine_arguments(smollm_path, monkeypatch):
    with pytest.raises(ValueError, match="Unknown quantization"):
        LLM(smollm_path, quantization="int3", kv_cache_memory_bytes=1 << 24, max_model_len=256)
    with pytest.raises(NotImplementedError, match="quantization='bitsandbytes' is not implemented yet"):
        LLM(smollm_path, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization='awq' needs a checkpoint quantized that way"):
        LLM(smollm_path, quantization="awq")
    with pytest.raises(ValueError, match="9 attention heads are not divisible by tensor_parallel_size=4"):
        LLM(smollm_path, tensor_parallel_size=4, max_model_len=256)
    with pytest.raises(ValueError, match="Unknown dtype"):
        LLM(smollm_path, dtype="int8")
    with pytest.raises(ValueError, match="Unknown kv_cache_dtype 'int4'; choose one of auto, fp8"):
        LLM(smollm_path, kv_cache_dtype="int4")
    # E4M3 on a GPU without FP8 units (an A100's 8.0), E5M2 there
    from pagoda.engine.arg_utils import check_kv_cache_dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match=r"'fp8' \(E4M3\) needs a GPU of compute capability 8.9 .* this one is 8.0"):
        check_kv_cache_dtype("fp8", "cuda")
    check_kv_cache_dtype("fp8_e5m2", "cuda")
    check_kv_cache_dtype("fp8", "cpu")
    with pytest.raises(TypeError, match="unexpected keyword"):
        LLM(smollm_path, not_an_option=1)
    with pytest.raises(ValueError, match="max_model_len=100000 is larger"):
        LLM(smollm_path, max_model_len=100000)
    with pytest.raises(ValueError, match="KV cache holds"):
        LLM(smollm_path, num_gpu_blocks_override=4, max_model_len=1024)


def test_dropped_engine_is_freed_without_the_cyclic_gc(smollm_path):
    # The engine freezes the GC heap at start-up (gc.freeze), so a reference cycle through it
    # would never be collected: it must be freed by reference counting alone.
    import gc
    import weakref
    llm = LLM(smollm_path, kv_cache_memory_bytes=1 << 26, max_model_len=256)
    still_works(llm)
    assert gc.get_freeze_count() > 0
    model = llm.llm_engine.executor.runner.model
    # (the rotary cos/sin table: once kept in a module-level cache, past its model)
    refs = [weakref.ref(x) for x in (llm.llm_engine, model, model.model.layers[0].self_attn.rotary_emb)]
    del llm, model
    assert all(r() is None for r in refs)
