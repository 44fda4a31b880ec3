"""LoRA adapters (``enable_lora=True``, ``LoRARequest``): outputs against PEFT's on SmolLM2, batches
mixing adapters, the max_loras limit, the prefix cache, tensor parallelism, and bad adapters."""
import copy
import dataclasses
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.lora.request import LoRARequest
from tests.conftest import TEST_KV_BYTES, assert_no_leaks
from tests.lora_utils import write_adapter
from tests.test_tensor_parallel import SMALL, write_tiny_llama

peft = pytest.importorskip("peft")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about rain."]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
ENGINE = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=1024, enable_lora=True,
              max_lora_rank=8)


@pytest.fixture(scope="module")
def adapters(hf_model, tmp_path_factory):
    """Two adapters as PEFT saves them, and PEFT's own models of each: every projection at rank 8;
    q, v and down of every other layer at rank 4 (v at 2) with rsLoRA and an alpha pattern."""
    configs = {
        "all": peft.LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"]),
        "qvd": peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, use_rslora=True,
                               target_modules=["q_proj", "v_proj", "down_proj"], alpha_pattern={"down_proj": 2},
                               rank_pattern={"v_proj": 2}, layers_to_transform=list(range(0, 30, 2))),
    }
    out = {}
    for i, (name, config) in enumerate(configs.items()):
        torch.manual_seed(i)
        path = str(tmp_path_factory.mktemp(name))
        model = peft.get_peft_model(copy.deepcopy(hf_model), config)
        with torch.no_grad():      # PEFT's random B is large: keep the adapted model's answers sensible
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.2)
        model.save_pretrained(path)
        out[name] = (LoRARequest(name, i + 1, path), model.eval())
    return out


@pytest.fixture(scope="module")
def lora_llm(smollm_path):
    engine = LLM(smollm_path, max_loras=2, **ENGINE)
    yield engine
    del engine


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_match_peft(lora_llm, adapters):
    """Greedy tokens equal PEFT's, and each token's logprob is PEFT's log-softmax there."""
    base = tokens(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for lora, reference in adapters.values():
        outs = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)
        assert all(o.lora_request == lora for o in outs)
        for o in outs:
            ids = torch.tensor([o.prompt_token_ids + o.outputs[0].token_ids])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(o.prompt_token_ids) - 1:-1].float().log_softmax(-1)
            want = logits.argmax(-1).tolist()
            assert o.outputs[0].token_ids == want, lora.lora_name
            got = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, want)])
            torch.testing.assert_close(got, logits[torch.arange(len(want)), want], atol=2e-3, rtol=0)
        assert tokens(outs) != base          # (the adapter changes the answers)
    assert_no_leaks(lora_llm)


def test_batch_mixing_adapters(lora_llm, adapters):
    """One batch of requests with either adapter or none gives each request's answer alone."""
    a, b = adapters["all"][0], adapters["qvd"][0]
    loras = [a, None, b, a, None, b]
    prompts = PROMPTS + PROMPTS[::-1]
    mixed = tokens(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    alone = [tokens(lora_llm.generate([p], GREEDY, use_tqdm=False, lora_request=lora))[0]
             for p, lora in zip(prompts, loras)]
    assert mixed == alone
    # Parallel samples of an adapted prompt fork its KV and keep its adapter.
    sampled = lora_llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=8),
                                use_tqdm=False, lora_request=a)
    again = lora_llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=8),
                              use_tqdm=False, lora_request=a)
    assert [c.token_ids for c in sampled[0].outputs] == [c.token_ids for c in again[0].outputs]
    assert_no_leaks(lora_llm)


