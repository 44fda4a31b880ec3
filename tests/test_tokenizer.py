"""Tokenizer (from GGUF and from an HF folder), chat templates, and incremental detokenization."""
import json
import logging
import random

import gguf
import numpy as np
import pytest

from pagoda.detokenizer import IncrementalDetokenizer, decoded_token
from pagoda.tokenizer import Tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # rec\n\n\tpass\r\n",
    "你好，世界！这是一个测试。机器学习和自然语言处理。",
    "In 2024, pi = 3.14159 and 1,000,000 apples; x1y22z333 0.5e-10",
    "emoji 😀👍🏽 🇺🇸 👨‍👩‍👧 done",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading, trailing   \n\n\n  spaces ",
    "I'm sure they'll say WE'VE done it",
    "Ünïcödé — ελληνικά русский 日本語のテキスト 한국어",
    "",
]
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"}]


@pytest.fixture(scope="module")
def tok(smollm_path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm_path)


def _hf_from_gguf(path):
    """transformers' tokenizer for a GGUF, built by the same functions AutoTokenizer(gguf_file=) uses."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer
    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config)


@pytest.fixture(scope="module")
def hf_tok(smollm_path):
    return _hf_from_gguf(smollm_path)


# ---- SmolLM2 GGUF -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_digits_split_individually(tok):
    # SmolLM2's own tokenizer.json splits every digit (pre-tokenizer Digits(individual_digits=True)).
    for number in ["2024", " 31415926", "x1y22z333"]:
        ids = tok.encode(number)
        digit_tokens = [tok.id_to_token(i).lstrip("Ġ") for i in ids if any(c.isdigit() for c in tok.id_to_token(i))]
        assert all(len(t) == 1 for t in digit_tokens), (number, digit_tokens)


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("hi")[0] != tok.bos_token_id  # the GGUF says add_bos_token = false
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id, tok.eos_token_ids) == ("<|im_end|>", 2, {2})
    assert {0, 1, 2} <= set(tok.all_special_ids)
    assert tok.vocab_size == len(tok) == 49152
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.inner.get_vocab_size() == 49152


@pytest.mark.parametrize("messages", [CHAT[:2], CHAT, [{"role": "system", "content": "Be brief."}] + CHAT])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_tok, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == ref
    assert tok.apply_chat_template(messages, add_generation_prompt, tokenize=True) == \
        hf_tok.encode(ref, add_special_tokens=False)


def test_continue_final_message(tok, hf_tok):
    msgs = CHAT[:1] + [{"role": "assistant", "content": "The answer is"}]
    ours = tok.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\nThe answer is")
    assert ours == hf_tok.apply_chat_template(msgs, tokenize=False, continue_final_message=True)


def test_chat_template_sandbox_and_helpers(tok):
    template = ("{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% endfor %}"
                "{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}{{ strftime_now('%Y')[:2] }}"
                "{% generation %}{{ flavor }}{% endgeneration %}")
    out = tok.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], chat_template=template,
                                  tools=[{"name": "f"}], flavor="x")
    assert out == '<|im_start|>{"role": "user", "content": "<b>é</b>"}[\n {\n  "name": "f"\n }\n]20x'
    with pytest.raises(Exception, match="no system"):
        tok.apply_chat_template(CHAT, chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(Exception):  # sandboxed: no attribute escape hatches
        tok.apply_chat_template(CHAT, chat_template="{{ messages.__class__.__mro__ }}")


def test_no_chat_template_is_a_clear_error(tok):
    bare = Tokenizer(tok.inner, eos_token="<|im_end|>")
    with pytest.raises(ValueError, match="chat template"):
        bare.apply_chat_template(CHAT)


def test_from_pretrained_folder(tok, tmp_path):
    tok.inner.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>", "special": True}, "eos_token": "<|im_end|>",
        "add_bos_token": False, "chat_template": "ignored: chat_template.jinja wins"}))
    (tmp_path / "chat_template.jinja").write_text(tok.chat_template)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    folder_tok = Tokenizer.from_pretrained(tmp_path)
    assert folder_tok.eos_token_ids == {0, 2} and folder_tok.bos_token_id == 1
    assert folder_tok.apply_chat_template(CHAT) == tok.apply_chat_template(CHAT)
    for text in TEXTS:
        assert folder_tok.encode(text) == tok.encode(text)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "chat_template": [{"name": "default", "template": "D"}, {"name": "x", "template": "X"}]}))
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(CHAT) == "D"


def test_from_pretrained_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


# ---- synthetic GGUF vocabularies ------------------------------------------------------------------

def _byte_level_gguf(path, pre):
    """A tiny byte-level BPE GGUF: the 256 byte symbols, a few merges, a control and a user-defined token."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    # Every merged token is reachable by these merges in rank order, so BPE with and without
    # ignore_merges (Llama-3 sets it; transformers' GGUF builder does not) agree.
    merges = ["1 2", "12 3", "Ġ 1", "Ġ t", "Ġt h", "Ġth e", "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or",
              "Ġwor l", "Ġworl d", "' s"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = symbols + merged + ["<|end|>", "<think>"]
    types = [1] * (len(symbols) + len(merged)) + [3, 4]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 2)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


