"""Llama (with Llama-3 rope scaling), Mistral, Phi-3 (also Phi-4-mini's partial rotary embedding and
LongRoPE), Granite, SmolLM3, Qwen2, Qwen3 (also with YaRN) and the mixtures of experts Mixtral,
Qwen2-MoE and Qwen3-MoE from HF safetensors folders, against HF transformers on tiny random models;
and dummy weights from a config alone."""
import json

import pytest
import torch

from pagoda import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

CASES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(rope_theta=10000.0, sliding_window=None)),
    # (the first layer without a rotary embedding: NoPE)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(rope_theta=10000.0, no_rope_layers=[0, 1], pad_token_id=0,
                                                          tie_word_embeddings=True)),
    # (its four scalings, at Granite-3's values)
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(rope_theta=10000.0, embedding_multiplier=12.0,
                                                          residual_multiplier=0.22, attention_multiplier=0.0078125,
                                                          logits_scaling=8.0, tie_word_embeddings=True)),
    # (q/k/v and gate/up stored fused; Phi-3-mini-4k's sliding window, here past the prompts' ends)
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_theta=10000.0, sliding_window=24, pad_token_id=0)),
    # (Phi-4-mini's rotary embedding over three quarters of each head)
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(rope_theta=10000.0, partial_rotary_factor=0.75, pad_token_id=0,
                                                       tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1000000.0,
                                                      tie_word_embeddings=True)),
    # (YaRN, as Qwen3's card sets it for 4x its context; here 4 x 16 positions, so the prompts run
    # past the original context)
    "qwen3_yarn": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1000000.0, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})),
    # Gemma: norms as offsets from 1, GELU (tanh), the embeddings scaled
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=32, rope_theta=10000.0)),
    # Gemma 2: also each sublayer's output normed, the scores over query_pre_attn_scalar's root and
    # capped, the logits capped, a sliding window (8 positions) on the first layer
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0, attn_implementation="eager")),
    # Gemma 3: the same, less the caps, plus per-head q/k norms, per-head q/k norms, the scores over
    # query_pre_attn_scalar's root, a sliding window (8 positions, past which the prompts run) on
    # the first layer with a rope of its own, and a linear scaling on the other's
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, query_pre_attn_scalar=24, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})),
    # EXAONE 3.5: Llama under GPT-2's tensor names (transformers saves it so; its config as the hub's below)
    "exaone": ("ExaoneConfig", "AutoModelForCausalLM", dict(rope_theta=500000.0, pad_token_id=0, eos_token_id=2,
                                                           tie_word_embeddings=True)),
    # InternLM3: Llama's model (transformers saves it as LlamaForCausalLM, the hub as InternLM3ForCausalLM)
    "internlm3": ("InternLM3Config", "AutoModelForCausalLM", dict(rope_theta=50000000.0, pad_token_id=0,
                                                                 eos_token_id=2)),
    # OLMo 2: only the sublayers' outputs normed, q and k normed over the whole projection
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0, pad_token_id=0)),
    # OLMo 3: and a sliding window (8 positions, past which the prompts run) on its first layer
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", dict(rope_theta=500000.0, pad_token_id=0, sliding_window=8,
                                                      layer_types=["sliding_attention", "full_attention"])),
    # Mixtures of experts: every MLP one (weights renormalised), or all but mlp_only_layers (not)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            rope_theta=1000000.0)),
    # (Granite's scalings; the experts stored stacked, the router's own name)
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                    embedding_multiplier=12.0, residual_multiplier=0.22,
                                                                    attention_multiplier=0.0078125, logits_scaling=8.0,
                                                                    tie_word_embeddings=True)),
    # (and a shared MLP every token runs through, added without a gate)
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, embedding_multiplier=12.0,
        residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=8, num_experts_per_tok=3,
                                                               moe_intermediate_size=32, norm_topk_prob=False,
                                                               mlp_only_layers=[1])),
    # (a shared expert beside the routed ones, q/k/v biases)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(num_experts=6, num_experts_per_tok=2,
                                                               moe_intermediate_size=32,
                                                               shared_expert_intermediate_size=48,
                                                               tie_word_embeddings=False)),
}