def test_prefix_cache_keeps_adapters_apart(lora_llm, adapters):
    a = adapters["all"][0]
    prompt = "Summarize: " + " ".join(f"item {i} is blue," for i in range(20))
    lora_llm.reset_prefix_cache()
    expected = tokens(lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a))
    lora_llm.reset_prefix_cache()
    lora_llm.generate(prompt, GREEDY, use_tqdm=False)                       # the base model's KV cached
    first = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert first.num_cached_tokens == 0 and tokens([first]) == expected      # not the base model's KV
    second = lora_llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=a)[0]
    assert second.num_cached_tokens > 0 and tokens([second]) == expected     # its own, reused
    assert_no_leaks(lora_llm)


def test_one_adapter_at_a_time(smollm_path, lora_llm, adapters):
    """max_loras=1: requests of two adapters queue so that no step holds both; with one adapter
    kept on the host (max_cpu_loras=1) each switch reads the other's folder again."""
    a, b = adapters["all"][0], adapters["qvd"][0]
    loras = [a, b, a, b, None]
    prompts = PROMPTS + PROMPTS[:2]
    expected = tokens(lora_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
    llm = LLM(smollm_path, max_loras=1, max_cpu_loras=1, **ENGINE)
    manager = llm.llm_engine.executor.runner.lora
    seen, slots_for = [], manager.slots_for

    def record(ids):
        seen.append(set(ids) - {0})
        return slots_for(ids)

    manager.slots_for = record
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)) == expected
    assert max(len(s) for s in seen) == 1 and set().union(*seen) == {1, 2}
    assert_no_leaks(llm)


def test_bad_adapters(smollm_path, llm, lora_llm, adapters, tmp_path):
    """Each bad adapter is a ValueError that names the problem, at add time; the engine goes on."""
    arch = lora_llm.llm_engine.config.model.arch
    good = adapters["all"][0]
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        llm.generate("hi", GREEDY, use_tqdm=False, lora_request=good)

    def folder(name, **kw):
        return write_adapter(str(tmp_path / name), arch, **kw)

    rank16 = folder("rank16", r=16)
    dora = folder("dora", use_dora=True)
    saved = folder("saved", modules_to_save=["lm_head"])
    head = folder("head")
    from safetensors.torch import load_file, save_file
    t = load_file(os.path.join(head, "adapter_model.safetensors"))
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, arch.hidden_size)
    save_file(t, os.path.join(head, "adapter_model.safetensors"))
    wrong = write_adapter(str(tmp_path / "wrong"), dataclasses.replace(arch, hidden_size=64, num_attention_heads=4,
                                                                       head_dim=16))
    corrupt = folder("corrupt")
    with open(os.path.join(corrupt, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(1000)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(str(tmp_path / "missing"), "no adapter_config.json"), (str(empty), "no adapter_config.json"),
             (rank16, "rank 16.*max_lora_rank=8"), (dora, "DoRA"), (saved, "modules_to_save"),
             (head, "lm_head"), (wrong, "does not fit this model"), (corrupt, "Could not read")]
    for i, (path, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            lora_llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                              lora_request=LoRARequest(f"bad{i}", 100 + i, path))
    with pytest.raises(ValueError, match="already"):       # an id names one adapter
        lora_llm.generate("hi", GREEDY, use_tqdm=False, lora_request=LoRARequest("other", good.lora_int_id,
                                                                                   adapters["qvd"][0].lora_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("zero", 0, good.lora_path)
    assert_no_leaks(lora_llm)
    # The folder goes bad after it was checked: the step that loads it fails, nothing leaks, and
    # the engine goes on.
    late = folder("late", seed=5)
    lora_llm.add_lora(LoRARequest("late", 50, late))
    with open(os.path.join(late, "adapter_model.safetensors"), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ValueError, match="Could not read"):
        lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("late", 50, late))
    assert_no_leaks(lora_llm)
    assert lora_llm.generate("hi", GREEDY, use_tqdm=False, lora_request=good)[0].outputs[0].token_ids


def test_remove_lora(lora_llm, adapters, tmp_path):
    """An id may name another adapter once the first is removed."""
    a, b = adapters["all"][0], adapters["qvd"][0]
    expected = tokens(lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=b))
    lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("x", 77, a.lora_path))
    assert 77 in lora_llm.list_loras()
    assert lora_llm.remove_lora(77) and 77 not in lora_llm.list_loras()
    again = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest("y", 77, b.lora_path))
    assert tokens(again) == expected


