"""Tensor parallelism on the CPU: rank 0 in this process, ranks 1..N-1 spawned worker processes
meeting it over gloo. Outputs must not depend on tensor_parallel_size; workers must survive bad
requests, report their own errors, and go away with the engine."""
import gc
import importlib.util
import json
import multiprocessing
import os
import signal
import time

import pytest
import torch
from safetensors.torch import save_file

from pagoda import LLM, SamplingParams
from tests.quant_utils import fp8_folder, quantize_folder

SMALL = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=256)
PROMPTS = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8, 9], list(range(10, 70)), [300, 2, 41])]


def write_tiny_llama(folder, heads=4, kv_heads=2, vocab=509, intermediate=128, hidden=64, seed=0, layers=2,
                     tied=False) -> str:
    """A random-weight Llama checkpoint (safetensors), so that every rank loads its shard through
    the weight loaders. The vocabulary is odd: the vocab-parallel embedding and LM head pad it."""
    os.makedirs(folder, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
               intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (intermediate, hidden), p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate)})
    g = torch.Generator().manual_seed(seed)
    # (weights large enough that the logits are far from flat: greedy choices have clear margins)
    save_file({k: 1 + 0.1 * torch.randn(s, generator=g) if len(s) == 1 else 0.2 * torch.randn(s, generator=g)
               for k, s in shapes.items()}, os.path.join(folder, "model.safetensors"))
    return folder


def run(llm, params):
    return [o.outputs for o in llm.generate(PROMPTS, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, n=2, seed=7, max_tokens=12, ignore_eos=True)


def outputs_at(folder, tp, **kwargs):
    llm = LLM(folder, tensor_parallel_size=tp, **dict(SMALL, **kwargs))
    try:
        return (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED))
    finally:
        del llm
        gc.collect()


def assert_same(a, b, tol=1e-4):
    (greedy_a, seeded_a), (greedy_b, seeded_b) = a, b
    for x, y in zip(greedy_a, greedy_b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=tol)
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert lx.keys() == ly.keys()
            assert all(abs(lx[t].logprob - ly[t].logprob) < tol for t in lx)
        for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert all(abs(lx[t].logprob - ly[t].logprob) < tol for t in lx.keys() & ly.keys())
    assert [[c.token_ids for c in o] for o in seeded_a] == [[c.token_ids for c in o] for o in seeded_b]


def worker_procs(llm):
    return list(llm.llm_engine.executor.procs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("tp") / "tiny"))


class Shared:
    """The tp=2 engine the tests below share; one process holds one tensor-parallel engine at
    a time, so tests that start their own drop it first (``own_engine``)."""
    llm = None


@pytest.fixture
def tp2(tiny):
    if Shared.llm is None:   # (async scheduling, as on CUDA: the next step is queued before rank 0's tokens are read)
        Shared.llm = LLM(tiny, tensor_parallel_size=2, async_scheduling=True, **SMALL)
    return Shared.llm


@pytest.fixture
def own_engine():
    Shared.llm = None
    gc.collect()


@pytest.fixture(scope="module", autouse=True)
def drop_shared_engine():
    yield
    Shared.llm = None
    gc.collect()


def test_tp2_equals_tp1(tiny, tp2):
    """Greedy tokens, their logprobs, prompt logprobs and seeded samples (n=2, top-p/top-k) of
    two ranks (with async scheduling) equal one rank's (without); sampling happens once, on rank
    0's gathered logits."""
    assert tp2.llm_engine.async_scheduling
    ref = outputs_at(tiny, 1)
    assert_same(ref, (tp2.generate(PROMPTS, GREEDY, use_tqdm=False), run(tp2, SEEDED)))


def test_bad_request_leaves_workers_running(tp2):
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        tp2.generate({"prompt_token_ids": [5] * 300}, GREEDY, use_tqdm=False)
    assert all(p.is_alive() for p in worker_procs(tp2))
    out = tp2.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert not tp2.llm_engine.has_unfinished_requests()


