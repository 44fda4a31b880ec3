"""Speculative decoding with a draft model (speculative_config {"model": ..., ...}): greedy output
equal to the engine's without drafts, whatever the draft proposes; a draft equal to the target
has every draft kept, which holds only if its KV (in the target's blocks) is right after chunked
prefills, prefix-cache hits, forked samples and preemptions; tp=2; the scheduler's lookahead
slots and the held drafts; the errors."""
import gc
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.core.model_drafts import ModelDrafts
from pagoda.model.hub import ModelNotFoundError
from tests.conftest import TEST_KV_BYTES, assert_no_leaks
from tests.test_spec_decode import CHATS, texts_and_ids
from tests.test_tensor_parallel import write_tiny_llama

SMALL = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128)
PROMPTS = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 3, 9, 3, 9], [1, 2, 3, 4] * 6,
                                             list(range(10, 50)))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny target, a smaller random draft of its vocabulary, and the target's outputs."""
    folder = tmp_path_factory.mktemp("draft")
    target = write_tiny_llama(str(folder / "target"), heads=4, kv_heads=2, seed=4)
    draft = write_tiny_llama(str(folder / "draft"), heads=2, kv_heads=1, hidden=32, layers=1, seed=5)
    plain = LLM(target, **SMALL)
    want = ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    del plain
    gc.collect()
    return target, draft, want


def ids(outs):
    return [c.token_ids for o in outs for c in o.outputs]


def spec(model, k=3, **kw):
    return {"model": model, "num_speculative_tokens": k, **kw}


