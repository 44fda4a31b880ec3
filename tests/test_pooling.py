"""The pooling runner (LLM.embed / LLM.encode, vLLM's runner="pooling"): SmolLM2's embeddings
against HF transformers' final hidden states, pooled by the last token, the mean or the first
token, through chunked prefill, the prefix cache and async scheduling; and its errors."""
import gc
import json
import os

import pytest
import torch
import torch.nn.functional as F

from pagoda import LLM, PoolingParams, SamplingParams
from pagoda.model.loader import read_pooler_config
from tests.conftest import TEST_KV_BYTES, assert_no_leaks

PROMPTS = [[1, 9707, 11, 957, 836, 314], list(range(200, 297)), [42] * 3 + list(range(1000, 1040))]


def pooling_llm(path, **kwargs):
    return LLM(path, runner="pooling", dtype="float32", kv_cache_memory_bytes=TEST_KV_BYTES, max_model_len=512,
               **kwargs)


@pytest.fixture(scope="module")
def embedder(smollm_path):
    llm = pooling_llm(smollm_path, max_num_batched_tokens=32)     # the longer prompts in chunks
    yield llm
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def hf_hidden(hf_model):
    """HF's final hidden states (after the last norm) of each prompt, float32."""
    with torch.no_grad():
        return [hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids in PROMPTS]


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_last_token_embeddings_match_hf(embedder, hf_hidden):
    """vLLM's default for a decoder: the last token's hidden state, normalized; prompts longer
    than the 32-token budget are computed in chunks and pooled at their end."""
    outs = embedder.embed(ids(PROMPTS), use_tqdm=False)
    for out, hidden, prompt in zip(outs, hf_hidden, PROMPTS):
        assert out.finished and out.prompt_token_ids == prompt
        got = torch.tensor(out.outputs.embedding)
        assert out.outputs.hidden_size == hidden.shape[-1] and got.norm().item() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, F.normalize(hidden[-1], dim=-1), atol=1e-4, rtol=1e-4)
    assert_no_leaks(embedder)


def test_encode_dimensions_and_no_normalize(embedder, hf_hidden):
    """PoolingParams per request: the first k dimensions (Matryoshka), unnormalized."""
    [out] = embedder.encode(ids(PROMPTS[:1]), PoolingParams(dimensions=64, normalize=False), use_tqdm=False)
    assert isinstance(out.outputs.data, torch.Tensor) and out.outputs.data.shape == (64,)
    torch.testing.assert_close(out.outputs.data, hf_hidden[0][-1, :64], atol=1e-4, rtol=1e-4)


def test_prefix_cache_and_async_scheduling(smollm_path, hf_hidden):
    """The second embedding of a prompt starts from its cached blocks (at least its last token is
    computed, which is all last-token pooling needs) and is the same vector; with async
    scheduling the next step is scheduled before a pooled request's vector is back."""
    llm = pooling_llm(smollm_path, async_scheduling=True, max_num_batched_tokens=32)
    try:
        first = llm.embed(ids(PROMPTS), use_tqdm=False)
        again = llm.encode(ids(PROMPTS[1:2]), use_tqdm=False)
        assert again[0].num_cached_tokens >= 80
        torch.testing.assert_close(again[0].outputs.data, torch.tensor(first[1].outputs.embedding), atol=1e-5, rtol=0)
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_over_chunks(smollm_path, hf_hidden, pooling_type):
    """Mean / first-token pooling gather every chunk's hidden states (and take no cached prefix:
    the second run computes the whole prompt again)."""
    llm = pooling_llm(smollm_path, max_num_batched_tokens=16, pooler_config={"pooling_type": pooling_type})
    try:
        for _ in range(2):
            outs = llm.embed(ids(PROMPTS), use_tqdm=False)
            for out, hidden in zip(outs, hf_hidden):
                want = hidden.mean(0) if pooling_type == "MEAN" else hidden[0]
                torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(want, dim=-1),
                                           atol=1e-4, rtol=1e-4)
        stats = llm.get_stats()
        assert stats.prefix_cache_hits == 0 and stats.num_generation_tokens == 0
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()