def test_kv_cache_is_the_smallest_rank_s(tp2):
    counts = tp2.llm_engine.executor.collective_rpc("determine_num_blocks")
    assert len(counts) == 2 and tp2.llm_engine.config.cache.num_blocks == min(counts)


def _fail_on_rank_1(worker):
    if worker.rank == 1:
        raise ValueError("rank 1 cannot go on")
    return worker.rank


def test_worker_error_surfaces_and_workers_exit_with_the_engine(tiny, tp2):
    llm, Shared.llm = tp2, None
    procs = worker_procs(llm)
    with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed.*ValueError: rank 1 cannot go on"):
        llm.llm_engine.executor.collective_rpc(_fail_on_rank_1)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="has stopped .*rank 1 failed"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    # The process group is gone with it: a new engine starts, and `del llm` stops its workers.
    threads = torch.get_num_threads()
    llm = LLM(tiny, tensor_parallel_size=2, **SMALL)
    procs = worker_procs(llm)
    assert all(p.is_alive() for p in procs)
    del llm        # (no gc.collect(): the engine holds no reference cycle)
    assert not any(p.is_alive() for p in procs)
    assert torch.get_num_threads() == threads     # (rank 0 shared the cores while it ran)


def test_kv_heads_replicated(tmp_path, own_engine):
    """One KV head over two ranks: each rank holds a copy of it."""
    folder = write_tiny_llama(str(tmp_path / "mqa"), heads=4, kv_heads=1, seed=1)
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


@pytest.mark.parametrize("case", ["gemma3", "gemma2", "granite"])
def test_gemma_and_granite_split(tmp_path, own_engine, case):
    """Gemma 3 (its per-head q/k norms on each rank's heads, windows on some layers, a scaled
    embedding), Gemma 2 (the cap on its logits) and Granite (the logits' scaling: applied on the
    rank that gathers them, the others holding none) at tp=2 equal tp=1."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case)
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_olmo2_split(tmp_path, own_engine, kv_heads):
    """OLMo 2's q and k norms over the whole projection, each rank holding its heads' slice of
    the weights and the sums of squares all-reduced (one KV head: both ranks hold it, counted
    once), at tp=2 equal tp=1."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "olmo2", num_key_value_heads=kv_heads)
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


def test_fused_checkpoint_projections_split(tiny, tmp_path, own_engine):
    """Phi-3's checkpoints store q/k/v and gate/up fused: the same weights saved so, each rank
    cuts its heads and columns out of the fused tensors, and tp=2 gives the unfused model's tp=1."""
    from safetensors.torch import load_file
    weights = load_file(os.path.join(tiny, "model.safetensors"))
    for i in range(2):
        p = f"model.layers.{i}."
        weights[p + "self_attn.qkv_proj.weight"] = torch.cat([weights.pop(p + f"self_attn.{x}_proj.weight")
                                                               for x in "qkv"])
        weights[p + "mlp.gate_up_proj.weight"] = torch.cat([weights.pop(p + f"mlp.{x}_proj.weight")
                                                             for x in ("gate", "up")])
    fused = tmp_path / "phi3"
    fused.mkdir()
    save_file(weights, str(fused / "model.safetensors"))
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = dict(json.load(f), architectures=["Phi3ForCausalLM"], model_type="phi3")
    (fused / "config.json").write_text(json.dumps(cfg))
    assert_same(outputs_at(tiny, 1), outputs_at(str(fused), 2))


def test_dead_worker_raises_instead_of_hanging(tiny, own_engine):
    llm = LLM(tiny, tensor_parallel_size=2, **SMALL)
    [proc] = worker_procs(llm)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    start = time.time()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.time() - start < 30
    del llm
    gc.collect()


