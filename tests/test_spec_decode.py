"""Speculative decoding with n-gram drafts (vLLM's speculative_config, method "ngram"): the
proposer's lookup; greedy output equal to the engine's without drafts, on the real SmolLM2 and
over tensor-parallel ranks, whatever ends the requests; sampled output distributed as without
drafts; requests the drafts cannot serve (logprobs, penalties, grammar) mixed in; the errors."""
import gc

import numpy as np
import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.core.ngram_proposer import NgramProposer
from tests.conftest import TEST_KV_BYTES, assert_no_leaks
from tests.test_tensor_parallel import write_tiny_llama

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# Chats whose answers copy their prompts: the drafts are often right.
CHATS = [[{"role": "user", "content": "Fix the typo and print the whole code again:\ndef add(a, b):\n"
                                      "    retrun a + b\n\nprint(add(2, 3))"}],
         [{"role": "user", "content": "Repeat this sentence three times: The quick brown fox jumps over the lazy dog."}],
         [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}]]


def proposer(**kw) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(**{"num_speculative_tokens": 3, **kw}))


def test_proposer_takes_the_longest_then_latest_match():
    p = proposer(prompt_lookup_min=1, prompt_lookup_max=3)
    # The 3-gram 1 2 3 occurs once before the end: what followed it (7 8 9), not the 1-gram's.
    assert p.propose("a", [1, 2, 3, 7, 8, 9, 5, 3, 4, 1, 2, 3], 10) == [7, 8, 9]
    # Two earlier occurrences of 5 6: the latest one's continuation.
    assert p.propose("b", [5, 6, 1, 5, 6, 2, 0, 5, 6], 10) == [2, 0, 5]
    assert p.propose("b", [5, 6, 1, 5, 6, 2, 0, 5, 6], 2) == [2, 0]          # the caller's limit
    assert p.propose("c", [4, 5, 6, 7], 3) == []                              # nothing repeats
    # Up to the end of the sequence: a match right before the suffix proposes what is left.
    assert p.propose("d", [9, 9, 9], 3) == [9]
    q = proposer(prompt_lookup_min=3, prompt_lookup_max=3)
    assert q.propose("e", [1, 2, 5, 1, 2], 3) == []                           # no 3-gram matches
    # The request's array grows with its tokens, and starts over when they are fewer (recomputed).
    tokens = [3, 1, 4, 1]
    assert p.propose("f", tokens, 3) == [4, 1]
    tokens += [5, 9, 2, 6, 4, 1]
    assert p.propose("f", tokens, 3) == [5, 9, 2]
    assert p.propose("f", [8, 8], 3) == [8]
    p.forget("f")
    assert "f" not in p.arrays


def test_config_checks(smollm_path, tmp_path):
    assert SpeculativeConfig(num_speculative_tokens=2).prompt_lookup_min == 5
    assert SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).prompt_lookup_min == 3
    for bad, match in [({"method": "eagle", "num_speculative_tokens": 2}, "ngram"),
                       ({"method": "ngram"}, "num_speculative_tokens"),
                       ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup"),
                       ({"num_speculative_tokens": 2, "draft": "x"}, "Unknown speculative_config keys")]:
        with pytest.raises(ValueError, match=match):
            LLM(smollm_path, speculative_config=bad)
    with pytest.raises(ValueError, match="async_scheduling off"):
        LLM(smollm_path, speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="pooling runner"):
        LLM(smollm_path, speculative_config=NGRAM, runner="pooling")
    tiny = write_tiny_llama(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(tiny, skip_tokenizer_init=True, speculative_config=NGRAM, pipeline_parallel_size=2)


@pytest.fixture(scope="module")
def spec_llm(smollm_path):
    engine = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
                 speculative_config=NGRAM)
    yield engine
    del engine
    gc.collect()


def counters(llm):
    s = llm.llm_engine.stats
    return s.num_steps, s.num_generation_tokens, s.num_draft_tokens, s.num_accepted_tokens


def texts_and_ids(outs):
    return [(c.text, c.token_ids, c.finish_reason) for o in outs for c in o.outputs]