def save_tiny(tmp_path, case, seed=0, max_shard_size="5GB", **config) -> tuple[str, torch.nn.Module]:
    """A tiny random HF model of ``CASES[case]`` (``config``: fields over its own) saved as safetensors."""
    cfg_cls, model_cls, extra = CASES[case]
    if not hasattr(transformers, cfg_cls):   # (EXAONE's came in a later transformers than some machines have)
        pytest.skip(f"transformers {transformers.__version__} has no {cfg_cls}")
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra, **config})
    torch.manual_seed(seed)
    cls = getattr(transformers, model_cls)
    model = (cls.from_config(cfg) if model_cls.startswith("Auto") else cls(cfg)).eval()
    with torch.no_grad():   # larger weights than the init gives, so the logits are not flat
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else p.normal_(1.0, 0.1)
    folder = tmp_path / case
    model.save_pretrained(folder, safe_serialization=True, max_shard_size=max_shard_size)
    return str(folder), model


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF transformers' greedy continuation of ``prompt``, ``n`` tokens, EOS ignored."""
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return ref[0, len(prompt):].tolist()


@torch.no_grad()
def assert_matches_hf(llm, hf, prompts: list[list[int]], n: int):
    """The engine's greedy continuations (``n`` tokens) and prompt logprobs are HF's."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, n)
        lp = hf(torch.tensor([p])).logits[0].log_softmax(-1)
        for pos in range(1, len(p)):
            assert abs(out.prompt_logprobs[pos][p[pos]].logprob - lp[pos - 1, p[pos]].item()) < 1e-3


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_hf(tmp_path, case):
    folder, hf = save_tiny(tmp_path, case)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    g = torch.Generator().manual_seed(1)
    assert_matches_hf(llm, hf, [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 17, 40)], 12)


def test_sliding_window_matches_hf(tmp_path):
    """Mistral-7B-v0.1's sliding window (here 8 positions: the prompts and answers run far past
    it, over several KV blocks), as HF masks it; chunked prefill over a cached prefix too. Qwen2's
    configs name a window they do not use (use_sliding_window false): none is applied; switched
    on, it is, from layer max_window_layers on (here the second of two), as HF does."""
    folder, hf = save_tiny(tmp_path, "mistral", sliding_window=8)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, block_size=8,
              max_num_batched_tokens=16)
    layer = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.attn
    assert layer.sliding_window == 8
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 30, 41)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12)
    qwen2, _ = save_tiny(tmp_path / "q", "qwen2", sliding_window=8, use_sliding_window=False)
    llm = LLM(qwen2, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.executor.runner.model.model.layers[0].self_attn.attn.sliding_window == 0
    del llm
    qwen2, hf = save_tiny(tmp_path / "w", "qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1)
    llm = LLM(qwen2, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    layers = llm.llm_engine.executor.runner.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [0, 8]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 12)


LONGROPE = dict(rope_theta=10000.0, partial_rotary_factor=0.75, pad_token_id=0, original_max_position_embeddings=24,
                rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                              "long_factor": [1.0, 2.0, 4.0, 9.0, 20.0, 40.0]})


def test_longrope_matches_hf(tmp_path):
    """Phi-3.5 / Phi-3-128k / Phi-4-mini's LongRoPE (here with Phi-4-mini's partial rotary
    embedding, over an original context of 24 positions grown to 256): with max_model_len within
    the original context the short factors, as HF uses them for such sequences; beyond it the
    long factors for every sequence (vLLM's rule), as HF uses them for a sequence past the
    original context from its first forward on. The attention factor (from 256 / 24) scales
    both."""
    folder, hf = save_tiny(tmp_path, "phi4_mini", **LONGROPE)
    g = torch.Generator().manual_seed(3)
    for max_model_len, lengths in ((24, (5, 16)), (None, (25, 40))):
        llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
                  max_model_len=max_model_len)
        rope = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.rotary_emb
        assert rope.cos_sin_cache.shape[-1] == 12    # (three quarters of 16)
        assert_matches_hf(llm, hf, [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths], 8)
        del llm


@pytest.mark.parametrize("case,arch,names", [
    ("exaone", "ExaoneForCausalLM", dict(num_hidden_layers="num_layers", rms_norm_eps="layer_norm_epsilon",
                                         hidden_act="activation_function")),
    ("internlm3", "InternLM3ForCausalLM", dict(attention_bias="qkv_bias"))])
def test_configs_as_the_hub_writes_them(tmp_path, case, arch, names):
    """EXAONE 3.5's config.json as published (``num_layers``, ``layer_norm_epsilon``,
    ``activation_function``, ``ExaoneForCausalLM``; its GPT-2 tensor names) and InternLM3's
    (``qkv_bias``, ``InternLM3ForCausalLM``): HF's tokens."""
    folder, hf = save_tiny(tmp_path, case)
    path = f"{folder}/config.json"
    cfg = json.load(open(path))
    cfg.update(architectures=[arch], **{theirs: cfg.pop(ours) for ours, theirs in names.items()})
    json.dump(cfg, open(path, "w"))
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.config.model.arch.architecture == arch
    assert_matches_hf(llm, hf, [[5, 9, 14, 3, 77], list(range(20, 50))], 8)
    if case == "exaone":     # (each pipeline stage skips the other's tensors by their stored names too)
        del llm
        from tests.test_tensor_parallel import assert_same, outputs_at
        assert_same(outputs_at(folder, 1), outputs_at(folder, 1, pipeline_parallel_size=2))