def test_rank0_failure_stops_the_workers(tiny, monkeypatch, own_engine):
    llm = LLM(tiny, tensor_parallel_size=2, **SMALL)
    procs = worker_procs(llm)
    runner = llm.llm_engine.executor.worker.runner

    def broken_forward(*args):
        raise KeyError("rank 0's forward broke")
    monkeypatch.setattr(runner, "_forward", broken_forward)
    with pytest.raises(KeyError, match="forward broke"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not any(p.is_alive() for p in procs)
    del llm
    gc.collect()


def assert_smollm2_greedy_matches(llm, smollm_path, **parallel):
    """SmolLM2 split as ``parallel`` says gives the session's one-process engine's greedy tokens."""
    prompts = ["The capital of France is", "def fibonacci(n):", "请解释量子纠缠"]
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    split = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=1 << 26, max_model_len=512, **parallel)
    try:
        assert [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)] == ref
    finally:
        del split
        gc.collect()


def test_smollm2_tp3_equals_tp1(llm, smollm_path, own_engine):
    """The real model (9 heads, 3 KV heads) over three ranks."""
    assert_smollm2_greedy_matches(llm, smollm_path, tensor_parallel_size=3)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8"])
def test_quantized_checkpoints_split(tiny, tmp_path, method, own_engine):
    """Packed 4-bit weights, their per-group scales and zero points, and FP8 per-tensor scales
    (one per q / k / v shard) narrowed to each rank's slice as the dense weights are."""
    folder = (fp8_folder(tiny, str(tmp_path / method)) if method == "fp8" else
              quantize_folder(tiny, str(tmp_path / method), method, group=32))
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


def test_fp8_kv_cache_split(tiny, own_engine):
    """An FP8 KV cache over two ranks (each its KV heads' blocks): one rank's outputs."""
    assert_same(outputs_at(tiny, 1, kv_cache_dtype="fp8"), outputs_at(tiny, 2, kv_cache_dtype="fp8"))


def test_act_order_refused_and_start_up_failure_leaves_no_workers(tiny, tmp_path, own_engine):
    folder = quantize_folder(tiny, str(tmp_path / "act"), "gptq", group=32, desc_act=True, v2=True)
    with pytest.raises(ValueError, match="act-order .* do not split over tensor_parallel_size=2"):
        LLM(folder, tensor_parallel_size=2, **SMALL)
    assert not multiprocessing.active_children()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_on_gpus_equals_tp1(tiny, own_engine):
    """NCCL, one GPU per rank, CUDA graphs (collectives captured in them) and async scheduling
    (rank 0's tokens still on its GPU when the next step is queued)."""
    gpu = dict(device="cuda", max_num_seqs=16)
    assert_same(outputs_at(tiny, 1, **gpu), outputs_at(tiny, 2, **gpu), tol=1e-3)


@pytest.mark.parametrize("cfg, kwargs, error", [
    (dict(heads=4, kv_heads=2), dict(tensor_parallel_size=3), "4 attention heads are not divisible by tensor_parallel_size=3"),
    (dict(heads=6, kv_heads=4), dict(tensor_parallel_size=3), "4 KV heads do not split over tensor_parallel_size=3"),
    (dict(intermediate=130), dict(tensor_parallel_size=4), "intermediate_size 130 is not divisible"),
    ({}, dict(tensor_parallel_size=2, device="cuda"), "needs 2 GPUs"),
    ({}, dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni' runs one process"),
])
def test_layout_errors(tmp_path, cfg, kwargs, error):
    if "device" in kwargs and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    folder = write_tiny_llama(str(tmp_path / "m"), **cfg)
    with pytest.raises(ValueError, match=error):
        LLM(folder, **dict(SMALL, **kwargs))


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed (tests/test_ray_executor.py)")
def test_ray_missing_says_how_to_install(tiny):
    with pytest.raises(ValueError, match="pip install ray"):
        LLM(tiny, tensor_parallel_size=2, distributed_executor_backend="ray", **SMALL)
