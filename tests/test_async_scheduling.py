"""Async scheduling with the real SmolLM2 on the CPU: the engine schedules step N+1 before step
N's tokens reach the host, and the runner feeds them from the device tensor (here, the CPU one).
Every output must equal the synchronous engine's (the `llm` fixture), whatever ends the
requests, and nothing may leak."""
import pytest

from pagoda import LLM, SamplingParams
from pagoda.runner.model_runner import ModelRunner
from tests.conftest import TEST_KV_BYTES, assert_no_leaks
from tests.test_generate_vs_hf import PROMPTS

MIXED = [
    SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=40),                                  # may hit EOS
    SamplingParams(temperature=0, max_tokens=30, stop=[".", "\n"]),                 # stop strings
    SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[13, 198]),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=40, max_tokens=25, seed=11, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=20, seed=5, n=3, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5,
                   presence_penalty=0.3, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, min_tokens=8, logit_bias={11: 5.0}),
    SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=1, seed=3),
]


@pytest.fixture(scope="module")
def async_llm(smollm_path):
    engine = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
                 async_scheduling=True)
    assert engine.llm_engine.async_scheduling
    return engine


@pytest.fixture
def pending_inputs(monkeypatch):
    """Counts the input ids that came from the device: proves the steps really overlapped."""
    counts = []
    real = ModelRunner._pending_input_ids

    def counting(self, *a):
        got = real(self, *a)
        counts.append(0 if got is None else len(got[0]))
        return got
    monkeypatch.setattr(ModelRunner, "_pending_input_ids", counting)
    return counts


def summary(outs):
    """Everything but the float values (see logprob_values): exact."""
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob is None,
              None if c.logprobs is None else [sorted((t, lp.rank) for t, lp in d.items()) for d in c.logprobs])
             for c in o.outputs] for o in outs]


def logprob_values(outs) -> list[float]:
    """The logprobs, compared with a tolerance: the two engines may compute a prompt with
    different batch shapes (one of them finds it in its prefix cache), so float32 rounding
    differs in the last bits."""
    vals = []
    for o in outs:
        for c in o.outputs:
            vals += [c.cumulative_logprob or 0.0]
            vals += [lp.logprob for d in c.logprobs or [] for _, lp in sorted(d.items())]
    return vals


def test_async_equals_sync_whatever_ends_the_requests(llm, async_llm, pending_inputs):
    prompts = PROMPTS[:len(MIXED)]
    sync = llm.generate(prompts, MIXED, use_tqdm=False)
    ours = async_llm.generate(prompts, MIXED, use_tqdm=False)
    assert sum(pending_inputs) > 100, "async steps should take their input ids from the device"
    assert summary(ours) == summary(sync)
    assert logprob_values(ours) == pytest.approx(logprob_values(sync), abs=1e-4)
    reasons = {c.finish_reason for o in sync for c in o.outputs}
    assert reasons == {"stop", "length"}
    assert any(isinstance(c.stop_reason, str) for o in sync for c in o.outputs), "a stop string must fire"
    assert_no_leaks(async_llm)


def test_async_seed_reproduces_whatever_shares_the_batch(llm, async_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 30, 9)]
    batch = async_llm.generate(PROMPTS[1:4] + [PROMPTS[0]], others + [p], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    assert_no_leaks(async_llm)


def test_async_under_chunking_and_preemption(smollm_path, llm):
    # A 4-token budget chunks every prompt; 24 blocks of 16 tokens cannot hold all requests
    # at once, so some are preempted, sometimes with a token still in flight.
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = PROMPTS[:8]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    tight = LLM(smollm_path, dtype="float32", num_gpu_blocks_override=25, max_model_len=384,
                max_num_batched_tokens=64, async_scheduling=True)
    ours = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert ours == expected
    assert_no_leaks(tight)


def test_async_abort_mid_run_with_a_step_in_flight(async_llm):
    engine = async_llm.llm_engine
    keep = engine.add_request(None, PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    drop = engine.add_request(None, PROMPTS[2], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request(drop)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert list(finished) == [keep] and len(finished[keep].outputs[0].token_ids) == 12
    assert engine._in_flight is None, "the last step is finished once nothing is left"
    assert_no_leaks(async_llm)
    engine.abort_request(engine.add_request(None, PROMPTS[3], SamplingParams(max_tokens=50)))
    assert_no_leaks(async_llm)
    out = async_llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert_no_leaks(async_llm)


def test_async_is_the_default_on_cuda_only(llm):
    assert not llm.llm_engine.async_scheduling       # CPU: the forward runs as it is called


def test_async_with_prefix_hits_and_forked_samples(llm, async_llm):
    """Prefix-cache hits and forks whose source blocks are written by a step still in flight."""
    from tests.test_prefix_caching import chat_prompts
    prompts = [{"prompt_token_ids": p} for p in chat_prompts(llm.get_tokenizer())[:4]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    forked = SamplingParams(n=4, temperature=0.8, max_tokens=12, seed=21, ignore_eos=True)
    async_llm.reset_prefix_cache()
    for _ in range(2):                       # the second round finds every prompt cached
        for params in (greedy, forked):
            ours = async_llm.generate(prompts, params, use_tqdm=False)
            ref = llm.generate(prompts, params, use_tqdm=False)
            assert [[c.token_ids for c in o.outputs] for o in ours] == [[c.token_ids for c in o.outputs] for o in ref]
    stats = async_llm.get_stats()
    assert stats.prefix_cache_hits > 0 and stats.num_forked_tokens > 0
    assert_no_leaks(async_llm)