def test_method_and_checks(smollm_path, tmp_path, tiny):
    target, draft, _ = tiny
    assert SpeculativeConfig(model="m", num_speculative_tokens=2).method == "draft_model"
    assert SpeculativeConfig(num_speculative_tokens=2).method == "ngram"
    assert SpeculativeConfig(model="[ngram]", num_speculative_tokens=2).method == "ngram"     # vLLM's older name
    for bad, match in [({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
                       ({"method": "ngram", "model": draft, "num_speculative_tokens": 2}, "takes no model"),
                       (spec(draft, 0), "num_speculative_tokens"),
                       (spec(draft, draft_tensor_parallel_size=2), "draft_tensor_parallel_size"),
                       (spec(draft, quantization="int3"), "int3")]:
        with pytest.raises(ValueError, match=match):
            LLM(target, speculative_config=bad, **SMALL)
    with pytest.raises(ModelNotFoundError, match="nowhere"):
        LLM(target, speculative_config=spec(str(tmp_path / "nowhere")), **SMALL)
    with pytest.raises(ValueError, match="vocabulary"):      # SmolLM2's 49,152 entries, the tiny target's 509
        LLM(target, speculative_config=spec(smollm_path), **SMALL)
    short = write_tiny_llama(str(tmp_path / "short"))
    with open(os.path.join(short, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(short, "config.json"), "w") as f:
        json.dump({**cfg, "max_position_embeddings": 64}, f)
    with pytest.raises(ValueError, match="draft model's context"):
        LLM(target, speculative_config=spec(short), **SMALL)


def test_held_drafts_serve_only_the_tokens_they_follow():
    drafts = ModelDrafts(SpeculativeConfig(model="m", num_speculative_tokens=3))
    drafts.receive("a", 4, [7, 8, 9])
    assert drafts.propose("a", [1, 2, 3, 4], 2) == [7, 8]         # the caller's limit
    assert drafts.propose("a", [1, 2, 3, 4], 3) == []             # taken once
    drafts.receive("b", 4, [7, 8, 9])
    assert drafts.propose("b", [1, 2, 3, 4, 5], 3) == []          # proposed after other tokens
    drafts.receive("c", 2, [1])
    drafts.forget("c")
    assert drafts.propose("c", [1, 2], 3) == []


@pytest.mark.parametrize("which", ["random_draft", "target_as_draft"])
def test_greedy_equals_without_drafts(tiny, which):
    """A random draft has its drafts rejected, the target as its own draft has all kept: the
    same output either way; fewer steps than tokens when kept; every block back."""
    target, draft, want = tiny
    engine = LLM(target, speculative_config=spec(draft if which == "random_draft" else target), **SMALL)
    try:
        assert ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        s = engine.llm_engine.stats
        assert s.num_draft_tokens > 0
        if which == "target_as_draft":
            assert s.num_accepted_tokens == s.num_draft_tokens
            assert s.num_steps <= 2 + 24 // 4 + 1
        else:
            assert s.num_accepted_tokens < s.num_draft_tokens / 2
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_draft_kv_right_under_chunking_prefix_hits_forks_and_preemption(tiny):
    """The target as its own draft keeps every draft only if the draft's KV is right: prompts
    chunked 8 tokens a step, a shared prefix found in the cache, two samples of one prompt
    (forked blocks), and a cache too small for all at once (preemptions, recomputed)."""
    target, _, _ = tiny
    shared = list(range(60, 92))
    prompts = [{"prompt_token_ids": p} for p in [shared + [3, 4], shared + [5, 6], shared + [7, 8],
                                                 list(range(100, 130)), list(range(200, 230))]]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    twins = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=2)

    def run(engine):        # (the two samples alone: the second forks the first's prompt)
        return ids(engine.generate(prompts, params, use_tqdm=False)) + \
            ids(engine.generate(prompts[3], twins, use_tqdm=False))

    plain = LLM(target, **SMALL)
    want = run(plain)
    del plain
    gc.collect()
    tight = dict(SMALL, kv_cache_memory_bytes=None, num_gpu_blocks_override=10, max_num_batched_tokens=8)
    engine = LLM(target, speculative_config=spec(target, 4), **tight)
    try:
        assert run(engine) == want
        s = engine.llm_engine.stats
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.num_forked_tokens > 0
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_tensor_parallel_ranks_run_the_draft_sharded(tiny):
    """tp=2: both models sharded over the ranks, the driver's draft tokens sent to the other:
    the output of one process without drafts."""
    target, draft, want = tiny
    engine = LLM(target, tensor_parallel_size=2, speculative_config=spec(target), **SMALL)
    try:
        assert ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
        s = engine.llm_engine.stats
        assert s.num_accepted_tokens == s.num_draft_tokens > 0
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_smollm2_drafting_for_itself(smollm_path, llm):
    """The real SmolLM2 as its own draft (float32): the chats' greedy answers of the engine without
    drafts, nearly every draft kept (a forward of several positions may round a near-tie
    differently from one of a single position)."""
    params = SamplingParams(temperature=0, max_tokens=32)
    want = llm.chat(CHATS[:2], params, use_tqdm=False)
    engine = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=1024,
                 speculative_config=spec(smollm_path, 4))
    try:
        assert texts_and_ids(engine.chat(CHATS[:2], params, use_tqdm=False)) == texts_and_ids(want)
        s = engine.llm_engine.stats
        assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_abort_mid_run_frees_the_blocks_and_the_held_drafts(tiny):
    target, draft, want = tiny
    engine = LLM(target, speculative_config=spec(draft), **SMALL)
    core = engine.llm_engine
    try:
        keep = core.add_request(None, PROMPTS[0], GREEDY)
        drop = core.add_request(None, PROMPTS[1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        for _ in range(3):
            core.step()
        assert drop in core.scheduler.proposer.drafts       # drafts waiting for its next step
        core.abort_request([drop])
        done = []
        while core.has_unfinished_requests():
            done += [o for o in core.step() if o.finished]
        assert [o.outputs[0].token_ids for o in done if o.request_id == keep] == [want[0]]
        assert not core.scheduler.proposer.drafts
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_no_proposals_where_no_drafts_would_go(tiny, monkeypatch):
    """The draft proposes only for requests the scheduler would give drafts to: none while
    disable_by_batch_size requests are in the engine, none for a request with penalties, none
    after a request's last token (max_tokens)."""
    target, _, want = tiny
    engine = LLM(target, speculative_config=spec(target, disable_by_batch_size=3), **SMALL)
    drafter, asked = engine.llm_engine.executor.runner.drafter, []
    def propose(runner, step, f=drafter.propose):
        drafts = f(runner, step)
        asked.append(len(drafts))
        return drafts

    monkeypatch.setattr(drafter, "propose", propose)
    try:
        assert ids(engine.generate(PROMPTS, GREEDY, use_tqdm=False)) == want    # four equal runs: never under 3
        assert sum(asked) == 0 and engine.llm_engine.stats.num_draft_tokens == 0
        engine.generate(PROMPTS[0], SamplingParams(max_tokens=8, repetition_penalty=1.2), use_tqdm=False)
        engine.generate(PROMPTS[0], SamplingParams(max_tokens=1), use_tqdm=False)
        assert sum(asked) == 0
        assert ids(engine.generate(PROMPTS[0], GREEDY, use_tqdm=False)) == want[:1]
        assert sum(asked) > 0 and engine.llm_engine.stats.num_draft_tokens > 0
        assert_no_leaks(engine)
    finally:
        del engine
        gc.collect()


def test_draft_kv_is_the_targets_after_rejected_drafts(tiny):
    """The target as its own draft, sampling (temperature 0.1: the tiny model's logits are
    flat) where the draft proposes greedily: some drafts are kept, some rejected, and after
    each step the draft's KV catches up on the tokens that stand only. Its cache then holds the
    target's KV at every position the request has computed."""
    target, _, _ = tiny
    llm = LLM(target, speculative_config=spec(target, 4), **SMALL)
    engine = llm.llm_engine
    try:
        engine.add_request("r", PROMPTS[3], SamplingParams(temperature=0.1, seed=3, max_tokens=80, ignore_eos=True))
        for _ in range(12):
            engine.step()
        s = engine.stats
        assert 0 < s.num_accepted_tokens < s.num_draft_tokens          # kept and rejected drafts
        (req,) = engine.scheduler.running
        blocks = torch.tensor(engine.kv_cache_manager.get_block_ids(req)[0])
        n = req.num_computed_tokens
        runner = engine.executor.runner
        for mine, its in zip(runner.model.model.layers, runner.drafter.model.model.layers):
            a, b = (layer.self_attn.attn.kv_cache[:, blocks].flatten(1, 2)[:, :n] for layer in (mine, its))
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    finally:
        del llm
        gc.collect()
