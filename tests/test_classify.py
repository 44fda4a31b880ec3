"""Sequence classification and cross-encoder scoring (vLLM's classify and score pooling tasks):
random-weight *ForSequenceClassification folders written by HF transformers, with a byte-level
tokenizer whose pair template differs from joining two texts, against HF's own outputs (on the
default device: the GPU's kernels there); their layouts over ranks; their errors; the server."""
import gc
import json
import os
import shutil

import pytest
import torch

from pagoda import LLM, PoolingParams, SamplingParams
from tests.conftest import assert_no_leaks

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello there, how are you doing today, my friend?", "short",
         "a b c d e f g h i j k l m n o p q r s t u v w x y z, and the digits 0 1 2 3 4 5 6 7 8 9"]
QUERY = "What is PagedAttention?"
DOCS = ["PagedAttention stores the KV cache in fixed-size blocks.", "Autumn leaves fall slowly.", "blocks"]
SMALL = dict(dtype="float32", kv_cache_memory_bytes=1 << 24, max_model_len=256)


@pytest.fixture(scope="module")
def hf_tok():
    return byte_tokenizer()


def byte_tokenizer(words=()):
    """Bytes for tokens (and ``words``, tokens of the vocabulary too); "<s> A" for one text,
    "<s> A </s> B" for a pair (as a BERT-style cross-encoder joins them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + alphabet + list(words))}, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A </s> $B:1",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>")


def write_classifier(folder, tok, arch="LlamaForSequenceClassification", labels=("neg", "neu", "pos"),
                     tied=False):
    """A random HF classifier (or, ``labels=None``, a causal LM: a reranker's checkpoint, with an
    LM head and no score head) saved with the tokenizer; returns (folder, the HF model)."""
    qwen3 = arch.startswith("Qwen3")
    config_cls = transformers.Qwen3Config if qwen3 else transformers.LlamaConfig
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                        pad_token_id=tok.pad_token_id, tie_word_embeddings=tied, architectures=[arch],
                        **({} if labels is None else {"id2label": dict(enumerate(labels))}))
    torch.manual_seed(0)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():     # (larger than HF's init: classes far from even)
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ["LlamaForSequenceClassification", "Qwen3ForSequenceClassification"])
def test_classify_matches_hf(tmp_path, hf_tok, arch):
    """LLM.classify: the head on the last token's final hidden state, softmaxed, as HF's
    classifier gives it; prompts in chunks; the model picks the pooling runner itself."""
    folder, hf = write_classifier(str(tmp_path / "cls"), hf_tok, arch, tied=arch.startswith("Qwen3"))
    llm = LLM(folder, max_num_batched_tokens=16, **SMALL)
    try:
        assert llm.llm_engine.config.model.runner == "pooling"
        outs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS[:1], PoolingParams(use_activation=False), use_tqdm=False)
        again = llm.encode(TEXTS[2:], use_tqdm=False)          # (the prefix cache's blocks)
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()
    for text, out in zip(TEXTS, outs):
        ids = hf_tok(text)["input_ids"]
        assert out.finished and out.prompt_token_ids == ids and out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(out.outputs.probs), hf_logits(hf, ids).softmax(-1),
                                   atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(raw[0].outputs.probs), hf_logits(hf, hf_tok(TEXTS[0])["input_ids"]),
                               atol=1e-4, rtol=1e-4)
    assert again[0].num_cached_tokens > 0
    torch.testing.assert_close(again[0].outputs.data, torch.tensor(outs[2].outputs.probs), atol=1e-5, rtol=0)


def test_token_classify_matches_hf(tmp_path, hf_tok):
    """pooling_task="token_classify": the head at every prompt token, softmaxed row by row (raw
    with use_activation=False), over chunks; token_embed is refused by a classifier."""
    folder, hf = write_classifier(str(tmp_path / "cls"), hf_tok, "Qwen3ForSequenceClassification", tied=True)
    llm = LLM(folder, max_num_batched_tokens=16, **SMALL)
    try:
        outs = llm.encode(TEXTS, use_tqdm=False, pooling_task="token_classify")
        raw = llm.encode(TEXTS[2:], PoolingParams(use_activation=False), use_tqdm=False, pooling_task="token_classify")
        with pytest.raises(ValueError, match="gives no embeddings.*pooling_task='token_classify'"):
            llm.encode(TEXTS, use_tqdm=False, pooling_task="token_embed")
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()
    def every_token(ids):     # HF's head on each token's final hidden state
        with torch.no_grad():
            return hf.score(hf.model(input_ids=torch.tensor([ids])).last_hidden_state[0])

    for text, out in zip(TEXTS, outs):
        ids = hf_tok(text)["input_ids"]
        assert out.outputs.data.shape == (len(ids), 3)
        torch.testing.assert_close(out.outputs.data, every_token(ids).softmax(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(raw[0].outputs.data, every_token(hf_tok(TEXTS[2])["input_ids"]), atol=1e-4, rtol=1e-4)


def test_cross_encoder_scores_match_hf(tmp_path, hf_tok):
    """LLM.score with one label: the query and each document read together (the tokenizer's
    pair encoding, as transformers' text_pair), the sigmoid of the logit; token-id pairs joined."""
    folder, hf = write_classifier(str(tmp_path / "ce"), hf_tok, labels=("LABEL_0",))
    llm = LLM(folder, runner="pooling", **SMALL)
    try:
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
        pairwise = llm.score(DOCS, DOCS[::-1], use_tqdm=False)
        q_ids, d_ids = hf_tok(QUERY)["input_ids"], hf_tok(DOCS[0])["input_ids"]
        by_ids = llm.score({"prompt_token_ids": q_ids}, {"prompt_token_ids": d_ids}, use_tqdm=False)
        [probs] = llm.classify(QUERY, use_tqdm=False)
        with pytest.raises(ValueError, match="not one of each"):
            llm.score(QUERY, {"prompt_token_ids": d_ids}, use_tqdm=False)
        assert_no_leaks(llm)
    finally:
        del llm
        gc.collect()
    for doc, s in zip(DOCS, scores):
        ids = hf_tok(QUERY, text_pair=doc)["input_ids"]
        assert s.prompt_token_ids == ids
        assert s.outputs.score == pytest.approx(hf_logits(hf, ids).sigmoid().item(), abs=1e-5)
    ids = hf_tok(DOCS[0], text_pair=DOCS[2])["input_ids"]
    assert pairwise[0].outputs.score == pytest.approx(hf_logits(hf, ids).sigmoid().item(), abs=1e-5)
    assert by_ids[0].prompt_token_ids == q_ids + d_ids
    assert by_ids[0].outputs.score == pytest.approx(hf_logits(hf, q_ids + d_ids).sigmoid().item(), abs=1e-5)
    assert probs.outputs.probs == [pytest.approx(hf_logits(hf, hf_tok(QUERY)["input_ids"]).sigmoid().item(), abs=1e-5)]


def test_classifier_errors(tmp_path, hf_tok):
    """What a classifier cannot do fails by name and leaves the engine serving; an embedding
    model refuses to classify."""
    from tests.test_tensor_parallel import write_tiny_llama
    folder, _ = write_classifier(str(tmp_path / "cls"), hf_tok)
    with pytest.raises(ValueError, match="is a classifier: it does not generate"):
        LLM(folder, runner="generate", **SMALL)
    llm = LLM(folder, task="classify", **SMALL)
    try:
        with pytest.raises(ValueError, match="gives no embeddings: use LLM.classify"):
            llm.embed(TEXTS, use_tqdm=False)
        with pytest.raises(ValueError, match="needs a cross-encoder .one label.; LlamaForSequenceClassification has 3"):
            llm.score(QUERY, DOCS, use_tqdm=False)
        with pytest.raises(ValueError, match="use LLM.embed, LLM.classify, LLM.score"):
            llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(ValueError, match="dimensions is for embeddings"):
            llm.encode("Hello", PoolingParams(dimensions=2), use_tqdm=False)
        with pytest.raises(ValueError, match="Unknown pooling task 'rerank'"):
            PoolingParams(task="rerank")
        assert_no_leaks(llm)
        assert len(llm.classify(TEXTS, use_tqdm=False)) == 3
    finally:
        del llm
        gc.collect()
    embedder = LLM(write_tiny_llama(str(tmp_path / "tiny")), runner="pooling", skip_tokenizer_init=True, **SMALL)
    try:
        with pytest.raises(ValueError, match="Classification needs a sequence classification model"):
            embedder.classify({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)
        assert_no_leaks(embedder)
    finally:
        del embedder
        gc.collect()


# vLLM's conversion of a causal-LM reranker (Qwen3-Reranker), as its docs give it
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True}


@pytest.fixture(scope="module")
def word_tok():
    return byte_tokenizer(["no", "yes", "maybe"])


def to_reranker(config):
    """RERANKER as a function of the config, written as for transformers' PretrainedConfig."""
    config.architectures = ["Qwen3ForSequenceClassification"]
    config.classifier_from_token = ["no", "yes"]
    config.is_original_qwen3_reranker = True
    return config


@pytest.mark.parametrize("tied", [True, False])
def test_causal_lm_reranker_by_hf_overrides(tmp_path, word_tok, tied):
    """hf_overrides turns a causal LM's checkpoint into a cross-encoder (Qwen3-Reranker): its
    score is P("yes") of the 2-way softmax over the "no" / "yes" logits at the pair's last token;
    as a function of the config too. Without is_original_qwen3_reranker the tokens' rows are the
    classes."""
    folder, hf = write_classifier(str(tmp_path / "lm"), word_tok, "Qwen3ForCausalLM", None, tied)
    ids = {w: word_tok.convert_tokens_to_ids(w) for w in ("no", "yes", "maybe")}
    results = {}
    converted = shutil.copytree(folder, str(tmp_path / "converted"))      # (the entries in config.json)
    with open(os.path.join(converted, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(converted, "config.json"), "w") as f:
        json.dump({**config, **RERANKER}, f)
    for name, where, overrides in [("dict", folder, RERANKER), ("function", folder, to_reranker),
                                   ("config", converted, None)]:
        llm = LLM(where, runner="pooling", hf_overrides=overrides, max_num_batched_tokens=16, **SMALL)
        try:
            results[name] = [s.outputs.score for s in llm.score(QUERY, DOCS, use_tqdm=False)]
            assert_no_leaks(llm)
        finally:
            del llm
            gc.collect()
    three = {**RERANKER, "classifier_from_token": ["no", "yes", "maybe"], "is_original_qwen3_reranker": False}
    llm = LLM(folder, hf_overrides=three, **SMALL)
    try:
        classes = llm.classify(TEXTS, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    assert results["config"] == results["dict"]
    for doc, score, by_function in zip(DOCS, results["dict"], results["function"]):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([word_tok(QUERY, text_pair=doc)["input_ids"]])).logits[0, -1]
        assert score == pytest.approx(logits[[ids["no"], ids["yes"]]].softmax(-1)[1].item(), abs=1e-5)
        assert by_function == score
    for text, out in zip(TEXTS, classes):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([word_tok(text)["input_ids"]])).logits[0, -1]
        torch.testing.assert_close(torch.tensor(out.outputs.probs),
                                   logits[[ids["no"], ids["yes"], ids["maybe"]]].softmax(-1), atol=1e-5, rtol=0)


def test_hf_overrides_errors(tmp_path, word_tok):
    """A conversion that cannot be made fails by name before the model is built."""
    folder, _ = write_classifier(str(tmp_path / "lm"), word_tok, "Qwen3ForCausalLM", None, tied=True)
    cases = [({"classifier_from_token": ["no", "yes"]}, "set 'architectures' to its .ForSequenceClassification"),
             ({**RERANKER, "classifier_from_token": ["no", "yes", "maybe"]}, "2-way softmax classifier takes two"),
             ({**RERANKER, "classifier_from_token": ["no", "absolutely"]}, r"\['absolutely'\] are not tokens"),
             ({**RERANKER, "classifier_from_token": "yes"}, "must be a list of token strings"),
             ({**RERANKER, "is_original_qwen3_reranker": False, "method": "softmax"}, "Unknown method 'softmax'"),
             ({"architectures": ["Qwen3ForSequenceClassification"]}, "lacks 1 weights, e.g. \\['score.weight'\\]")]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(folder, hf_overrides=overrides, **SMALL)
    import argparse

    from pagoda.entrypoints.cli import add_engine_args, engine_args_from
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["--hf-overrides", json.dumps(RERANKER)])).hf_overrides == RERANKER
    with pytest.raises(SystemExit):   # (argparse: "expected a JSON object")
        p.parse_args(["--hf-overrides", "[1]"])
    with pytest.raises(TypeError, match="hf_overrides must be a dict"):
        LLM(folder, hf_overrides=["architectures"], **SMALL)
    with pytest.raises(TypeError, match="returned NoneType, not the config"):
        LLM(folder, hf_overrides=lambda config: None, **SMALL)


