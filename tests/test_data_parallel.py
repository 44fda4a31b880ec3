"""Data parallelism on the CPU: data_parallel_size engine replicas in spawned processes behind a
front in this one. Outputs must not depend on data_parallel_size; requests must spread over the
replicas, bad ones must leave them running, and every replica (and its own tensor-parallel
workers) must go away with the engine."""
import asyncio
import gc
import multiprocessing
import os
import signal
import time

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.dp_replica import cpu_share, replica_env
from tests.test_tensor_parallel import GREEDY, PROMPTS, SEEDED, SMALL, assert_same, outputs_at, run, write_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(str(tmp_path_factory.mktemp("dp") / "tiny"))


@pytest.fixture(scope="module")
def reference(tiny):
    return outputs_at(tiny, 1)


@pytest.fixture(scope="module")
def dp2(tiny):
    llm = LLM(tiny, data_parallel_size=2, **SMALL)
    yield llm
    del llm
    gc.collect()


def replica_procs(llm):
    return list(llm.llm_engine.replicas.procs)


def _worker_pids(engine):
    return [p.pid for p in engine.executor.procs]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_dp2_equals_dp1(dp2, reference):
    """Greedy tokens, their logprobs, prompt logprobs and seeded samples (n=2, top-p/top-k)
    from two replicas equal one engine's."""
    assert_same(reference, (dp2.generate(PROMPTS, GREEDY, use_tqdm=False), run(dp2, SEEDED)))


def test_requests_spread_over_replicas_and_samples_stay_together(dp2):
    before = dp2.llm_engine.replica_stats()
    dp2.generate([{"prompt_token_ids": [7] * 20}] * 4, SamplingParams(max_tokens=2), use_tqdm=False)
    mid = dp2.llm_engine.replica_stats()
    assert [m.num_prompt_tokens - b.num_prompt_tokens for m, b in zip(mid, before)] == [40, 40]
    # One prompt's 3 samples: all on one replica, which forks the prompt's KV for two of them.
    dp2.generate({"prompt_token_ids": list(range(10, 50))}, SamplingParams(n=3, max_tokens=2), use_tqdm=False)
    after = dp2.llm_engine.replica_stats()
    assert sorted(a.num_prompt_tokens - m.num_prompt_tokens for a, m in zip(after, mid)) == [0, 120]
    assert sum(a.num_forked_tokens - m.num_forked_tokens for a, m in zip(after, mid)) > 0
    total = dp2.get_stats()
    assert total.num_prompt_tokens == sum(a.num_prompt_tokens for a in after)
    assert total.num_kv_blocks == sum(a.num_kv_blocks for a in after)
    assert dp2.reset_prefix_cache()


def _slow_steps(engine, seconds):
    """(Run in a replica) each step of its engine takes ``seconds`` longer."""
    step = type(engine).step

    def slow(self):
        time.sleep(seconds)
        return step(self)
    engine.step = slow.__get__(engine)


def test_replicas_step_on_their_own(tiny):
    """A slow replica does not hold back the other: its steps are still under way while the
    other's come back (no lock step), and both requests complete with their tokens."""
    llm = LLM(tiny, data_parallel_size=2, **SMALL)
    try:
        front = llm.llm_engine
        front._call(1, _slow_steps, 0.5)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        front.add_request("fast", PROMPTS[0], params)      # replica 0 (the least loaded, then 1)
        front.add_request("slow", PROMPTS[1], params)
        seen = []
        while front.has_unfinished_requests():
            seen.append({o.request_id: len(o.outputs[0].token_ids) for o in front.step()})
        fast_done = next(i for i, outs in enumerate(seen) if outs.get("fast") == 6)
        assert "slow" not in {rid for outs in seen[:fast_done + 1] for rid in outs}, seen
        assert seen[-1].get("slow") == 6
    finally:
        del llm
        gc.collect()


def test_bad_request_leaves_replicas_running(dp2):
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        dp2.generate([PROMPTS[0], {"prompt_token_ids": [5] * 300}], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="already in use"):
        dp2.llm_engine.add_request("x", PROMPTS[0])
        dp2.llm_engine.add_request("x", PROMPTS[1])
    dp2.llm_engine.abort_request("x")
    assert all(p.is_alive() for p in replica_procs(dp2))
    assert not dp2.llm_engine.has_unfinished_requests()
    out = dp2.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4, 4]
    assert all(s.num_running == s.num_waiting == 0 for s in dp2.llm_engine.replica_stats())