def test_olmo3_windows_without_layer_types():
    """An OLMo 3 config.json that leaves layer_types out: the window on three layers of four, as
    transformers fills them in."""
    from pagoda.config import ArchConfig
    cfg = ArchConfig.from_hf_dict(dict(BASE, num_hidden_layers=8, architectures=["Olmo3ForCausalLM"],
                                       model_type="olmo3", sliding_window=16))
    assert [cfg.window(i) for i in range(8)] == [16, 16, 16, 0] * 2
    assert cfg.post_norms_only and cfg.qk_norm_whole and cfg.uniform_window == 0


def test_sliding_window_gives_back_blocks(tmp_path):
    """With the same window on every layer (Mistral-7B-v0.1's, here 8 positions), a request gives
    its blocks before the window back as it grows: four requests of 70 tokens (9 blocks of 8
    each, 36 in all) run side by side in 15 blocks without a preemption, and generate HF's
    tokens; every block is free again at the end. Windows on some layers only (Gemma 2's) make
    groups of their own (test_hybrid_kv_cache_groups), or with disable_hybrid_kv_cache_manager
    keep every block."""
    folder, hf = save_tiny(tmp_path, "mistral", sliding_window=8)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, block_size=8, num_gpu_blocks_override=16,
              max_model_len=80)
    kv = llm.llm_engine.kv_cache_manager
    assert kv.windows == (8,)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (20,), generator=g).tolist() for _ in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), use_tqdm=False)
    assert llm.get_stats().num_preemptions == 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, 50)
    assert kv.num_free_blocks == 15 and not kv.req_to_blocks
    del llm
    folder, _ = save_tiny(tmp_path / "g", "gemma2")
    llm = LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22)
    assert llm.llm_engine.kv_cache_manager.windows == (0, 8)
    del llm
    llm = LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, disable_hybrid_kv_cache_manager=True)
    assert llm.llm_engine.kv_cache_manager.windows == (0,)