SYNTH_TEXTS = ["hello world 123 1234567 12", "hello's the\n\n  world<|end|>x<think>y", "你好 wörld  \t1 2\r\n3"]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    path = _byte_level_gguf(tmp_path / "v.gguf", pre)
    ours, ref = Tokenizer.from_gguf(path), _hf_from_gguf(path)
    for text in SYNTH_TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_smollm_pre_splits_digits_where_gpt2_does_not(tmp_path):
    smollm = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "s.gguf", "smollm"))
    gpt2 = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "g.gguf", "gpt-2"))
    assert [smollm.id_to_token(i) for i in smollm.encode(" 123")] == ["Ġ", "1", "2", "3"]
    assert [gpt2.id_to_token(i) for i in gpt2.encode(" 123")] == ["Ġ", "123"]


@pytest.mark.parametrize("pre,same_as", [("exaone", "smollm"), ("command-r", "smollm"), ("olmo", "gpt-2"),
                                         ("dbrx", "llama-bpe")])
def test_other_models_pre_tokenizers(tmp_path, pre, same_as, caplog):
    """EXAONE's, OLMo's, DBRX's (GPT-4's regex: OLMo 2's files) ... vocabularies split as llama.cpp
    splits them: as a known type's, not the GPT-2 fallback."""
    with caplog.at_level(logging.WARNING):
        ours = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "a.gguf", pre))
    assert pre not in caplog.text
    ref = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "b.gguf", same_as))
    assert all(ours.encode(t) == ref.encode(t) for t in SYNTH_TEXTS)


def test_unknown_pre_falls_back_with_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        odd = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "o.gguf", "some-new-model"))
    assert "some-new-model" in caplog.text
    gpt2 = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "g.gguf", "gpt-2"))
    assert all(odd.encode(t) == gpt2.encode(t) for t in SYNTH_TEXTS)


def test_added_token_kinds(tmp_path):
    t = Tokenizer.from_gguf(_byte_level_gguf(tmp_path / "v.gguf", "gpt-2"))
    ids = t.encode("a<|end|>b<think>c")
    assert t.decode(ids) == "ab<think>c"  # control tokens are skipped, user-defined ones are text
    assert t.id_to_token(ids[1]) == "<|end|>" and t.all_special_ids == [ids[1]]


def _sentencepiece_gguf(path):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types, scores = [2, 3, 3] + [6] * 256, [0.0] * 259
    pieces = ["▁", "e", "t", "h", "o", "l", "w", "r", "d", "n", "a", ",", "!", "▁t", "th", "▁th", "▁the", "he", "ll",
              "▁h", "▁hell", "▁hello", "or", "▁w", "▁wor", "▁world", "an", "▁a", "▁an", "▁and", "你", "好"]
    for i, p in enumerate(pieces):
        tokens.append(p)
        types.append(1)
        scores.append(-float(i) if len(p) > 1 else -1000.0 - i)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    path = _sentencepiece_gguf(tmp_path / "sp.gguf")
    ours, ref = Tokenizer.from_gguf(path), _hf_from_gguf(path)
    # (transformers and llama.cpp differ on leading spaces and text right after a special token;
    # pagoda follows llama.cpp there, so those cases are left out.)
    for text in ["hello world", "the hello, and the world!", "你好 hello", "xyz QQ 😀 hello"]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ids[0] == 1  # llama vocabularies add BOS unless the file says not to
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == text


# ---- incremental detokenizer ----------------------------------------------------------------------

def _run(detok, ids, per_push=1):
    deltas = [detok.push(ids[i:i + per_push]) for i in range(0, len(ids), per_push)]
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_random_ids_equal_full_decode(tok, skip):
    rng = random.Random(0)
    for trial in range(150):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 8))]
        high = 20 if trial % 4 == 0 else tok.vocab_size  # every 4th: mostly special tokens
        out = [rng.randrange(high) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        for i, token in enumerate(out):
            detok.push([token])
            full = tok.decode(out[:i + 1], skip_special_tokens=skip)
            if not full.endswith("\ufffd"):  # a complete text: everything must be out
                assert detok.output_text == full
            assert full.startswith(detok.output_text)
        detok.flush()
        assert detok.output_text == tok.decode(out, skip_special_tokens=skip)


@pytest.mark.parametrize("per_push", [1, 3])
def test_detokenizer_multibyte_never_yields_replacement(tok, per_push):
    text = "你好，世界！😀👍🏽🇺🇸 日本語 한국어 ελληνικά " * 3 + "<|im_end|>"
    ids = tok.encode(text)
    prompt = tok.encode("<|im_start|>user\n说中文<|im_end|>\n<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _run(detok, ids, per_push)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.output_text == tok.decode(ids) == text.replace("<|im_end|>", "")
    assert sum(1 for d in deltas if d == "") > 0  # some tokens end mid-character and were held back
    assert detok.flush() == ""


def test_detokenizer_keeps_special_tokens_when_asked(tok):
    ids = tok.encode("hi<|im_end|>")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    _run(detok, ids)
    assert detok.output_text == "hi<|im_end|>"


def test_detokenizer_flush_emits_unfinished_character(tok):
    ids = tok.encode("好")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert _run(detok, ids[:-1]) == [""] * (len(ids) - 1)
    assert detok.flush() == tok.decode(ids[:-1]) and "\ufffd" in detok.output_text


def test_detokenizer_window_stays_small(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    for _ in range(2000):
        detok.push([2])  # <|im_end|> over and over, as with ignore_eos
    detok.push(tok.encode(" there"))
    assert detok.output_text == " there" and len(detok._ids) < 10


def test_decoded_token(tok):
    assert decoded_token(tok, 2) == "<|im_end|>"
    assert decoded_token(tok, tok.encode(" world")[0]) == " world"