def test_token_embed_over_chunks(smollm_path, hf_hidden):
    """pooling_task="token_embed": every prompt token's final hidden state, each row normalized
    (or cut to its dimensions, raw), gathered over the prompt's chunks, with no cached prefix
    (the second run computes every token again); beside last-token embeddings in one batch."""
    llm = pooling_llm(smollm_path, max_num_batched_tokens=16, async_scheduling=True)
    try:
        for _ in range(2):
            outs = llm.encode(ids(PROMPTS), use_tqdm=False, pooling_task="token_embed")
            for out, hidden in zip(outs, hf_hidden):
                assert out.outputs.data.shape == hidden.shape
                torch.testing.assert_close(out.outputs.data, F.normalize(hidden, dim=-1), atol=1e-4, rtol=1e-4)
        raw = llm.encode(ids(PROMPTS), [PoolingParams(dimensions=8, normalize=False, task="token_embed"),
                                        PoolingParams(), PoolingParams(task="token_embed")], use_tqdm=False)
        torch.testing.assert_close(raw[0].outputs.data, hf_hidden[0][:, :8], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(raw[1].outputs.data, F.normalize(hf_hidden[1][-1], dim=-1), atol=1e-4, rtol=1e-4)
        assert raw[2].outputs.data.shape == hf_hidden[2].shape
        assert llm.get_stats().prefix_cache_hits == 0
        with pytest.raises(ValueError, match="needs a sequence classification model .* pooling_task='token_embed'"):
            llm.encode(ids(PROMPTS), use_tqdm=False, pooling_task="token_classify")
        with pytest.raises(ValueError, match="Unknown pooling task 'tokens'"):
            llm.encode(ids(PROMPTS), use_tqdm=False, pooling_task="tokens")
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_pooling_over_parallel_ranks(tmp_path, pooling_type):
    """tp=2 (rank 0 pools the replicated final hidden states), pp=2 (the last stage pools and
    broadcasts the vectors, a batch in flight a stage) and dp=2 (each replica its share of the
    prompts) give one process's embeddings, prompts in chunks."""
    from tests.test_tensor_parallel import write_tiny_llama
    folder = write_tiny_llama(str(tmp_path / "tiny"), hidden=128, intermediate=256, vocab=1031)
    prompts = ids([[5, 6, 7, 8, 9], list(range(10, 70)), [300, 2, 41] + list(range(900, 940))])
    small = dict(runner="pooling", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
                 max_model_len=256, device="cpu", max_num_batched_tokens=32, pooler_config={"pooling_type": pooling_type})
    assert_layouts_agree(folder, small, lambda llm: torch.stack([o.outputs.data for o in llm.encode(prompts,
                                                                                                    use_tqdm=False)]))
    if pooling_type == "LAST":   # token_embed's rows of every prompt token, one tensor for all prompts
        assert_layouts_agree(folder, small, lambda llm: torch.cat([o.outputs.data for o in llm.encode(
            prompts, use_tqdm=False, pooling_task="token_embed")]))


PARALLEL_LAYOUTS = ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"data_parallel_size": 2})


