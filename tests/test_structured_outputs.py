"""Structured outputs (``SamplingParams(structured_outputs=...)``, the server's response_format
and vLLM's fields) on the real SmolLM2: every answer matches its constraint, sampled or greedy,
with async scheduling too; bad constraints are errors naming them; the masks against a plain
torch reference."""
import json
import re

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams, StructuredOutputsParams
from pagoda.runner.sampler import apply_grammar_bitmasks
from tests.conftest import TEST_KV_BYTES, assert_no_leaks

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}}}
PHONE = r"\(0[1-9]\) [0-9]{3}-[0-9]{4}"


def _check_person(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"name", "age", "tags"} and isinstance(obj["age"], int) and isinstance(obj["name"], str)
            and len(obj["name"]) <= 16 and len(obj["tags"]) <= 3 and all(len(t) <= 8 for t in obj["tags"]))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(smollm_path, request):
    llm = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=2048,
              async_scheduling=request.param)
    yield llm
    del llm


def test_answers_match_their_constraints(llm):
    cases = [(StructuredOutputsParams(json=SCHEMA), "Describe a person as JSON.", _check_person),
             (StructuredOutputsParams(regex=PHONE), "My phone number is", lambda t: re.fullmatch(PHONE, t)),
             (StructuredOutputsParams(choice=["red", "green", "blue"]), "Pick a colour:",
              lambda t: t in ("red", "green", "blue")),
             (StructuredOutputsParams(json_object=True), "Some JSON:", lambda t: isinstance(json.loads(t), dict)),
             (StructuredOutputsParams(grammar='start: "The answer is " NUM "."\nNUM: /[0-9]+/'), "Answer:",
              lambda t: re.fullmatch(r"The answer is [0-9]+\.", t))]
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    # Greedy and sampled; a sampled free-form JSON object may run past any max_tokens: greedy only.
    runs = [(c, p, check, t, s) for c, p, check in cases for t, s in ((0.0, None), (1.0, 7))
            if not (c.json_object and t)]
    params = [SamplingParams(temperature=t, seed=s, max_tokens=80, structured_outputs=c) for c, _, _, t, s in runs]
    outs = llm.generate([p for _, p, _, _, _ in runs] + ["Tell me a story."], params + [plain], use_tqdm=False)
    for (constraint, _, check, _, _), out in zip(runs, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (constraint, c.text)
        assert check(c.text), (constraint, c.text)
    alone = llm.generate(["Tell me a story."], plain, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[-1].outputs[0].token_ids == alone                  # no mask reached the unconstrained row
    assert_no_leaks(llm)


def _masks_seen(worker):
    """(Run on each rank) record how many masks each step brings this rank."""
    seen, execute = [], worker.runner.execute_model

    def recording(sched):
        seen.append(len(sched.grammar_bitmasks))
        return execute(sched)
    worker.runner.execute_model = recording
    worker.masks_seen = seen


def _masks(worker) -> list[int]:
    return worker.masks_seen


@pytest.mark.parametrize("layout", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 3}])
def test_constraints_over_parallel_ranks(smollm_path, layout):
    """Over stages or tensor-parallel ranks: one process's greedy constrained answers; of the
    worker ranks, only the one that samples gets the masks (the last stage's first rank; none
    with tensor parallelism alone, where rank 0, the engine's, samples)."""
    constraints = [StructuredOutputsParams(choice=["red", "green", "blue"]), StructuredOutputsParams(regex=PHONE)]
    prompts = ["Pick a colour:", "My phone number is"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in constraints]
    kwargs = dict(dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512)
    one = LLM(smollm_path, **kwargs)
    want = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    del one
    llm = LLM(smollm_path, **kwargs, **layout)
    try:
        executor = llm.llm_engine.executor
        executor.collective_rpc(_masks_seen)
        assert [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)] == want
        seen = executor.collective_rpc(_masks)
        driver = len(seen) - layout.get("tensor_parallel_size", 1)
        # (rank 0 is the engine's own process: its steps are not sent, so it may keep them)
        assert all(seen[driver]) and not any(any(s) for r, s in enumerate(seen) if r not in (0, driver))
    finally:
        del llm


