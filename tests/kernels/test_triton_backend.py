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
    runner = llm.llm_engine.executor.runner
    tokens = {}
    for backend in (TorchAttentionBackend, TritonAttentionBackend):
        runner.backend = backend
        tokens[backend.__name__] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["TritonAttentionBackend"] == tokens["TorchAttentionBackend"]