def assert_layouts_agree(folder: str, engine_kwargs: dict, run) -> None:
    """``run(llm)``'s tensor is one process's on tp=2, pp=2 and dp=2 (1e-5)."""
    got = {}
    for layout in ({}, *PARALLEL_LAYOUTS):
        llm = LLM(folder, **engine_kwargs, **layout)
        try:
            got[str(layout)] = run(llm)
        finally:
            del llm
            gc.collect()
    ref = got.pop("{}")
    for value in got.values():
        torch.testing.assert_close(value, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_tiny_llama_on_the_default_device_matches_hf(tmp_path, pooling_type):
    """A random-weight Llama folder (safetensors) on the default device (the GPU's Triton kernels
    and CUDA graphs there) against HF transformers on the CPU, prompts in chunks."""
    from transformers import AutoModel

    from tests.test_tensor_parallel import write_tiny_llama
    folder = write_tiny_llama(str(tmp_path / "tiny"), hidden=128, intermediate=256, vocab=1031)
    prompts = [[5, 6, 7, 8, 9], list(range(10, 70)), [300, 2, 41] + list(range(900, 940))]
    llm = LLM(folder, runner="pooling", dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
              max_model_len=256, max_num_batched_tokens=32, pooler_config={"pooling_type": pooling_type})
    try:
        got = llm.encode(ids(prompts), use_tqdm=False)
    finally:
        del llm
        gc.collect()
    hf = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    for out, prompt in zip(got, prompts):
        with torch.no_grad():
            hidden = hf(input_ids=torch.tensor([prompt])).last_hidden_state[0]
        want = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
        torch.testing.assert_close(out.outputs.data, F.normalize(want, dim=-1), atol=2e-4, rtol=2e-4)


def test_pooling_errors(embedder, llm, smollm_path):
    with pytest.raises(ValueError, match="use LLM.embed"):
        embedder.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="more than the model's hidden size"):
        embedder.embed("Hello", PoolingParams(dimensions=10_000), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        embedder.embed({"prompt_token_ids": [5] * 600}, use_tqdm=False)
    assert_no_leaks(embedder)
    with pytest.raises(ValueError, match="Unknown pooling_type 'MAX'"):
        pooling_llm(smollm_path, pooler_config={"pooling_type": "max"})
    with pytest.raises(ValueError, match="Unknown pooler_config keys"):
        pooling_llm(smollm_path, pooler_config={"softmax": True})
    with pytest.raises(ValueError, match="Unknown task 'reward'"):
        LLM(smollm_path, task="reward")


def test_score_is_the_cosine_of_the_embeddings(embedder):
    """LLM.score: one text against several, or pairwise; the cosine of the two embeddings."""
    query, docs = PROMPTS[0], [PROMPTS[1], PROMPTS[2]]
    scores = embedder.score({"prompt_token_ids": query}, ids(docs), use_tqdm=False)
    embeds = [torch.tensor(o.outputs.embedding) for o in embedder.embed(ids([query] + docs), use_tqdm=False)]
    for s, doc, e in zip(scores, docs, embeds[1:]):
        assert s.prompt_token_ids == query + doc
        assert s.outputs.score == pytest.approx(F.cosine_similarity(embeds[0], e, dim=0).item(), abs=1e-5)
    pairwise = embedder.score(ids(docs), ids(docs[::-1]), use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(pairwise[1].outputs.score, abs=1e-6)
    with pytest.raises(ValueError, match="as many as the second list"):
        embedder.score(ids(docs), ids(PROMPTS), use_tqdm=False)
    assert_no_leaks(embedder)


def test_truncated_prompt_embeds_its_end(embedder):
    """truncate_prompt_tokens keeps the prompt's last k tokens, as for generation."""
    [cut] = embedder.embed(ids(PROMPTS[1:2]), truncate_prompt_tokens=10, use_tqdm=False)
    [tail] = embedder.embed(ids([PROMPTS[1][-10:]]), use_tqdm=False)
    assert cut.prompt_token_ids == PROMPTS[1][-10:]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), torch.tensor(tail.outputs.embedding))


def write_st_folder(folder, modes: dict, normalize: bool) -> str:
    os.makedirs(os.path.join(folder, "1_Pooling"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(folder, "modules.json"), "w") as f:
        json.dump(modules, f)
    with open(os.path.join(folder, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **modes}, f)
    return folder


def test_sentence_transformers_pooling_config(tmp_path):
    """A sentence-transformers folder's own pooling (modules.json, 1_Pooling/config.json)."""
    mean = write_st_folder(str(tmp_path / "mean"), {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
                           normalize=True)
    assert read_pooler_config(mean) == {"pooling_type": "MEAN", "normalize": True}
    last = write_st_folder(str(tmp_path / "last"), {"pooling_mode_lasttoken": True}, normalize=False)
    assert read_pooler_config(last) == {"pooling_type": "LAST", "normalize": False}
    assert read_pooler_config(str(tmp_path)) == {}
    bad = write_st_folder(str(tmp_path / "max"), {"pooling_mode_max_tokens": True}, normalize=True)
    with pytest.raises(ValueError, match="unsupported sentence-transformers pooling"):
        read_pooler_config(bad)
