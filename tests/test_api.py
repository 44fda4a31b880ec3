"""The offline API with the real SmolLM2: outputs, sampling options, streaming and the seed's
first code sample."""

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind
from tests.conftest import assert_no_leaks

PROMPTS = ["The capital of France is", "请解释量子纠缠", "def add(a, b):", "My favourite colour is"]


def test_outputs_in_input_order_with_vllm_fields(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == PROMPTS
    for o, p in zip(outs, PROMPTS):
        c = o.outputs[0]
        assert o.finished and o.prompt_token_ids == tok.encode(p)
        assert c.index == 0 and len(c.token_ids) == 8 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids)
        assert c.cumulative_logprob is None and c.logprobs is None     # vLLM: only with logprobs
        assert o.metrics.first_token_time >= o.metrics.arrival_time
    assert_no_leaks(llm)


def test_token_id_prompts_and_per_prompt_params(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[0])
    a, b = llm.generate([PROMPTS[0], ids], [SamplingParams(temperature=0, max_tokens=5),
                                            SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert b.prompt is None and b.prompt_token_ids == ids
    assert b.outputs[0].token_ids == a.outputs[0].token_ids[:3]


def test_seed_reproduces_whatever_shares_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 3
    batch = llm.generate(PROMPTS[1:] + [PROMPTS[0]], others + [p], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    unseeded = {tuple(o.outputs[0].token_ids) for o in
                llm.generate([PROMPTS[0]] * 4, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True),
                             use_tqdm=False)}
    assert len(unseeded) > 1, "temperature 1 without a seed should vary"


def test_parallel_sampling_n(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(PROMPTS[0], SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=7, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_no_leaks(llm)


def test_top_k_one_is_greedy_and_logprobs(llm):
    greedy = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
                          use_tqdm=False)[0].outputs[0]
    topk1 = llm.generate(PROMPTS[2], SamplingParams(temperature=0.8, top_k=1, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert topk1.token_ids == greedy.token_ids
    assert len(greedy.logprobs) == 10
    total = 0.0
    for tok_id, entry in zip(greedy.token_ids, greedy.logprobs):
        assert tok_id in entry and entry[tok_id].rank == 1 and 3 <= len(entry) <= 4
        assert entry[tok_id].decoded_token is not None
        total += entry[tok_id].logprob
    assert abs(total - greedy.cumulative_logprob) < 1e-3


def test_stop_strings_and_stop_token_ids(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = base.text[8:12]
    assert stop.strip(), base.text
    cut = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    keep = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=stop,
                                                   include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert keep.text == base.text[:base.text.index(stop) + len(stop)]
    tid = base.token_ids[4]
    by_id = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[tid]),
                         use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(tid)
    assert by_id.token_ids == base.token_ids[:first + 1] and by_id.stop_reason == tid
    assert_no_leaks(llm)


def test_eos_min_tokens_and_chat(llm):
    conv = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason is None       # ended by EOS
    assert 2 not in out.token_ids[:-1] and "<|im_end|>" not in out.text
    n = len(out.token_ids)
    longer = llm.chat(conv, SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(conv, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    manual = llm.generate({"prompt_token_ids": tok.encode(text, add_special_tokens=False)},
                          SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert manual.token_ids == out.token_ids


def test_penalties_change_repetitive_output(llm):
    from collections import Counter
    p = "one one one one one one one one"
    plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    pen = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=2.0,
                                         frequency_penalty=1.0, presence_penalty=1.0), use_tqdm=False)
    most = [Counter(o[0].outputs[0].token_ids).most_common(1)[0][1] for o in (plain, pen)]
    assert most[0] >= 4, "greedy SmolLM2 loops on this prompt"
    assert most[1] < most[0]


def test_streaming_deltas_add_up_and_chinese_is_clean(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    rid = engine.add_request(None, "中国的首都是北京。日本的首都是东京。法国的首都是", params)
    deltas, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == rid
            deltas.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
    text = "".join(deltas)
    assert "\ufffd" not in text
    assert text == llm.get_tokenizer().decode(tokens)
    assert any("\u4e00" <= ch <= "\u9fff" for ch in text), text


def test_seed_first_code_sample(smollm_path):
    """Section 4.2 of the seed, with the local SmolLM2 in place of the hub name."""
    llm = LLM(
        model=smollm_path,
        max_num_batched_tokens=8192,   # 每批次最大 token 数
        max_num_seqs=256,              # 最大并发序列数
        enable_prefix_caching=True,    # 前缀缓存加速
    )
    sampling_params = SamplingParams(
        max_tokens=512,
        temperature=0.7,
        top_p=0.9,
    )
    outputs = llm.generate(["请解释量子纠缠", "写一首关于秋天的诗"], sampling_params)
    assert len(outputs) == 2
    for out in outputs:
        c = out.outputs[0]
        assert 1 <= len(c.token_ids) <= 512 and c.text and c.finish_reason in ("stop", "length")
    assert_no_leaks(llm)


def test_allowed_token_ids(llm):
    """Sampled and greedy tokens come from allowed_token_ids only (vLLM's); the greedy one is the
    most likely of them; ids outside the vocabulary are refused, and the engine goes on."""
    tok = llm.get_tokenizer()
    allowed = sorted({t for w in (" yes", " no", " maybe", " Paris") for t in tok.encode(w)})
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False)[0]
    for params in (SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed, logprobs=0),
                   SamplingParams(temperature=1.0, max_tokens=12, seed=3, allowed_token_ids=allowed)):
        c = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        assert len(c.token_ids) == params.max_tokens and set(c.token_ids) <= set(allowed)
    # the first greedy token: the allowed id the unconstrained model ranks highest
    first = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed),
                         use_tqdm=False)[0].outputs[0].token_ids[0]
    ranked = [t for t, _ in sorted(free.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)]
    assert first == next(t for t in ranked if t in allowed)
    with pytest.raises(ValueError, match="allowed_token_ids must be in"):
        llm.generate(PROMPTS[0], SamplingParams(allowed_token_ids=[10**7]), use_tqdm=False)
    assert_no_leaks(llm)


def test_bad_words(llm):
    """vLLM's bad_words: a one-token word is never sampled; a longer one's last token is banned
    where the output ends with the rest of it (here " return" may come, " return n" may not)."""
    tok = llm.get_tokenizer()
    greedy = dict(temperature=0, max_tokens=24)
    free = llm.generate(["The capital of France is", "def fibonacci(n):"], SamplingParams(**greedy), use_tqdm=False)
    assert "Paris" in free[0].outputs[0].text and "return n" in free[1].outputs[0].text
    banned = llm.generate(["The capital of France is", "def fibonacci(n):"],
                          SamplingParams(**greedy, bad_words=["Paris", "return n"]), use_tqdm=False)
    paris, ret = banned[0].outputs[0], banned[1].outputs[0]
    assert "Paris" not in paris.text and not set(tok.encode("Paris") + tok.encode(" Paris")) & set(paris.token_ids)
    ids, (r, n) = ret.token_ids, tok.encode(" return n")
    assert r in ids and not any(a == r and b == n for a, b in zip(ids, ids[1:]))
    # seeded sampling holds to them too, and n > 1 samples each
    sampled = llm.generate("The capital of France is", SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=16,
                                                                      bad_words=["Paris"]), use_tqdm=False)[0]
    assert all("Paris" not in c.text for c in sampled.outputs)
    assert_no_leaks(llm)


def test_priority_scheduling(smollm_path, llm):
    """scheduling_policy="priority" (vLLM's): one sequence at a time, requests run lowest
    priority value first whatever their order; without the policy a priority is refused."""
    prio = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=1 << 26, max_model_len=256, max_num_seqs=1,
               scheduling_policy="priority")
    outs = prio.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False, priority=[3, 1, 0, 2])
    started = sorted(range(len(PROMPTS)), key=lambda i: outs[i].metrics.first_token_time)
    assert started == [2, 1, 3, 0]
    with pytest.raises(ValueError, match="priority has 1 values for 4 prompts"):
        prio.generate(PROMPTS, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        llm.generate(PROMPTS[0], use_tqdm=False, priority=[1])
    assert_no_leaks(llm)


def test_truncate_prompt_tokens(llm):
    """The prompt's last k tokens only (vLLM's left truncation; -1: max_model_len)."""
    tok = llm.get_tokenizer()
    ids = tok.encode("Once upon a time, in a land far away, there lived a king who loved music.")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                                truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.outputs[0].token_ids == llm.generate({"prompt_token_ids": ids[-5:]}, greedy,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    max_len = llm.llm_engine.config.scheduler.max_model_len
    long = ids * (max_len // len(ids) + 1)
    out = llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-max_len:]
    assert_no_leaks(llm)


def test_sampling_params_clone_shares_no_container():
    # The engine clones a user's params and fills in stop ids: the user's object must not change.
    p = SamplingParams(stop=["x"], stop_token_ids=[3], logit_bias={5: 1.0}, seed=7)
    q = p.clone()
    q.stop.append("y")
    q.stop_token_ids.append(4)
    q.logit_bias[6] = 2.0
    q.all_stop_token_ids.add(9)
    q.seed = 8
    assert (p.stop, p.stop_token_ids, p.logit_bias, p.all_stop_token_ids, p.seed) == (["x"], [3], {5: 1.0}, {3}, 7)
    assert (q.stop, q.stop_token_ids, q.logit_bias, q.all_stop_token_ids) == (["x", "y"], [3, 4], {5: 1.0, 6: 2.0}, {3, 9})