def _async_greedy(engine: AsyncLLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def one(i):
        async for out in engine.generate(PROMPTS[i], params, f"req-{i}"):
            pass
        return out.outputs[0].token_ids

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return asyncio.run(all_of_them())


def test_async_llm_over_replicas(dp2, reference):
    """The engine front (DPEngine) on AsyncLLM's thread drives the replicas as it drives one engine."""
    engine = AsyncLLM(dp2.llm_engine)
    try:
        assert _async_greedy(engine) == [o.outputs[0].token_ids for o in reference[0]]
    finally:
        engine.shutdown()
    assert dp2.get_stats().num_running == 0 and not dp2.llm_engine.has_unfinished_requests()


def test_server_engine_cores_over_replicas(tiny, reference):
    """`pagoda serve -dp 2`'s engine: one engine core process a replica, each stepping on its own;
    greedy tokens equal one engine's, the requests spread over both, the processes end with it."""
    from pagoda.engine.arg_utils import EngineArgs
    engine = AsyncLLM.from_engine_args(EngineArgs(tiny, data_parallel_size=2, **SMALL))
    try:
        assert len(engine._cores) == 2
        assert _async_greedy(engine) == [o.outputs[0].token_ids for o in reference[0]]
        assert all(s.num_generation_tokens > 0 for s in engine._stats)
        assert engine.stats.num_generation_tokens == 3 * 12
    finally:
        engine.shutdown()
    assert not any(core.procs[0].is_alive() for core in engine._cores)


def test_server_layout_error_raises_from_the_replicas(tiny):
    """The server's front checks the layout without an engine config (that would start CUDA in
    the API server's process): one that does not split is refused up front."""
    from pagoda.engine.arg_utils import EngineArgs
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        AsyncLLM.from_engine_args(EngineArgs(tiny, data_parallel_size=2, tensor_parallel_size=3, **SMALL))
    assert set(multiprocessing.active_children()) == before       # nothing started


def test_dead_replica_raises_and_takes_the_rest_down(tiny):
    llm = LLM(tiny, data_parallel_size=2, **SMALL)
    procs = replica_procs(llm)
    os.kill(procs[1].pid, signal.SIGKILL)
    procs[1].join()
    start = time.time()
    with pytest.raises(RuntimeError, match=r"data parallel replica 1 died \(exit code -9\)"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.time() - start < 30
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="has stopped"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_dp2_tp2_equals_dp1_and_exits_with_every_worker(tiny, reference):
    """Two replicas of two tensor-parallel ranks each (four model processes); `del llm` ends the
    replicas and their workers."""
    if torch.cuda.is_available() and torch.cuda.device_count() < 4:
        pytest.skip("on CUDA, two replicas of two ranks need four GPUs")
    llm = LLM(tiny, data_parallel_size=2, tensor_parallel_size=2, **SMALL)
    workers = [pid for pids in llm.llm_engine._call_all(_worker_pids) for pid in pids]
    assert len(workers) == 2 and all(alive(pid) for pid in workers)
    assert_same(reference, (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED)))
    procs = replica_procs(llm)
    del llm       # (no gc.collect(): the front holds no reference cycle)
    assert not any(p.is_alive() for p in procs)
    deadline = time.time() + 10          # (orphaned workers are reaped by init, a moment later)
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers)


def test_start_up_failure_raises_and_leaves_no_process(tiny, dp2):
    """A replica's ValueError at start-up (its KV cache too small) is raised by LLM(...)."""
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="less than one sequence of max_model_len"):
        LLM(tiny, data_parallel_size=2, **dict(SMALL, kv_cache_memory_bytes=1 << 12))
    # (a set: the list comes from one, in no fixed order once processes came and went)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.parametrize("kwargs, error", [
    (dict(data_parallel_size=0), "data_parallel_size must be at least 1"),
    (dict(data_parallel_size=2, tensor_parallel_size=2, device="cuda"),
     "data_parallel_size=2 x tensor_parallel_size=2 x pipeline_parallel_size=1 needs 4 GPUs"),
])
def test_layout_errors(tiny, kwargs, error):
    if "device" in kwargs and torch.cuda.device_count() >= 4:
        pytest.skip("this machine has the GPUs")
    with pytest.raises(ValueError, match=error):
        LLM(tiny, **dict(SMALL, **kwargs))


def test_cpu_share():
    """Each replica its own cores; with fewer cores than replicas, they share one."""
    assert [cpu_share(d, 2, [0, 1, 2, 3]) for d in range(2)] == [[0, 2], [1, 3]]
    assert [cpu_share(d, 3, [4, 5]) for d in range(3)] == [[4], [5], [4]]


def test_replica_gpus(monkeypatch):
    """Replica d of dp=2 x tp=2 sees the visible GPUs 2d and 2d+1, as its cuda:0 and cuda:1."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [replica_env(d, 2, 2) for d in range(2)] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert [replica_env(d, 2, 2)["CUDA_VISIBLE_DEVICES"] for d in range(2)] == ["3,5", "6,7"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_dp2_on_gpus_equals_dp1(tiny):
    """Two replicas, each on its own GPU (CUDA_VISIBLE_DEVICES), with CUDA graphs."""
    gpu = dict(device="cuda", max_num_seqs=16)
    assert_same(outputs_at(tiny, 1, **gpu), outputs_at(tiny, 1, data_parallel_size=2, **gpu), tol=1e-3)
