"""The engine with the Triton attention backend gives the torch backend's greedy tokens (a tiny
random Qwen3; on CPU the kernels run under TRITON_INTERPRET=1)."""
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.layers.attention import TorchAttentionBackend, TritonAttentionBackend

pytest.importorskip("triton")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("kv_cache_dtype,case,window", [("auto", "qwen3", None), ("fp8", "qwen3", None),
                                                        ("auto", "mistral", 8), ("auto", "gemma2", 8),
                                                        ("auto", "gemma3", 8), ("auto", "phi4_mini", None),
                                                        ("auto", "olmo3", 8)])
def test_triton_backend_matches_torch_backend(tmp_path, kv_cache_dtype, case, window):
    """(Mistral with a sliding window of 8 positions: both backends' windowed attention; Gemma 2
    with it on one layer of two, and its cap on the scores; Gemma 3's q/k norms in the kernels;
    Phi-4-mini's rotary embedding over three quarters of each head; OLMo 3's whole q/k norms and
    its window on one layer of two.)"""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case, sliding_window=window)
    # Small budget: prompts are chunked, so prefills run against a cached prefix too.
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22,
              max_num_batched_tokens=24, max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (3, 20, 37)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # Parallel samples fork the first one's blocks and copy the partly filled last one
    # (36 % 16 = 4 tokens): the backend's copy_blocks.
    forked = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    runner = llm.llm_engine.executor.runner
    assert runner.kv_caches[0].dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
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


@pytest.mark.parametrize("q_lens", [[1, 1, 1, 5, 9, 2], [1] * 6, [7, 3], [1, 5, 3]],
                         ids=["mixed", "decodes", "prefills", "drafts"])
def test_graph_forward_matches_eager(tmp_path, q_lens):
    """What a CUDA graph captures, the forward over the runner's padded buffers (for a mixed
    step: the attention's two launches that each skip the other's requests; for a verification
    step of speculative decoding, one launch of 5-query tiles split over the context), gives the
    eager forward's hidden states and KV writes. On the CPU both run eagerly, the kernels in the
    interpreter; on a GPU, compiled (the graphs themselves: tests/test_gpu.py)."""
    from pagoda.model.layers.attention import AttentionMetadata, set_forward_context
    from pagoda.runner.cuda_graph import CUDAGraphRunner
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen3")
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, max_model_len=128)
    runner = llm.llm_engine.executor.runner
    g = torch.Generator().manual_seed(sum(q_lens))
    for cache in runner.kv_caches:       # old contexts: random K/V
        cache.copy_(torch.randn(cache.shape, generator=g))
    bs = runner.block_size
    seq_lens = [q + int(torch.randint(0, 60, (1,), generator=g)) for q in q_lens]
    blocks = torch.randperm(runner.kv_caches[0].shape[1] - 1, generator=g)[:sum(-(-s // bs) for s in seq_lens)] + 1
    tables, start = torch.zeros(len(q_lens), -(-max(seq_lens) // bs), dtype=torch.int32), 0
    for i, s in enumerate(seq_lens):
        tables[i, :-(-s // bs)] = blocks[start:start + -(-s // bs)]
        start += -(-s // bs)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, seq_lens)])
    req = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    inputs = dict(input_ids=torch.randint(3, 512, (sum(q_lens),), generator=g), positions=positions,
                  slot_mapping=tables[req, positions // bs].long() * bs + positions % bs,
                  query_start_loc=torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables)
    inputs = {k: v.to(runner.device) for k, v in inputs.items()}
    tables, positions = inputs["block_tables"], inputs["positions"]
    before = [c.clone() for c in runner.kv_caches]

    num_decodes = sum(q == 1 for q in q_lens)
    md = AttentionMetadata(sum(q_lens), num_decodes, inputs["slot_mapping"], inputs["query_start_loc"],
                           inputs["seq_lens"], tables, max(q_lens), max(seq_lens),
                           max([s for q, s in zip(q_lens, seq_lens) if q == 1], default=0))
    with torch.inference_mode(), set_forward_context(md, TritonAttentionBackend):
        eager = runner.model(inputs["input_ids"], positions)
    eager_caches = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before):
        c.copy_(b)

    drafts = q_lens == [1, 5, 3]
    # (a verification graph bounds contexts by 1,024 tokens: the attention splits them into 8 segments)
    graphs = CUDAGraphRunner(runner.model, TritonAttentionBackend, runner.max_num_reqs, 64,
                             tables.shape[1] + 2, 1024 if drafts else 128, runner.device,
                             num_speculative_tokens=4 if drafts else 0)
    key = graphs.graph_key(len(q_lens), sum(q_lens), max(q_lens))
    assert key == (("decode", 8) if q_lens == [1] * 6 else ("spec", 4) if drafts else ("mixed", 64))
    # What an earlier, larger batch left in the buffers: padding must override it
    graphs.input_ids.fill_(7)
    graphs.positions.fill_(10**6)        # (padding tokens' positions are never read)
    graphs.slot_mapping.fill_(5)         # a slot of block 0, which this batch does not use
    graphs.query_start_loc.copy_(torch.arange(len(graphs.query_start_loc)) * 2)
    with torch.inference_mode():     # (the runner's slots and block tables: a row a KV cache group)
        graphs.load(key, dict(inputs, slot_mapping=inputs["slot_mapping"][None], block_tables=tables[None]))
        padded = graphs.forward(key)[:sum(q_lens)]
    torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4)
    for c, e in zip(runner.kv_caches, eager_caches):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)   # padding wrote nothing
