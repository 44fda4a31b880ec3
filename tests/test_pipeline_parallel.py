"""Pipeline parallelism on the CPU: the model split by layers over stages (processes meeting over
gloo), alone and with tensor parallelism inside each stage. Outputs must not depend on
pipeline_parallel_size; a stage holds, loads and caches only its own layers."""
import gc
import multiprocessing
import os
import signal

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.pipeline import get_pp_indices
from tests.test_tensor_parallel import (GREEDY, PROMPTS, SEEDED, SMALL, assert_same, assert_smollm2_greedy_matches,
                                        outputs_at, run, worker_procs, write_tiny_llama)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """Four layers: two stages of two, or two stages of two TP ranks each."""
    return write_tiny_llama(str(tmp_path_factory.mktemp("pp") / "tiny4"), layers=4)


@pytest.fixture(scope="module")
def reference(tiny4):
    return outputs_at(tiny4, 1)


@pytest.mark.parametrize("layers, pp, sizes", [(4, 2, [2, 2]), (3, 2, [2, 1]), (4, 3, [1, 2, 1]),
                                               (30, 4, [7, 8, 8, 7]), (5, 5, [1] * 5)])
def test_layer_split(layers, pp, sizes):
    """An even split, the remainder one each to the stages before the last (vLLM's split)."""
    spans = [get_pp_indices(layers, rank, pp) for rank in range(pp)]
    assert [end - start for start, end in spans] == sizes
    assert [start for start, _ in spans] == [0] + [end for _, end in spans[:-1]] and spans[-1][1] == layers


def _stage(worker):
    """What a rank holds: its layers, its KV caches, whether it has the embedding and the LM head."""
    m = worker.runner.model
    return (m.model.start_layer, m.model.end_layer, len(worker.runner.kv_caches),
            hasattr(m.model.embed_tokens, "weight"), hasattr(m.lm_head, "weight"))


@pytest.mark.parametrize("pp", [2, 3])
def test_pp_equals_pp1(tiny4, reference, pp):
    """Greedy tokens, their logprobs, prompt logprobs (sampled on the last stage, sent to the
    engine) and seeded n=2 samples equal one process's, with async scheduling; at pp=3 the
    middle stage both receives and sends (layers 1 + 2 + 1)."""
    assert_same(reference, outputs_at(tiny4, 1, pipeline_parallel_size=pp, async_scheduling=True))


def test_pp2_keeps_a_batch_in_flight_per_stage(tiny4):
    """The engine queues a second step before the first one's tokens are back, over requests
    that have no token in flight (each step takes half of the running ones), so that both
    stages have a batch: greedy tokens and seeded samples still equal one process's."""
    prompts = [{"prompt_token_ids": [3 + i, 40 + 7 * i, 100 + i, 9]} for i in range(6)]
    ref = LLM(tiny4, **SMALL)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, use_tqdm=False)], run(ref, SEEDED)
    del ref
    llm = LLM(tiny4, pipeline_parallel_size=2, **SMALL)
    try:
        engine = llm.llm_engine
        steps, execute = [], engine.executor.execute_model

        def recording(sched):
            in_flight = [set(s.num_scheduled_tokens) for s, _ in engine._batch_queue]
            steps.append((set(sched.num_scheduled_tokens), in_flight))
            return execute(sched)

        engine.executor.execute_model = recording
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], run(llm, SEEDED)
        assert got[0] == expected[0]
        assert [[c.token_ids for c in o] for o in got[1]] == [[c.token_ids for c in o] for o in expected[1]]
        beside = [(ids, others) for ids, others in steps if ids and others]
        assert len(beside) >= 10, steps               # most steps ran beside another
        assert all(len(ids) == 3 and not ids & others[0] for ids, others in beside[1:])
    finally:
        vars(llm.llm_engine.executor).pop("execute_model", None)   # (a cycle gc.freeze keeps alive)
        del llm
        gc.collect()