def test_classifier_over_parallel_ranks(tmp_path, hf_tok):
    """tp=2 (each rank has the whole head; rank 0 applies it), pp=2 (the last stage, which has
    no embedding though the config ties it, applies it and broadcasts the classes' logits) and
    dp=2 give one process's probabilities."""
    from tests.test_pooling import assert_layouts_agree
    folder, _ = write_classifier(str(tmp_path / "cls"), hf_tok, "Qwen3ForSequenceClassification", tied=True)
    assert_layouts_agree(folder, dict(max_num_batched_tokens=16, device="cpu", **SMALL),
                         lambda llm: torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]))


def test_causal_lm_reranker_over_parallel_ranks(tmp_path, word_tok):
    """The score head made from a tied LM head on the last pipeline stage, which has no
    embedding of its own (it reads the checkpoint's for the head alone), and on every
    tensor-parallel rank (from the whole, unsharded rows), gives one process's scores."""
    from tests.test_pooling import assert_layouts_agree
    folder, _ = write_classifier(str(tmp_path / "lm"), word_tok, "Qwen3ForCausalLM", None, tied=True)
    assert_layouts_agree(folder, dict(hf_overrides=RERANKER, max_num_batched_tokens=16, device="cpu", **SMALL),
                         lambda llm: torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]))


