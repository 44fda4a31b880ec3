"""The engine with the Triton attention backend gives the torch backend's greedy tokens (a tiny
random Qwen3; on CPU the kernels run under TRITON_INTERPRET=1)."""
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.layers.attention import TorchAttentionBackend, TritonAttentionBackend

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")


def test_triton_backend_matches_torch_backend(tmp_path):
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen3")
    # Small budget: prompts are chunked, so prefills run against a cached prefix too.
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
              max_num_batched_tokens=24, max_model_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (3, 20, 37)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Parallel samples fork the first one's blocks and copy the partly filled last one
    # (36 % 16 = 4 tokens): the backend's copy_blocks.
    forked = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    runner = llm.llm_engine.executor.runner
    tokens = {}
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        runner.backend = backend
        llm.reset_prefix_cache()
        tokens[backend.__name__] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # Again: now every prompt's full blocks come from the prefix cache.
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert again == tokens[backend.__name__]
        out = llm.generate(prompts[2], forked, use_tqdm=False)[0]
        tokens[backend.__name__].append([c.token_ids for c in out.outputs])
    assert llm.get_stats().num_forked_tokens == 2 * 2 * 36
    assert tokens["TritonAttentionBackend"] == tokens["TorchAttentionBackend"]


def test_start_up_compile_step_writes_nothing(tmp_path):
    """The start-up step that compiles the attention kernel's prefill tiles (a decode and a
    prompt per tile, run on the GPU after the decode graphs) runs on the Triton backend, writes
    no KV and leaves the engine's results as they were."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen3")
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=128)
    runner = llm.llm_engine.executor.runner
    prompt = {"prompt_token_ids": list(range(3, 30))}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    before = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    caches = [c.clone() for c in runner.kv_caches]
    runner.backend = TritonAttentionBackend
    runner._compile_kernels()
    # (bit for bit: blocks never handed out hold whatever the allocator left, NaN included)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(caches, runner.kv_caches))
    runner.backend = TorchAttentionBackend
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == before
