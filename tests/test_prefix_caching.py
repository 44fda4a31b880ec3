"""Prefix caching, forked parallel samples and beam search on the real SmolLM2 (float32, CPU).

Caching must be invisible in the outputs: greedy and seeded tokens are the same with it on and
off, also when a tiny cache forces preemption and eviction and prompts are chunked. And it must
save work: the stats count the prompt tokens the model really ran on."""
import random

import pytest
import torch

from pagoda import LLM, BeamSearchParams, SamplingParams
from tests.conftest import TEST_KV_BYTES, assert_no_leaks

SYSTEM = ("You are a careful assistant for a railway company. You answer questions about timetables, "
          "tickets, refunds and accessibility. Be brief, quote the rule you rely on, and never invent "
          "a train that is not in the timetable. ") * 3
QUESTIONS = ["When does the first train leave?", "Can I get a refund for a delayed train?",
             "Is there step-free access at the main station?", "How much is a child ticket?",
             "Can I bring a bicycle?", "What if I miss my connection?"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def chat_prompts(tok, turns: int = 1, answers=None) -> list[list[int]]:
    """One conversation per question, sharing the system prompt; later turns hold the history."""
    prompts = []
    for i, q in enumerate(QUESTIONS):
        conv = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        for t in range(1, turns):
            conv += [{"role": "assistant", "content": answers[i][t - 1]},
                     {"role": "user", "content": f"And question {t + 1}: {QUESTIONS[(i + t) % len(QUESTIONS)]}"}]
        prompts.append(tok.encode(tok.apply_chat_template(conv, add_generation_prompt=True), add_special_tokens=False))
    return prompts


def run(llm, prompts, params=GREEDY):
    before = llm.get_stats()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = llm.get_stats()
    assert_no_leaks(llm)
    return ([o.outputs[0].token_ids for o in outs],
            after.num_prompt_tokens_computed - before.num_prompt_tokens_computed,
            after.prefix_cache_hits - before.prefix_cache_hits)


@pytest.fixture(scope="module")
def no_cache(smollm_path):
    return LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
               enable_prefix_caching=False)


def test_greedy_equal_with_caching_on_and_off_and_work_saved(llm, no_cache):
    tok = llm.get_tokenizer()
    turn1 = chat_prompts(tok)
    ref1, computed_off, hits_off = run(no_cache, turn1)
    assert computed_off == sum(map(len, turn1)) and hits_off == 0
    llm.reset_prefix_cache()
    got1, computed_on, hits_on = run(llm, turn1)
    assert got1 == ref1
    # The shared system prompt is computed once (plus whatever is in the same step's reach).
    assert hits_on > 0.6 * (len(turn1) - 1) * len(turn1[0]) and computed_on < 0.4 * computed_off
    # The second turn repeats the first turn's prompt: only the answer and the new question run.
    answers = [[tok.decode(a)] for a in ref1]
    turn2 = chat_prompts(tok, 2, answers)
    ref2, computed_off2, _ = run(no_cache, turn2)
    got2, computed_on2, _ = run(llm, turn2)
    assert got2 == ref2
    new_tokens = sum(len(p) - len(q) for p, q in zip(turn2, turn1))
    assert computed_on2 <= new_tokens + 16 * len(turn2), (computed_on2, new_tokens)
    assert computed_off2 == sum(map(len, turn2))
    # A second identical run reuses everything but each prompt's last block.
    again, computed_again, _ = run(llm, turn2)
    assert again == ref2 and computed_again <= 16 * len(turn2)


def test_equal_under_eviction_preemption_and_chunking(smollm_path, llm, no_cache):
    tok = llm.get_tokenizer()
    prompts = chat_prompts(tok)
    ref, _, _ = run(no_cache, prompts)
    # 20 blocks of 16 tokens cannot hold the six ~185-token conversations even with the system
    # prompt's 9 blocks shared: the engine must preempt, and cached blocks get evicted and
    # recomputed; a budget of 48 tokens chunks every prompt.
    tight = LLM(smollm_path, dtype="float32", num_gpu_blocks_override=21, max_model_len=256,
                max_num_batched_tokens=48)
    engine = tight.llm_engine
    for _ in range(2):
        got, _, _ = run(tight, prompts)
        assert got == ref
    stats = tight.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_blocks_free == stats.num_kv_blocks
    assert engine.kv_cache_manager.pool.num_cached_blocks <= stats.num_kv_blocks