@pytest.fixture(scope="module")
def classifier_server(tmp_path_factory, hf_tok):
    """Servers of a cross-encoder (one label), a 3-class classifier and an embedding model,
    in-process."""
    pytest.importorskip("fastapi", reason="the server's extra (fastapi) is not installed")
    from fastapi.testclient import TestClient

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.entrypoints.openai.api_server import build_app
    from tests.test_tensor_parallel import write_tiny_llama
    root = tmp_path_factory.mktemp("servers")
    folders = {"ce": write_classifier(str(root / "ce"), hf_tok, labels=("LABEL_0",))[0],
               "cls": write_classifier(str(root / "cls"), hf_tok)[0]}
    engines = {k: AsyncLLM.from_engine_args(EngineArgs(f, **SMALL)) for k, f in folders.items()}
    engines["emb"] = AsyncLLM.from_engine_args(EngineArgs(write_tiny_llama(str(root / "emb")), runner="pooling",
                                                          skip_tokenizer_init=True, **SMALL))
    clients = {k: TestClient(build_app(e, ["m"])).__enter__() for k, e in engines.items()}
    yield clients, engines, folders
    for k in clients:
        clients[k].__exit__(None, None, None)
        engines[k].shutdown()


def test_server_classify_score_rerank_equal_llm(classifier_server):
    """/classify (and /v1/classify): LLM.classify's probabilities with the label of the largest;
    /v1/score and /rerank (and /v1/, /v2/): LLM.score's cross-encoder scores, reranked best
    first, the top_n of them."""
    from tests.test_server import wait_until_idle
    clients, engines, folders = classifier_server
    offline = LLM(folders["cls"], **SMALL)
    want_probs = [o.outputs.probs for o in offline.classify(TEXTS, use_tqdm=False)]
    del offline
    offline = LLM(folders["ce"], **SMALL)
    want_scores = [o.outputs.score for o in offline.score(QUERY, DOCS, use_tqdm=False)]
    del offline
    gc.collect()
    for route in ("/classify", "/v1/classify"):
        body = clients["cls"].post(route, json={"model": "m", "input": TEXTS}).json()
        assert body["object"] == "list" and body["id"].startswith("classify-")
        for d, want in zip(body["data"], want_probs):
            assert d["probs"] == pytest.approx(want, abs=1e-5) and d["num_classes"] == 3
            assert d["label"] == ("neg", "neu", "pos")[max(range(3), key=want.__getitem__)]
        assert body["usage"]["prompt_tokens"] > 0
    scores = clients["ce"].post("/v1/score", json={"text_1": QUERY, "text_2": DOCS}).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(want_scores, abs=1e-5)
    order = sorted(range(len(DOCS)), key=lambda i: -want_scores[i])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = clients["ce"].post(route, json={"model": "m", "query": QUERY, "documents": DOCS, "top_n": 2}).json()
        assert [r["index"] for r in body["results"]] == order[:2]
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order[:2]]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
            [want_scores[i] for i in order[:2]], abs=1e-5)
        assert body["usage"]["total_tokens"] > 0
    every = clients["ce"].post("/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert len(every["results"]) == len(DOCS)
    for k in engines:
        wait_until_idle(engines[k])


def test_server_pooling_route(classifier_server):
    """/pooling (vLLM's): LLM.encode's output for the request's task: token_classify's last row
    is the classifier's /classify probabilities, token_embed's last row the /v1/embeddings
    vector (every row normalized); base64 holds the float32 rows."""
    import base64

    import numpy as np

    from tests.test_server import wait_until_idle
    clients, engines, _ = classifier_server
    probs = [d["probs"] for d in clients["cls"].post("/classify", json={"input": TEXTS}).json()["data"]]
    body = clients["cls"].post("/pooling", json={"model": "m", "input": TEXTS, "task": "token_classify"}).json()
    assert body["id"].startswith("pool-") and body["usage"]["prompt_tokens"] > 0
    for d, want in zip(body["data"], probs):
        rows = torch.tensor(d["data"])
        assert d["object"] == "pooling" and rows.shape[1] == 3 and rows.shape[0] > 1
        torch.testing.assert_close(rows.sum(-1), torch.ones(rows.shape[0]))
        assert rows[-1].tolist() == pytest.approx(want, abs=1e-6)
    [vector] = clients["cls"].post("/pooling", json={"input": TEXTS[0]}).json()["data"]
    assert vector["data"] == pytest.approx(probs[0], abs=1e-6)       # (the model's own task: classify)
    ids = [5, 6, 7, 8, 9, 10]
    [emb] = clients["emb"].post("/v1/embeddings", json={"input": ids}).json()["data"]
    [tok] = clients["emb"].post("/pooling", json={"input": ids, "task": "token_embed",
                                                  "encoding_format": "base64"}).json()["data"]
    rows = torch.from_numpy(np.frombuffer(base64.b64decode(tok["data"]), dtype="<f4").copy()).view(len(ids), -1)
    torch.testing.assert_close(rows.norm(dim=-1), torch.ones(len(ids)))
    assert rows[-1].tolist() == pytest.approx(emb["embedding"], abs=1e-6)
    for client, body, status, message in [
            (clients["cls"], {"input": "Hi", "task": "token_embed"}, 400, "gives no embeddings"),
            (clients["emb"], {"input": [5, 6], "task": "tokens"}, 400, "Unknown pooling task 'tokens'"),
            (clients["cls"], {"input": "Hi", "model": "other"}, 404, "does not exist")]:
        r = client.post("/pooling", json=body)
        assert r.status_code == status and message in r.json()["error"]["message"], r.json()
    for engine in engines.values():
        wait_until_idle(engine)


def test_server_classifier_errors(classifier_server):
    from tests.test_server import wait_until_idle
    clients, engines, _ = classifier_server
    for client, route, body, message in [
            (clients["cls"], "/v1/embeddings", {"input": "Hi"}, "gives no embeddings"),
            (clients["cls"], "/rerank", {"query": "q", "documents": ["d"]}, "needs a cross-encoder"),
            (clients["ce"], "/rerank", {"query": "q", "documents": []}, "documents must not be empty"),
            (clients["ce"], "/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n must be at least 0"),
            (clients["cls"], "/classify", {"input": [[5] * 600]}, "longer than the maximum model length"),
            (clients["cls"], "/classify", {"input": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be"),
            (clients["emb"], "/classify", {"input": [5, 6]}, "Classification needs a sequence classification model")]:
        r = client.post(route, json=body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.json()
    for engine in engines.values():
        wait_until_idle(engine)
