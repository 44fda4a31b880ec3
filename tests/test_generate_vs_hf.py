"""The real SmolLM2 against HF transformers (float32, the same GGUF): greedy tokens equal,
prompt logprobs close, and the same tokens whatever the batching, chunking or preemption."""
import pytest
import torch

from pagoda import LLM, SamplingParams
from tests.conftest import TEST_KV_BYTES, assert_no_leaks

NEW_TOKENS = 48
# Prompt log-probabilities agree with HF within this (float32; observed ~1e-4).
LOGPROB_ATOL = 2e-3

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "SELECT name, COUNT(*) FROM orders",
    "请解释量子纠缠",
    "写一首关于秋天的诗",
    "The three laws of thermodynamics are",
    "1, 1, 2, 3, 5, 8, 13,",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    "Translate to German: The weather is nice today.",
    "import numpy as np\nx = np.linspace(0, 1, 100)\n",
    "In 1969, Neil Armstrong",
]
CHAT = [{"role": "user", "content": "Give me three tips for writing clean Python code."}]


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    ids.append(tok.encode(chat_text, add_special_tokens=False))
    return ids


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids):
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            out.append(gen[0, len(ids):].tolist())
    return out


def _generate(llm, prompt_ids, one_at_a_time=False, max_tokens=NEW_TOKENS):
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if one_at_a_time:
        outs = [llm.generate(p, params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leaks(llm)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hf_all_together(llm, prompt_ids, hf_greedy):
    assert len(prompt_ids) >= 12
    ours = _generate(llm, prompt_ids)
    for i, (a, b) in enumerate(zip(ours, hf_greedy)):
        assert len(a) == NEW_TOKENS
        assert a == b, f"prompt {i} diverges at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"


def test_greedy_equals_hf_one_at_a_time(llm, prompt_ids, hf_greedy):
    # (a batch of one: the plainest prompt, the Chinese one, the chat template; all of them
    # batched together are checked above)
    picked = [0, 4, len(prompt_ids) - 1]
    assert _generate(llm, [prompt_ids[i] for i in picked], one_at_a_time=True) == [hf_greedy[i] for i in picked]


def test_greedy_with_every_prompt_chunked(smollm_path, prompt_ids, hf_greedy):
    # Every prompt prefilled 4 tokens a step; the first 16 new tokens show the chunked prefill
    # right (the decode after it is what the other tests check).
    assert min(len(p) for p in prompt_ids) > 4
    small = LLM(smollm_path, dtype="float32", max_num_batched_tokens=4, max_model_len=512,
                kv_cache_memory_bytes=TEST_KV_BYTES)
    assert _generate(small, prompt_ids, max_tokens=16) == [h[:16] for h in hf_greedy]


def test_greedy_under_preemption(smollm_path, prompt_ids, hf_greedy):
    # 24 blocks of 16 tokens for 13 requests that grow to ~60-90 tokens each: they cannot all
    # hold their KV at once, so the newest are preempted and recomputed.
    tight = LLM(smollm_path, dtype="float32", num_gpu_blocks_override=25, max_model_len=384)
    ours = _generate(tight, prompt_ids)
    assert tight.llm_engine.scheduler.stats.num_preemptions > 0
    assert ours == hf_greedy


def test_prompt_logprobs_close_to_hf(llm, hf_model, prompt_ids):
    for ids in prompt_ids[:4] + prompt_ids[-2:]:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=5,
                                                                    temperature=0), use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            entry = out.prompt_logprobs[pos]
            assert ids[pos] in entry
            for tok, lp in entry.items():
                assert abs(lp.logprob - ref[pos - 1, tok].item()) < LOGPROB_ATOL
            fifth = ref[pos - 1].topk(5).values[-1].item()
            top = [t for t, lp in entry.items() if lp.rank <= 5]
            assert len(top) == 5 and all(ref[pos - 1, t].item() >= fifth - LOGPROB_ATOL for t in top)
    assert_no_leaks(llm)