def test_json_without_free_whitespace(llm):
    """disable_any_whitespace: the JSON has no whitespace but the ", " and ": " separators."""
    out = llm.generate("A person as JSON:", SamplingParams(temperature=0, max_tokens=80, structured_outputs=(
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))), use_tqdm=False)[0].outputs[0]
    assert _check_person(out.text) and "\n" not in out.text and json.dumps(json.loads(out.text)) == out.text


def test_parallel_samples_each_follow_the_grammar(llm):
    out = llm.generate("Pick one:", SamplingParams(n=3, temperature=1.0, seed=0, max_tokens=10,
                                                   structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
                       use_tqdm=False)[0]
    assert all(c.text in ("alpha", "beta") and c.finish_reason == "stop" for c in out.outputs)


@pytest.mark.parametrize("constraint, message", [
    (dict(regex="[0-9"), "unclosed character class"),
    (dict(json={"type": "nope"}), "Invalid structured_outputs"),
    (dict(grammar="start: undefined_rule"), "Invalid structured_outputs"),
])
def test_bad_constraints_are_errors_and_leave_the_engine_working(llm, constraint, message):
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    assert_no_leaks(llm)
    assert len(llm.generate("x", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_bitmask_against_a_reference(device):
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 77, 5
    logits = torch.randn(rows, vocab, generator=gen).to(device)
    allowed = torch.rand(3, 96, generator=gen) < 0.3                 # masks cover 96 > 77 columns
    words = (allowed.view(3, 3, 32).long() << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).numpy()
    ids = ["a", "b", "c", "d", "e"]
    masks = {"b": words[0], "d": words[1], "e": words[2]}
    out = logits.clone()
    apply_grammar_bitmasks(out, ids, masks)
    ref = logits.clone()
    for row, k in ((1, 0), (3, 1), (4, 2)):
        ref[row][~allowed[k, :vocab].to(device)] = float("-inf")
    assert torch.equal(out, ref)
    assert isinstance(masks["b"], np.ndarray)


def test_batched_bitmasks_equal_each_matchers_own(smollm_path):
    """The step's masks, computed side by side, against each matcher's own (at different points
    of different grammars); sequences without a matcher, or still thinking, get none."""
    import types
    from pagoda.engine.structured_output import StructuredOutputs
    from pagoda.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(smollm_path)
    so = StructuredOutputs(tok, 49152, [tok.eos_token_id])
    requests = {}
    for i, (c, text) in enumerate([(StructuredOutputsParams(json=SCHEMA), '{"name": "Al'),
                                   (StructuredOutputsParams(regex=PHONE), "(01) 2"),
                                   (StructuredOutputsParams(choice=["red", "green"]), ""),
                                   (StructuredOutputsParams(json_object=True), '{"a": [1, ')]):
        m = so.matcher(so.compile(c))
        assert m.consume_tokens(tok.encode(text, add_special_tokens=False))
        requests[f"r{i}"] = types.SimpleNamespace(matcher=m, thinking_end=None)
    requests["plain"] = types.SimpleNamespace(matcher=None, thinking_end=None)
    # (a reasoning model's sequence still thinking: unmasked)
    requests["thinking"] = types.SimpleNamespace(matcher=so.matcher(so.compile(StructuredOutputsParams(regex="a"))),
                                                 thinking_end=(1,))
    masks = so.bitmasks(["plain", "r2", "thinking", "r0", "r3", "r1", "gone"], requests)
    assert list(masks) == ["r2", "r0", "r3", "r1"]
    for r, mask in masks.items():
        own = np.frombuffer(requests[r].matcher.compute_bitmask(), dtype=np.int32)[:so.words]
        assert np.array_equal(mask, own) and mask.any()