def test_hybrid_kv_cache_groups(tmp_path):
    """Gemma 3's sliding and full layers in KV cache groups (vLLM's hybrid KV cache manager): here
    5 sliding layers (a window of 8 positions) and 2 full of 7 make groups of 2 layers: the full
    group (layers 3, 6), and sliding groups (0, 1), (2, 4), (5), each layer j of a group in the
    j-th cache tensor. In the KV memory of 170 one-layer blocks of 8 tokens, four requests of 70
    tokens run side by side without a preemption (the sliding groups give their blocks back
    as the window moves) and generate HF's tokens; without the groups (every layer keeps its
    whole context) the same memory holds 24 blocks: they preempt each other, with the same
    tokens. A prompt run again hits the prefix cache in every group, two greedy samples of one
    prompt (the second forked from the first, its partial block copied in every group) are both
    HF's, and every block is free at the end. Too little memory for a max_model_len request in every group is an error that says
    what fits."""
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    folder, hf = save_tiny(tmp_path, "gemma3", num_hidden_layers=7, layer_types=types)
    layer_page = 2 * 8 * 2 * 32 * 4       # K and V of 8 tokens, 2 KV heads of 32, float32
    kw = dict(dtype="float32", skip_tokenizer_init=True, block_size=8, max_model_len=80,
              kv_cache_memory_bytes=170 * layer_page)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (20,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    want = [hf_greedy(hf, p, 50) for p in prompts]
    llm = LLM(folder, **kw)
    kv, runner = llm.llm_engine.kv_cache_manager, llm.llm_engine.executor.runner
    assert kv.windows == (0, 8, 8, 8) and kv.pool.num_blocks == 85
    attn = [layer.self_attn.attn for layer in runner.model.model.layers]
    assert [a.kv_group for a in attn] == [1, 1, 2, 0, 2, 3, 0]
    caches = runner.kv_caches
    assert len(caches) == 2 and [[a.kv_cache is c for c in caches].index(True) for a in attn] == [0, 1, 0, 0, 1, 0, 1]
    for hit in (0, 16):
        out = llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)[0]
        assert out.num_cached_tokens == hit and out.outputs[0].token_ids == want[3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_stats().num_preemptions == 0
    twins = llm.generate({"prompt_token_ids": prompts[0] + [7]}, SamplingParams(temperature=0, max_tokens=20,
                                                                              ignore_eos=True, n=2), use_tqdm=False)
    assert [c.token_ids for c in twins[0].outputs] == [hf_greedy(hf, prompts[0] + [7], 20)] * 2
    assert llm.get_stats().num_forked_tokens > 0       # (the second forked the first's blocks, in every group)
    assert kv.num_free_blocks == 84 and not kv.req_to_blocks
    del llm
    llm = LLM(folder, disable_hybrid_kv_cache_manager=True, **kw)
    assert llm.llm_engine.kv_cache_manager.windows == (0,) and llm.llm_engine.kv_cache_manager.pool.num_blocks == 24
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_stats().num_preemptions > 0
    del llm
    # 15 blocks: a prompt of 80 tokens in one step needs 10 in each of the 4 groups; 3 each
    # (24 tokens) fit
    with pytest.raises(ValueError, match="less than one sequence of max_model_len=80 needs. Lower max_model_len to "
                                         "at most 24 "):
        LLM(folder, **dict(kw, kv_cache_memory_bytes=30 * layer_page))


def test_disable_sliding_window(tmp_path):
    """vLLM's disable_sliding_window: no layer keeps a window (one KV cache group, the attention
    unwindowed), the context capped to the window, within which HF's tokens come out (Gemma 3's
    sliding layers keep their own rotary base); a longer max_model_len is an error; a model
    without a window is unchanged."""
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    folder, hf = save_tiny(tmp_path, "gemma3", num_hidden_layers=7, layer_types=types, sliding_window=32)
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, block_size=8, disable_sliding_window=True)
    engine = llm.llm_engine
    assert engine.config.scheduler.max_model_len == 32 and engine.kv_cache_manager.windows == (0,)
    assert {layer.self_attn.attn.sliding_window for layer in engine.executor.runner.model.model.layers} == {0}
    prompt = torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(6)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
    del llm
    with pytest.raises(ValueError, match=r"max_model_len=64 is longer than the sliding window \(32 tokens\)"):
        LLM(folder, skip_tokenizer_init=True, disable_sliding_window=True, max_model_len=64)
    folder, _ = save_tiny(tmp_path, "qwen2")
    llm = LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 22, disable_sliding_window=True)
    assert llm.llm_engine.config.scheduler.max_model_len == BASE["max_position_embeddings"]


def test_hybrid_kv_cache_groups_sharded(tmp_path):
    """The 7-layer Gemma 3 of test_hybrid_kv_cache_groups in two pipeline stages (layers 0-3 and
    4-6, each stage's cache tensors those its layers use) and over two tensor-parallel ranks: one
    engine's greedy tokens, logprobs and seeded samples (a 60-token prompt runs past the window)."""
    from tests.test_tensor_parallel import assert_same, outputs_at
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"]
    folder, _ = save_tiny(tmp_path, "gemma3", num_hidden_layers=7, layer_types=types)
    one = outputs_at(folder, 1)
    assert_same(one, outputs_at(folder, 1, pipeline_parallel_size=2))
    assert_same(one, outputs_at(folder, 2))