def test_seeded_sampling_equal_with_caching_on_and_off(llm, no_cache):
    prompts = chat_prompts(llm.get_tokenizer())[:4]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=7, ignore_eos=True)
    ref, _, _ = run(no_cache, prompts, params)
    got, _, _ = run(llm, prompts, params)
    assert got == ref


def test_parallel_samples_compute_the_prompt_once(llm):
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 40000) for _ in range(1000)]    # fresh: no cache hits
    engine = llm.llm_engine
    params = SamplingParams(n=8, temperature=0.8, max_tokens=20, seed=11, ignore_eos=True)
    before = llm.get_stats()
    engine.add_request("fork", {"prompt_token_ids": prompt}, params)
    peak, outs = 0, []
    while engine.has_unfinished_requests():
        outs += engine.step()
        peak = max(peak, llm.get_stats().kv_blocks_in_use)
    after = llm.get_stats()
    assert_no_leaks(llm)
    samples = [c.token_ids for c in outs[-1].outputs]
    # The prompt runs once; each other sample computes only the prompt's last token.
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 1000 + 7
    assert after.num_forked_tokens - before.num_forked_tokens == 7 * 999
    # Blocks: the prompt's 63 once, then per sample a copy of the partial last prompt block
    # and its generated tokens' block (1000 + 20 tokens end in block 63): 63 + 7 + 8.
    assert peak == 63 + 7 + 8, peak
    assert len({tuple(s) for s in samples}) == 8, "the samples should differ at temperature 0.8"
    # Each sample is exactly what a lone request with its seed (seed + index, as vLLM) gives.
    for i in (0, 3, 7):
        lone = SamplingParams(temperature=0.8, max_tokens=20, seed=11 + i, ignore_eos=True)
        assert llm.generate({"prompt_token_ids": prompt}, lone, use_tqdm=False)[0].outputs[0].token_ids == samples[i]


def test_beam_search_top_beam_equals_hf(llm, hf_model):
    tok = llm.get_tokenizer()
    prompts = ["The capital of France is", "def add(a, b):", "My favourite season is"]
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    outs = llm.beam_search([{"prompt": p} for p in prompts], params)
    assert_no_leaks(llm)
    for p, out in zip(prompts, outs):
        ids = tok.encode(p)
        assert len(out.sequences) == 3
        scores = [s.cum_logprob for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, num_beams=3, do_sample=False,
                                    early_stopping=True, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        best = out.sequences[0]
        assert best.tokens == ref[0].tolist(), (tok.decode(best.tokens), tok.decode(ref[0].tolist()))
        assert best.text == tok.decode(best.tokens) and best.finish_reason == "length"


def test_beam_search_rejects_bad_params():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_beam_score_penalises_length_and_ignores_final_eos():
    from pagoda.beam_search import beam_score
    from pagoda.outputs import BeamSearchSequence
    short = BeamSearchSequence([5, 6, 7, 2], [], cum_logprob=-3.0)     # ends in EOS (id 2)
    long = BeamSearchSequence([5, 6, 7, 8, 9, 10], [], cum_logprob=-5.0)
    assert beam_score(short, 2, 1.0) == -1.0                            # 3 tokens, EOS not counted
    assert beam_score(long, 2, 1.0) == -5.0 / 6
    assert beam_score(short, 2, 0.0) > beam_score(long, 2, 0.0)         # no penalty: raw logprob
    assert beam_score(short, 2, 2.0) < beam_score(long, 2, 2.0)         # strong penalty favours long


def test_stat_logger_line(llm, caplog):
    import logging
    from pagoda.engine.stats import StatLogger
    logger = StatLogger(interval=0.0)
    with caplog.at_level(logging.INFO, logger="pagoda.engine"):
        logger.maybe_log(llm.get_stats())
    line = caplog.records[-1].getMessage()
    assert "Prefix cache hit rate" in line and "blocks in use" in line and "Running: 0 reqs" in line