@pytest.mark.slow
def test_parallel_lora(tmp_path):
    """tp=2 and pp=2 give one process's answers with adapters mixed in one batch: column-parallel
    layers cut B's rows, row-parallel ones A's columns (the KV heads split between the ranks
    too); each pipeline stage adapts its own layers."""
    model = write_tiny_llama(str(tmp_path / "model"), heads=4, kv_heads=2)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    a = LoRARequest("a", 1, write_adapter(str(tmp_path / "a"), cfg, r=4, scale=0.5, seed=1))
    b = LoRARequest("b", 2, write_adapter(str(tmp_path / "b"), cfg, r=2, scale=0.5, seed=2, layers=[1],
                                          targets=("k_proj", "o_proj", "up_proj")))
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8, 9], list(range(10, 70)), [300, 2, 41], [7, 7])]
    loras = [a, b, None, a]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        engine = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_lora=True, max_loras=2,
                     max_lora_rank=4, **SMALL)
        outs.append(tokens(engine.generate(prompts, params, use_tqdm=False, lora_request=loras)))
        base = tokens(engine.generate(prompts, params, use_tqdm=False))
        del engine
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][0] != base[0] and outs[0][1] != base[1] and outs[0][2] == base[2]


def test_embeddings_with_an_adapter(smollm_path, adapters):
    """The pooling runner with an adapter: the last token's final hidden state of PEFT's model."""
    import torch.nn.functional as F
    lora, reference = adapters["qvd"]
    embedder = LLM(smollm_path, runner="pooling", max_loras=1, **ENGINE)
    prompts = [{"prompt_token_ids": ids} for ids in ([5, 6, 7, 8, 9, 10, 11], list(range(100, 140)))]
    outs = embedder.embed(prompts, use_tqdm=False, lora_request=lora)
    base = embedder.embed(prompts, use_tqdm=False)
    for out, plain, prompt in zip(outs, base, prompts):
        with torch.no_grad():
            hidden = reference.base_model.model.model(input_ids=torch.tensor([prompt["prompt_token_ids"]]))
        want = F.normalize(hidden.last_hidden_state[0, -1], dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(torch.tensor(plain.outputs.embedding), want, atol=1e-3)
    assert_no_leaks(embedder)


def test_speculative_decoding_with_adapters(smollm_path, lora_llm, adapters):
    """n-gram drafts are verified through the adapter too: greedy tokens as without drafts."""
    a = adapters["all"][0]
    prompts = ["Repeat after me: one two three four five six, one two three four five six,", PROMPTS[1]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = tokens(lora_llm.generate(prompts, params, use_tqdm=False, lora_request=[a, None]))
    llm = LLM(smollm_path, max_loras=1, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 2}, **ENGINE)
    assert tokens(llm.generate(prompts, params, use_tqdm=False, lora_request=[a, None])) == expected
    assert llm.get_stats().num_accepted_tokens > 0
    assert_no_leaks(llm)


def test_beam_search_with_an_adapter(lora_llm, adapters):
    """Every beam runs with the adapter: width-1 beam search is the adapter's greedy answer."""
    from pagoda import BeamSearchParams
    a = adapters["all"][0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    greedy = tokens(lora_llm.generate(PROMPTS[0], params, use_tqdm=False, lora_request=a))[0]
    assert greedy != tokens(lora_llm.generate(PROMPTS[0], params, use_tqdm=False))[0]
    [beams] = lora_llm.beam_search([{"prompt": PROMPTS[0]}], BeamSearchParams(beam_width=1, max_tokens=6,
                                                                              ignore_eos=True), lora_request=a)
    prompt_len = len(lora_llm.get_tokenizer().encode(PROMPTS[0]))
    assert beams.sequences[0].tokens[prompt_len:] == greedy