@pytest.mark.parametrize("extra,error", [
    (dict(partial_rotary_factor=0.3125), "partial_rotary_factor=0.3125 turns 5 .* positive even number"),
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8}),
     "'longrope' needs 'short_factor', 'long_factor' and 'original_max_position_embeddings'"),
    (dict(rope_scaling={"type": "su", "short_factor": [1.0] * 5, "long_factor": [2.0] * 5},
          original_max_position_embeddings=64), "long_factor has 5 entries; the rotary embedding has 8")])
def test_phi3_rope_errors_name_the_problem(tmp_path, extra, error):
    """A rotary dimension that is no even number, LongRoPE without its factors or original
    context, factors that do not fit the heads (Phi-3's first configs name LongRoPE "su")."""
    cfg = dict(BASE, architectures=["Phi3ForCausalLM"], model_type="phi3", **extra)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


def test_dummy_weights_from_config_alone(tmp_path):
    cfg = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert all(0 <= t < 512 for t in out.outputs[0].token_ids)


def test_yarn_by_hf_overrides_sets_the_context(tmp_path):
    """YaRN added to a model as Qwen3's card says (vLLM's hf_overrides): its context is the
    original one times the factor, the default max_model_len, and no longer may be asked for; a
    YaRN scaling without its original context is refused by name."""
    cfg = dict(BASE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    kw = dict(load_format="dummy", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    llm = LLM(str(tmp_path), hf_overrides={"rope_scaling": yarn}, **kw)
    assert llm.llm_engine.config.scheduler.max_model_len == 1024
    out = llm.generate({"prompt_token_ids": list(range(3, 400))}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]      # (past the original 256 positions)
    assert len(out.outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="larger than the model's maximum context .1024 tokens"):
        LLM(str(tmp_path), hf_overrides={"rope_scaling": yarn}, max_model_len=1025, **kw)
    with pytest.raises(ValueError, match="'yarn' needs 'factor' and 'original_max_position_embeddings'"):
        LLM(str(tmp_path), hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, **kw)


def test_dynamic_ntk_rope_scaling_as_vllm(tmp_path):
    """Dynamic NTK scaling (``"rope_scaling": {"type": "dynamic", "factor": 2.0}``) as vLLM applies
    it: the rope base raised once, to base * (f^2 - f + 1)^(d / (d - 2)) for the context the
    factor allows, which is the default max_model_len (HF raises it only past
    max_position_embeddings). So the model is HF's at that base without a scaling: greedy tokens
    and prompt logprobs, over prompts past max_position_embeddings too. No factor is an error."""
    folder, _ = save_tiny(tmp_path, "qwen2", max_position_embeddings=64, rope_scaling={"type": "dynamic", "factor": 2.0})
    ref_cfg = transformers.Qwen2Config(**{**BASE, **CASES["qwen2"][2], "max_position_embeddings": 128,
                                          "rope_theta": 10000.0 * 3.0 ** (16 / 14)})     # (head_dim 16)
    ref = transformers.Qwen2ForCausalLM(ref_cfg).eval()
    ref.load_state_dict(transformers.Qwen2ForCausalLM.from_pretrained(folder).state_dict())
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    assert llm.llm_engine.config.scheduler.max_model_len == 128
    assert_matches_hf(llm, ref, [[5, 9, 14, 3, 77], list(range(20, 100))], 8)
    del llm
    cfg = json.load(open(f"{folder}/config.json"))
    cfg["rope_scaling"] = {"type": "dynamic"}
    json.dump(cfg, open(f"{folder}/config.json", "w"))
    with pytest.raises(ValueError, match="rope_scaling of type 'dynamic' needs its 'factor'"):
        LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


def test_sharded_checkpoint_with_index(tmp_path):
    folder, hf = save_tiny(tmp_path, "llama3", max_shard_size="200KB")
    shards = sorted(p.name for p in (tmp_path / "llama3").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "llama3" / "model.safetensors.index.json").is_file()
    llm = LLM(folder, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    prompt = [5, 9, 200, 17, 3, 44]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 8)
    (tmp_path / "llama3" / shards[-1]).unlink()
    with pytest.raises(ValueError, match="missing weight files listed in its index"):
        LLM(folder, skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


def test_gemma3_multimodal_checkpoint_as_its_text_model(tmp_path):
    """Gemma 3's 4B-27B checkpoints (Gemma3ForConditionalGeneration) run text prompts: the text
    model from under its prefix (as transformers saves it, and as it loads it), the vision
    tower's tensors never read; greedy tokens and logprobs equal HF's on the same text."""
    from safetensors.torch import load_file, save_file
    from pagoda.model.loader import iter_safetensors
    text = transformers.Gemma3TextConfig(**{**BASE, **CASES["gemma3"][2]})
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=509, boi_token_index=507, eoi_token_index=508)
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(8.0) if p.dim() > 1 else p.normal_(1.0, 0.1)
    folder = tmp_path / "g3mm"
    hf.save_pretrained(folder, safe_serialization=True)
    stored = dict(iter_safetensors(str(folder)))
    assert any(n.startswith("vision_tower.") for n in stored) and "language_model.model.norm.weight" in stored
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    want = [hf_greedy(hf, p, 10) for p in prompts]
    with torch.no_grad():
        want_lp = [hf(torch.tensor([p])).logits[0].log_softmax(-1) for p in prompts]
    for prefix in ("language_model.model.", "model.language_model."):
        if prefix == "model.language_model.":   # (the names transformers loads them as)
            tensors = load_file(folder / "model.safetensors")
            save_file({k.replace("language_model.model.", prefix): v.contiguous() for k, v in tensors.items()},
                      folder / "model.safetensors", metadata={"format": "pt"})
        llm = LLM(str(folder), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
        model = llm.llm_engine.executor.runner.model
        assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [8, 0]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for p, out, w, lp in zip(prompts, outs, want, want_lp):
            assert out.outputs[0].token_ids == w
            for pos in range(1, len(p)):
                assert abs(out.prompt_logprobs[pos][p[pos]].logprob - lp[pos - 1, p[pos]].item()) < 1e-3
        del llm


def test_gemma3_hub_config_reads_as_transformers_does():
    """A Gemma 3 4B config.json as published (its text_config only where it differs from the
    defaults; rope_local_base_freq, sliding_window_pattern): the text model transformers makes."""
    from pagoda.config import ArchConfig, KVCacheGroup, kv_cache_groups
    d = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
         "torch_dtype": "bfloat16", "text_config": {
             "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
             "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
         "vision_config": {"model_type": "siglip_vision_model"}}
    arch = ArchConfig.from_hf_dict(d)
    ref = transformers.Gemma3TextConfig(**d["text_config"])
    assert (arch.architecture, arch.vocab_size, arch.hidden_size, arch.num_hidden_layers) == \
        ("Gemma3ForConditionalGeneration", ref.vocab_size, 2560, 34)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == \
        (ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert arch.layer_types == tuple(ref.layer_types) and arch.sliding_window == 1024
    assert [arch.window(i) for i in range(6)] == [1024] * 5 + [0]
    # Its KV cache groups (vLLM's): the 5 full layers, then the 29 sliding ones in fives
    groups = kv_cache_groups(arch)
    assert [g.window for g in groups] == [0] + [1024] * 6 and groups[0].layers == (5, 11, 17, 23, 29)
    assert groups[1].layers == (0, 1, 2, 3, 4) and groups[-1].layers == (30, 31, 32, 33)
    assert kv_cache_groups(arch, hybrid=False) == (KVCacheGroup(0, tuple(range(34))),)
    assert arch.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert arch.local_rope_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert arch.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    assert arch.max_context == ref.max_position_embeddings == 131072     # (the scaling is in it already)
    assert arch.attention_multiplier == ref.query_pre_attn_scalar ** -0.5
    assert arch.embedding_multiplier == 2560 ** 0.5 and arch.hidden_act == "gelu_pytorch_tanh"
    assert arch.eos_token_id == [1, 106] and arch.tie_word_embeddings and arch.sandwich_norms
