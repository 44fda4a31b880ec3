"""An FP8 KV cache (``kv_cache_dtype="fp8"``): the cache's size, SmolLM2's greedy tokens against
the model-dtype cache, the scales a checkpoint carries. (The kernels against the reference:
tests/kernels/test_triton_attention.py; the Triton backend against the torch one with an FP8
cache: tests/kernels/test_triton_backend.py.)"""
import gc

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from tests.conftest import TEST_KV_BYTES, assert_no_leaks

PROMPTS = ["The capital of France is", "def fibonacci(n):", "PagedAttention is a technique that"]


@pytest.fixture(scope="module")
def greedy_auto(smollm_path):
    llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    blocks = llm.llm_engine.config.cache.num_blocks
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], blocks


@pytest.mark.parametrize("kv_cache_dtype,agree", [("fp8", 8), ("fp8_e4m3", 8), ("fp8_e5m2", 4)])
def test_smollm2_greedy_with_fp8_cache(smollm_path, greedy_auto, kv_cache_dtype, agree):
    """One byte an element instead of four (float32 here): four times the blocks in the same
    budget. E4M3 keeps 3 bits of mantissa, E5M2 2: greedy decoding follows the float32 cache's
    for the first tokens (measured: E4M3 13-30 of SmolLM2's, E5M2 7-15), then may part."""
    tokens_auto, blocks_auto = greedy_auto
    llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512,
              kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.executor.runner
    expected = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn
    assert all(c.dtype == expected for c in runner.kv_caches)
    assert llm.llm_engine.config.cache.num_blocks >= 4 * (blocks_auto - 1)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    for out, ref in zip(outs, tokens_auto):
        assert out.outputs[0].token_ids[:agree] == ref[:agree]
    # Parallel samples share the prompt's blocks and copy the partly filled last one (the CPU
    # copies an FP8 cache's blocks as bytes); a second run reads the prompts from the prefix cache.
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
    forked = llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), use_tqdm=False)
    assert len(forked[0].outputs) == 3
    assert_no_leaks(llm)


def test_checkpoint_kv_scales(tmp_path):
    """The KV scales of FP8 checkpoints, as vLLM, ModelOpt and compressed-tensors name them, set
    the layers' k_scale / v_scale; and the kernels use them."""
    pytest.importorskip("transformers")  # (save_tiny)
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "llama3")
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)

    def run():
        llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
                  kv_cache_dtype="fp8")
        attns = [layer.self_attn.attn for layer in llm.llm_engine.executor.runner.model.model.layers]
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        return [(a.k_scale, a.v_scale) for a in attns], [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]

    scales, plain = run()
    assert scales == [(1.0, 1.0), (1.0, 1.0)]
    file = f"{folder}/model.safetensors"
    weights = load_file(file)
    weights["model.layers.0.self_attn.k_proj.output_scale"] = torch.tensor([0.5])   # compressed-tensors
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)                # vLLM
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.125)              # both K and V
    save_file(weights, file, metadata={"format": "pt"})
    scales, scaled = run()
    assert scales == [(0.5, 0.25), (0.125, 0.125)]
    # Small scales saturate the larger K / V values (448 x scale): other logits.
    assert max(abs(a - b) for a, b in zip(plain, scaled)) > 1e-3
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(0.0)
    save_file(weights, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.1.self_attn.kv_scale' is a KV cache scale of 0.0: it must be"):
        run()