@pytest.mark.parametrize("ends", ["length", "max_tokens_odd", "stop_string", "eos"])
def test_greedy_equals_without_drafts(llm, spec_llm, ends):
    """Token for token the engine's greedy output without drafts, whether a request ends at
    max_tokens (also inside a run of kept drafts), a stop string or EOS; in fewer steps than
    tokens; every block back in the pool."""
    params = {"length": SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
              "max_tokens_odd": SamplingParams(temperature=0, max_tokens=21),
              "stop_string": SamplingParams(temperature=0, max_tokens=64, stop=["b)", "fox"]),
              "eos": SamplingParams(temperature=0, max_tokens=200)}[ends]
    want = llm.chat(CHATS, params, use_tqdm=False)
    before = counters(spec_llm)
    got = spec_llm.chat(CHATS, params, use_tqdm=False)
    assert texts_and_ids(got) == texts_and_ids(want)
    steps, tokens, drafted, kept = (a - b for a, b in zip(counters(spec_llm), before))
    # (Tokens kept past a stop string in the step that met it are generated, not output.)
    output = sum(len(c.token_ids) for o in got for c in o.outputs)
    assert tokens == output if ends != "stop_string" else tokens >= output
    assert drafted > 0 and kept > 0
    assert steps < max(len(c.token_ids) for o in got for c in o.outputs) + 1
    assert_no_leaks(spec_llm)


def assert_same_logprobs(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        assert all(abs(g[t].logprob - w[t].logprob) < 1e-4 and g[t].rank == w[t].rank for t in g)


def test_requests_without_drafts_share_the_batch(llm, spec_llm):
    """Requests the drafts do not serve (penalties, min_tokens) run in the same steps as those
    with drafts (and with logprobs) and get what they get without speculative decoding."""
    batch = [SamplingParams(temperature=0, max_tokens=40),
             SamplingParams(temperature=0, max_tokens=40, logprobs=2),
             SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=30)]
    prompts = [llm.get_tokenizer().apply_chat_template(CHATS[0], add_generation_prompt=True)] * len(batch)
    want = llm.generate(prompts, batch, use_tqdm=False)
    got = spec_llm.generate(prompts, batch, use_tqdm=False)
    assert texts_and_ids(got) == texts_and_ids(want)
    assert_same_logprobs(got[1].outputs[0].logprobs, want[1].outputs[0].logprobs)
    assert_no_leaks(spec_llm)


def test_logprobs_of_kept_drafts(llm, spec_llm):
    """With logprobs a request takes drafts too: each kept token's logprobs (and the cumulative
    logprob) are those of its own position, as without drafts; also for a request that samples
    its first token in a step where a request with drafts comes before it in the batch."""
    tok = llm.get_tokenizer()
    long, short = (tok.apply_chat_template(c, add_generation_prompt=True) for c in (CHATS[1], CHATS[2]))
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=3, ignore_eos=True)
    want = llm.generate([long, short], params, use_tqdm=False)
    engine = spec_llm.llm_engine
    kept = engine.stats.num_accepted_tokens
    engine.add_request("long", long, params)
    for _ in range(40):                                         # until its drafts are being kept
        if engine.stats.num_accepted_tokens > kept:
            break
        engine.step()
    assert engine.stats.num_accepted_tokens > kept
    engine.add_request("short", short, params)
    got = {}
    while engine.has_unfinished_requests():
        got.update((o.request_id, o) for o in engine.step())
    for name, w in zip(["long", "short"], want):
        g = got[name].outputs[0]
        assert g.token_ids == w.outputs[0].token_ids
        assert_same_logprobs(g.logprobs, w.outputs[0].logprobs)
        assert abs(g.cumulative_logprob - w.outputs[0].cumulative_logprob) < 1e-3
    assert engine.stats.num_accepted_tokens > kept + 2
    assert_no_leaks(spec_llm)


