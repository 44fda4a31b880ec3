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


def test_calculate_kv_scales(tmp_path):
    """calculate_kv_scales (vLLM's): the first step's keys (normed and rotated, as the cache
    stores them) and values set each layer's scales, |k| max / 200 and |v| max / 100; a model
    whose keys and values exceed E4M3's 448 then keeps its logprobs, where scales of 1.0
    saturate them."""
    from pagoda.model.layers.attention import Attention
    from pagoda.kernels import reference
    from tests.test_tensor_parallel import write_tiny_llama
    folder = write_tiny_llama(str(tmp_path / "tiny"))
    file = f"{folder}/model.safetensors"
    weights = load_file(file)
    for name in weights:     # keys and values in the thousands, the same model otherwise
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            weights[name] *= 1000.0
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            weights[name] /= 1000.0
    save_file(weights, file, metadata={"format": "pt"})
    prompt = {"prompt_token_ids": list(range(3, 60))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    first_kv = {}

    def record(module, args):        # the first step's (chunk's) scales, from its keys and values, per layer
        q, k, v, rope = args
        if module not in first_kv:
            _, k = reference.rotary_embedding(rope.positions, q, k, rope.cos_sin_cache, module.head_dim)
            first_kv[module] = (k.abs().max().item() / 200, v.abs().max().item() / 100)

    def run(**kwargs):
        llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
                  max_model_len=256, max_num_batched_tokens=16, **kwargs)     # the first step: 16 tokens
        attns = [m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, Attention)]
        hooks = [a.register_forward_pre_hook(record) for a in attns]
        runner = llm.llm_engine.executor.runner
        if kwargs.get("calculate_kv_scales"):       # (no graphs before the first step sets the scales)
            assert runner.cuda_graphs is None
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        # On the GPU the decode steps replay graphs captured after the first step: its scales.
        assert (runner.cuda_graphs is not None) == torch.cuda.is_available()
        for h in hooks:
            h.remove()
        scales = [(a.k_scale, a.v_scale) for a in attns]
        # (the hooks' records: the calibrating step runs eagerly; on the GPU the others replay graphs)
        expected = [first_kv.get(a) for a in attns]
        first_kv.clear()
        assert_no_leaks(llm)
        del llm
        gc.collect()
        logprobs = [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]
        return scales, expected, logprobs + [next(iter(lp.values())).logprob for lp in out.outputs[0].logprobs]

    _, _, exact = run()
    fixed_scales, _, fixed = run(kv_cache_dtype="fp8")
    scales, expected, calibrated = run(kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert fixed_scales == [(1.0, 1.0), (1.0, 1.0)]
    assert all(k > 1 and v > 1 for k, v in scales)
    assert scales == [pytest.approx(e, rel=1e-5) for e in expected]
    err = lambda got: max(abs(a - b) for a, b in zip(got, exact))   # noqa: E731
    # (Measured: 0.79 against 6.5; an E4M3 cache of the model before the scaling, scales 1.0, is
    # itself 0.91 off: this random model's logits are sharp.)
    assert err(calibrated) < err(fixed) / 4, (err(calibrated), err(fixed))
    with pytest.raises(ValueError, match="calculate_kv_scales computes an FP8 KV cache's scales"):
        LLM(folder, skip_tokenizer_init=True, calculate_kv_scales=True)