def test_pp2_batch_queue_with_preemption_and_aborts(tiny4):
    """A cache too small for the batch (requests preempted while their tokens are in flight)
    and requests aborted mid-way, over two stages with a batch each: the others' greedy tokens
    equal one process's under the same cache, and every block comes back."""
    tight = dict(SMALL, num_gpu_blocks_override=12, block_size=8, max_num_seqs=8, max_model_len=64)
    prompts = [{"prompt_token_ids": [7 + i] * (5 + 3 * i)} for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ref = LLM(tiny4, **tight)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    del ref
    llm = LLM(tiny4, pipeline_parallel_size=2, **tight)
    try:
        engine = llm.llm_engine
        ids = [engine.add_request(None, p, params) for p in prompts]
        done, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 6:
                engine.abort_request([ids[1], ids[6]])
        assert engine.stats.num_preemptions > 0
        assert {i: done[r] for i, r in enumerate(ids) if r in done} == {
            i: e for i, e in enumerate(expected) if i not in (1, 6)}
        pool = engine.kv_cache_manager.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
    finally:
        del llm
        gc.collect()


def test_pp2_fp8_kv_cache(tiny4):
    """An FP8 KV cache split by layers over two stages: one process's outputs."""
    assert_same(outputs_at(tiny4, 1, kv_cache_dtype="fp8"), outputs_at(tiny4, 1, pipeline_parallel_size=2,
                                                                        kv_cache_dtype="fp8"))


def test_uneven_split_tied_embeddings(tmp_path):
    """Three layers over two stages: the first stage runs two (as vLLM splits), the last one and
    the LM head, which loads the tied embedding's tensor. Each stage caches only its own layers,
    so fits more blocks than the whole model would; the engine takes the smaller count."""
    folder = write_tiny_llama(str(tmp_path / "tied3"), layers=3, tied=True, seed=2)
    ref = outputs_at(folder, 1)
    llm = LLM(folder, pipeline_parallel_size=2, **SMALL)
    try:
        executor = llm.llm_engine.executor
        first, last = executor.collective_rpc(_stage)
        assert first == (0, 2, 2, True, False) and last == (2, 3, 1, False, True)
        counts = executor.collective_rpc("determine_num_blocks")
        assert counts[1] > counts[0] and llm.llm_engine.config.cache.num_blocks == counts[0]
        assert_same(ref, (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED)))
    finally:
        del llm
        gc.collect()


def test_tp2_pp2_equals_tp1(tiny4, reference):
    """Four processes: two stages, each a tensor-parallel group of two (its all-reduces within
    the stage), each rank passing activations to its peer in
    the next stage. `del llm` leaves no process behind."""
    llm = LLM(tiny4, tensor_parallel_size=2, pipeline_parallel_size=2, **SMALL)
    procs = worker_procs(llm)
    stages = llm.llm_engine.executor.collective_rpc(_stage)
    assert stages == [(0, 2, 2, True, False)] * 2 + [(2, 4, 2, False, True)] * 2
    assert_same(reference, (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED)))
    del llm
    assert len(procs) == 3 and not any(p.is_alive() for p in procs)


def test_dead_stage_raises_and_del_leaves_no_process(tiny4):
    llm = LLM(tiny4, pipeline_parallel_size=2, **SMALL)
    [proc] = worker_procs(llm)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert not multiprocessing.active_children()


def test_smollm2_pp2_equals_pp1(llm, smollm_path):
    """The real model (30 layers, tied embeddings, a GGUF file) over two stages."""
    assert_smollm2_greedy_matches(llm, smollm_path, pipeline_parallel_size=2)


def _break_last_stage(worker):
    def broken(*args):
        raise KeyError("the last stage's forward broke")
    if worker.rank == 1:
        worker.runner._forward_stage = broken


def test_stage_error_surfaces_on_rank0(tiny4):
    """The last stage fails in its forward while rank 0 waits for its tokens: rank 0 raises the
    worker's error (its traceback), not a timeout, and no process is left."""
    llm = LLM(tiny4, pipeline_parallel_size=2, **SMALL)
    llm.llm_engine.executor.collective_rpc(_break_last_stage)
    with pytest.raises(RuntimeError, match="(?s)worker rank 1 failed.*KeyError: .the last stage's forward broke"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert not multiprocessing.active_children()


def test_layout_errors(tiny4):
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is more than the model's 4 layers"):
        LLM(tiny4, pipeline_parallel_size=5, **SMALL)
    with pytest.raises(ValueError, match="'uni' runs one process"):
        LLM(tiny4, pipeline_parallel_size=2, distributed_executor_backend="uni", **SMALL)
    assert not multiprocessing.active_children()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_pp2_on_gpus_equals_pp1(tiny4):
    """Two stages on two GPUs, activations sent over NCCL (eager: no graphs with pp > 1)."""
    gpu = dict(device="cuda", max_num_seqs=16)
    assert_same(outputs_at(tiny4, 1, **gpu), outputs_at(tiny4, 1, pipeline_parallel_size=2, **gpu), tol=1e-3)