def test_sampling_is_distributed_as_without_drafts(smollm_path, llm):
    """300 seeded samples at temperature 0.9 of an answer that copies its prompt: wherever the
    n-gram lookup has a guess for the next token (the first draft it would propose there), how
    often the sample took it is the same as without drafts, within sampling noise. A rule that
    kept drafts more often than the model picks them would raise it."""
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Repeat exactly: apple banana cherry apple banana cherry apple banana cherry"}],
        add_generation_prompt=True)
    params = [SamplingParams(temperature=0.9, max_tokens=10, seed=i, ignore_eos=True) for i in range(300)]
    # One draft a step: most positions the lookup has a guess for are a draft's.
    two = {**NGRAM, "num_speculative_tokens": 1}
    spec_llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
                   speculative_config=two)
    lookup = NgramProposer(SpeculativeConfig(**two))
    rates = []
    for engine in (llm, spec_llm):
        before = counters(engine)
        outs = engine.generate([prompt] * len(params), params, use_tqdm=False)
        n_prompt = len(outs[0].prompt_token_ids)
        took = []
        for i, o in enumerate(outs):
            seq = list(outs[0].prompt_token_ids) + list(o.outputs[0].token_ids)
            for t in range(n_prompt, len(seq)):
                guess = lookup.propose(f"{i}:{t}", seq[:t], 1)
                if guess:
                    took.append(guess[0] == seq[t])
        rates.append((np.mean(took), len(took)))
        print(rates[-1])
        kept = counters(engine)[3] - before[3]
    assert kept > 50, "few drafts were kept: the test checks little"
    (base, n_base), (spec, n_spec) = rates
    assert 0.2 < base < 0.8, f"the model takes the guesses too often or too rarely to tell ({base})"
    noise = np.sqrt(base * (1 - base) * (1 / n_base + 1 / n_spec))
    assert abs(spec - base) < 4 * noise, (rates, noise)
    assert_no_leaks(spec_llm)
    del spec_llm
    gc.collect()


def test_drafts_off_above_the_batch_limit_and_under_a_tight_budget(smollm_path, llm):
    """disable_by_batch_size: no drafts while that many requests are running or waiting. A step
    budget of four tokens: drafts only where it leaves room; outputs unchanged."""
    params = SamplingParams(temperature=0, max_tokens=30)
    want = llm.chat(CHATS, params, use_tqdm=False)
    engine = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
                 speculative_config={**NGRAM, "disable_by_batch_size": 2}, max_num_batched_tokens=4)
    scheduler = engine.llm_engine.scheduler
    schedule, steps = scheduler.schedule, []

    def recording_schedule():
        in_engine = len(scheduler.running) + len(scheduler.waiting)
        out = schedule()
        steps.append((in_engine, sum(map(len, out.spec_token_ids.values())), out.total_num_scheduled_tokens))
        return out

    scheduler.schedule = recording_schedule
    try:
        got = engine.chat(CHATS, params, use_tqdm=False)
        assert texts_and_ids(got) == texts_and_ids(want)
        assert all(drafts == 0 for n, drafts, _ in steps if n >= 2)
        assert any(drafts > 0 for n, drafts, _ in steps if n == 1)      # the last request, alone
        assert max(total for _, _, total in steps) <= 4
        assert engine.llm_engine.stats.num_draft_tokens == sum(d for _, d, _ in steps)
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_tensor_parallel_ranks_keep_the_same_drafts(tmp_path):
    """tp=2 with drafts: the output of one process without them (every rank checks the drafts
    against the driver's sampled tokens and writes the same ones into its rows)."""
    # (Random weights rarely repeat themselves; with this seed some drafts are kept, some not.)
    tiny = write_tiny_llama(str(tmp_path / "m"), heads=4, kv_heads=2, seed=4)
    small = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9], [1, 2, 3, 4] * 6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one = LLM(tiny, **small)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    gc.collect()
    two = LLM(tiny, tensor_parallel_size=2, speculative_config={**NGRAM, "prompt_lookup_min": 1}, **small)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats = two.llm_engine.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert_no_leaks(two)
    finally:
        del two
        gc.collect()
