"""Reading GGUF model files: metadata as an HF-style config, tensors as HF-named float32 weights.

The header is parsed here with `struct` instead of `gguf.GGUFReader`: the reader builds a numpy view per
metadata element, which takes ~4 s for a 49k-token vocabulary; this takes ~0.1 s. Tensor data stays
memory-mapped and is dequantized one tensor at a time on the engine's device, its block types by
torch ops (`gguf_quants`), its float types by `gguf.quants.dequantize`.
"""
from __future__ import annotations

import mmap
import re
import struct
from functools import cached_property
from math import prod
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize

from pagoda.model import gguf_quants

_GGUF_MAGIC = b"GGUF"
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

FLOAT_TYPES = frozenset({QT.F32, QT.F16, QT.BF16})
SUPPORTED_TYPES = FLOAT_TYPES | gguf_quants.TYPES

# general.architecture -> (HF model_type, HF architecture class); Mixtral's files say "llama"
# with an expert count
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen2moe": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma": ("gemma", "GemmaForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "granite": ("granite", "GraniteForCausalLM"),
    "granitemoe": ("granitemoe", "GraniteMoeForCausalLM"),      # (with a shared MLP: GraniteMoeShared)
    "smollm3": ("smollm3", "SmolLM3ForCausalLM"),
    "olmo2": ("olmo2", "Olmo2ForCausalLM"),      # (with sliding windows: OLMo 3, whose files say "olmo2" too)
    "exaone": ("exaone", "ExaoneForCausalLM"),
}
_MIXTRAL = ("mixtral", "MixtralForCausalLM")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # Phi-3's q/k/v stored fused (and its gate/up: ffn_up, below)
    "attn_qkv": "self_attn.qkv_proj",
    # Gemma 2/3's norms of each sublayer's output (and their MLP's input norm: ffn_norm, below)
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
# Names that mean another module in one architecture's files: Phi-3's ffn_up holds gate and up;
# Gemma 2/3's ffn_norm is the norm before the MLP, which HF names so
_ARCH_LAYER_NAMES = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                     "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
                     "gemma3": {"ffn_norm": "pre_feedforward_layernorm"}}
# Gemma's norm weights are offsets from 1 (HF's x * (1 + w)): llama.cpp's converter stores 1 + w.
_NORMS_PLUS_ONE = {"gemma", "gemma2", "gemma3"}
# Gemma 2 / 3 27B scale their scores by (hidden / heads) ** -0.5, the others by head_dim's (HF's
# query_pre_attn_scalar): the files do not say it, llama.cpp knows the 27B models by their layer
# count, and so does this.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and subclasses)
_PERMUTED = {"llama", "granite", "granitemoe", "smollm3"}
# SmolLM3's layers without a rotary embedding: every fourth, which llama.cpp knows by the
# architecture (the files do not say it)
_SMOLLM3_NO_ROPE_EVERY = 4
# Granite's scalings: HF config entry <- metadata key
_GRANITE_SCALES = {"attention_multiplier": "attention.scale", "embedding_multiplier": "embedding_scale",
                   "residual_multiplier": "residual_scale", "logits_scaling": "logit_scale"}
# The experts' projections, stacked in one tensor (experts first): each expert's, one by one
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Tensors llama.cpp adds that are no parameters: rope frequency factors (Llama-3's and LongRoPE's,
# read into the config)
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


class _Experts(NamedTuple):
    """A GGUF tensor of experts' projections stacked (experts first): the HF names of its rows."""
    layer: int
    proj: str     # (gate_proj, up_proj, down_proj)
    kind: str     # (weight, bias)

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.layer}.mlp.experts."

    def name(self, e: int, suffix: str | None = None) -> str:
        """Expert ``e``'s tensor (``suffix``: a packed part's, for ``.weight``)."""
        return f"{self.prefix}{e}.{self.proj}{suffix or '.' + self.kind}"


class _Header:
    """Sequential little-endian reader over the mapped file; short reads surface as struct.error."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = self.buf[self.pos:self.pos + n]
        self.pos += n
        return s.decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        return self.scalar(_SCALAR[vtype])

    def array(self):
        etype, n = self.scalar("<I"), self.scalar("<Q")
        if etype in _NUMPY:  # numbers: one numpy read instead of n struct calls
            arr = np.frombuffer(self.buf, dtype=_NUMPY[etype], count=n, offset=self.pos)
            self.pos += arr.nbytes
            return arr.tolist()
        return [self.value(etype) for _ in range(n)]


def _bytes_on(raw: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A block-quantized tensor's bytes (a view of the read-only map) as a uint8 tensor on
    ``device``, where ``gguf_quants`` unpacks them."""
    return torch.from_numpy(raw.copy()).to(device)


class GGUFModel:
    """A GGUF file: `metadata`, `tensor_infos`, `hf_config`, `tokenizer_metadata` and `iter_weights()`."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse_header()
        except (ValueError, struct.error, KeyError, OSError, UnicodeDecodeError, OverflowError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise ValueError(f"{self.path}: not a readable GGUF file (truncated or corrupt?): {e}") from e

    def _parse_header(self) -> None:
        h = _Header(self._mm)
        if self._mm[:4] != _GGUF_MAGIC:
            raise ValueError("bad magic, expected b'GGUF'")
        h.pos = 4
        version = h.scalar("<I")
        if version not in (2, 3):  # v1 used 32-bit counts; big-endian files show up as huge versions
            raise ValueError(f"unsupported GGUF version {version}")
        n_tensors, n_kv = h.scalar("<Q"), h.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = h.string()
            self.metadata[key] = h.value(h.scalar("<I"))
        self.tensor_infos: dict[str, tuple[tuple[int, ...], QT, int]] = {}
        for _ in range(n_tensors):
            name = h.string()
            dims = tuple(h.scalar("<Q") for _ in range(h.scalar("<I")))
            qtype, offset = QT(h.scalar("<I")), h.scalar("<Q")
            # GGUF lists dims innermost first; torch/HF order is the reverse.
            self.tensor_infos[name] = (dims[::-1], qtype, offset)
        align = self.metadata.get("general.alignment", 32)
        self._data_start = (h.pos + align - 1) // align * align  # data starts at the next boundary
        self._check_sizes()

    def _nbytes(self, shape: tuple[int, ...], qtype: QT) -> int:
        block, type_size = GGML_QUANT_SIZES[qtype]
        return prod(shape) // block * type_size

    def _check_sizes(self) -> None:
        # Catch truncation when opening, not halfway through loading the weights.
        for name, (shape, qtype, offset) in self.tensor_infos.items():
            end = self._data_start + offset + self._nbytes(shape, qtype)
            if end > len(self._mm):
                raise ValueError(f"tensor {name!r} ends at byte {end} but the file has {len(self._mm)} bytes")

    # ---- config -------------------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        arch, md = self.architecture, self.metadata
        if arch not in _ARCHITECTURES:
            raise ValueError(f"{self.path}: unsupported GGUF architecture {arch!r} "
                             f"(supported: {sorted(_ARCHITECTURES)})")
        get = lambda key, default=None: md.get(f"{arch}.{key}", default)  # noqa: E731
        model_type, cls = _MIXTRAL if arch == "llama" and get("expert_count") else _ARCHITECTURES[arch]
        if arch == "granitemoe" and get("expert_shared_feed_forward_length"):
            model_type, cls = "granitemoeshared", "GraniteMoeSharedForCausalLM"
        if arch == "olmo2" and get("attention.sliding_window"):
            model_type, cls = "olmo3", "Olmo3ForCausalLM"
        hidden, heads = get("embedding_length"), get("attention.head_count")
        head_dim = get("attention.key_length") or hidden // heads
        kv_heads = get("attention.head_count_kv", heads)
        embed = self.tensor_infos.get("token_embd.weight")
        vocab = get("vocab_size") or len(md.get("tokenizer.ggml.tokens", ())) or (embed[0][0] if embed else None)
        return {
            "architectures": [cls],
            "model_type": model_type,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": get("feed_forward_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            # (Phi-4-mini's rotary embedding turns three quarters of each head)
            "partial_rotary_factor": get("rope.dimension_count", head_dim) / head_dim,
            "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": get("rope.freq_base", 10000.0),
            "rope_scaling": self._rope_scaling(),
            "max_position_embeddings": get("context_length"),
            "tie_word_embeddings": "output.weight" not in self.tensor_infos,
            "attention_bias": "blk.0.attn_q.bias" in self.tensor_infos,
            "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
            "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
            "torch_dtype": self._torch_dtype(),
            "hidden_act": "gelu_pytorch_tanh" if arch in _NORMS_PLUS_ONE else "silu",
            "sliding_window": get("attention.sliding_window"),
        } | self._moe_config(get) | self._gemma_config(get) | self._layer_types(get) | {
            k: get(key) for k, key in _GRANITE_SCALES.items() if arch.startswith("granite") and get(key) is not None}

    def _moe_config(self, get) -> dict:
        """A mixture of experts' fields (none for a dense model). Layers without a router are
        dense (HF's mlp_only_layers); llama.cpp renormalises Qwen3-MoE's top-k weights and not
        Qwen2-MoE's unless the file says (Mixtral's always are)."""
        if not get("expert_count"):
            return {}
        dense = [i for i in range(get("block_count")) if f"blk.{i}.ffn_gate_inp.weight" not in self.tensor_infos]
        return {"num_experts": get("expert_count"), "num_experts_per_tok": get("expert_used_count"),
                "moe_intermediate_size": get("expert_feed_forward_length", get("feed_forward_length")),
                "shared_expert_intermediate_size": get("expert_shared_feed_forward_length", 0),
                "norm_topk_prob": get("expert_weights_norm", self.architecture != "qwen2moe"),
                "decoder_sparse_step": 1, "mlp_only_layers": dense}

    def _gemma_config(self, get) -> dict:
        """Gemma 2/3's entries that HF's config has and the file gives otherwise, or not at all."""
        arch = self.architecture
        if arch not in _GEMMA_27B_LAYERS:
            return {}
        hidden, heads, layers = get("embedding_length"), get("attention.head_count"), get("block_count")
        pattern = get("attention.sliding_window_pattern")   # (newer files: a bool a layer, _layer_types)
        return {"query_pre_attn_scalar": hidden // heads if layers == _GEMMA_27B_LAYERS[arch]
                else get("attention.key_length") or hidden // heads,
                "attn_logit_softcapping": get("attn_logit_softcapping"),
                "final_logit_softcapping": get("final_logit_softcapping"),
                "rope_local_base_freq": get("rope.freq_base_swa"),
                **({"sliding_window_pattern": pattern} if pattern and not isinstance(pattern, list) else {})}

    def _layer_types(self, get) -> dict:
        """Which layers have sliding windows (Gemma 3's and OLMo 3's: a bool a layer in newer files)
        or no rotary embedding (SmolLM3's), as HF's config says it."""
        layers, pattern = get("block_count"), get("attention.sliding_window_pattern")
        if self.architecture == "smollm3":
            return {"no_rope_layers": [int((i + 1) % _SMOLLM3_NO_ROPE_EVERY != 0) for i in range(layers)]}
        if isinstance(pattern, list):
            return {"layer_types": ["sliding_attention" if b else "full_attention" for b in pattern]}
        return {}

    def _rope_scaling(self) -> dict | None:
        prefix = f"{self.architecture}.rope.scaling."
        if "rope_factors_long.weight" in self.tensor_infos:
            # LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini): llama.cpp's converter writes the factors
            # as two tensors and the attention factor it computed, but no scaling type
            old_len = self.metadata.get(prefix + "original_context_length")
            if old_len is None or "rope_factors_short.weight" not in self.tensor_infos:
                raise ValueError(f"{self.path}: LongRoPE factors without rope_factors_short or "
                                 f"{prefix}original_context_length: the file is incomplete.")
            return {"rope_type": "longrope", "long_factor": self.tensor("rope_factors_long.weight").tolist(),
                    "short_factor": self.tensor("rope_factors_short.weight").tolist(),
                    "original_max_position_embeddings": old_len,
                    "attention_factor": self.metadata.get(prefix + "attn_factor")}
        kind = self.metadata.get(prefix + "type")
        if kind in (None, "none") and "rope_freqs.weight" in self.tensor_infos:
            # Llama-3's scaling (Llama 3.1 / 3.2, EXAONE 3.5): the converter writes no type, only each
            # frequency's divisor as a tensor
            return {"rope_type": "freq_factors", "factors": self.tensor("rope_freqs.weight").tolist()}
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, "factor": self.metadata.get(prefix + "factor", 1.0)}
        # (YaRN's attention factor and ramp, where the converter copied HF's: OLMo 3's)
        for hf, key in (("original_max_position_embeddings", "original_context_length"),
                        ("attention_factor", "attn_factor"), ("beta_fast", "yarn_beta_fast"),
                        ("beta_slow", "yarn_beta_slow")):
            if (value := self.metadata.get(prefix + key)) is not None:
                scaling[hf] = value
        return scaling

    def _torch_dtype(self) -> str:
        # Dequantized weights are float32, so quantized files say float32 (as transformers loads them);
        # an unquantized file keeps the dtype its embedding is stored in.
        qtype = self.tensor_infos["token_embd.weight"][1] if "token_embd.weight" in self.tensor_infos else None
        return {QT.F16: "float16", QT.BF16: "bfloat16"}.get(qtype, "float32")

    @property
    def tokenizer_metadata(self) -> dict[str, Any]:
        """Every `tokenizer.*` key (tokens, merges, token_type, special ids, chat_template, ...)."""
        return {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}

    # ---- weights ------------------------------------------------------------------------------

    def hf_name(self, gguf_name: str) -> str | None:
        """HF parameter name for a GGUF tensor name; None for tensors HF has no parameter for."""
        if gguf_name in _SKIPPED:
            return None
        if gguf_name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[gguf_name]
        m = _LAYER_RE.fullmatch(gguf_name)
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(self.architecture, {})}
        if m and m.group(2) in names:
            return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
        return gguf_name  # unknown: pass through so the loader reports it by its real name

    def tensor(self, gguf_name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor by GGUF name, dequantized to float32 in HF shape (q/k un-permuted for llama);
        on ``device`` (where the common block types are dequantized: on a GPU, its bytes go there
        and the GPU unpacks them)."""
        shape, qtype, raw = self._raw(gguf_name)
        if qtype in gguf_quants.TYPES:
            w = gguf_quants.dequantize(_bytes_on(raw, device), qtype).view(shape)
        else:
            w = dequantize(raw.reshape(prod(shape[:-1]), -1), qtype).reshape(shape)
            # F32 comes back as a view of the read-only map: copy it (and only it) so torch may own it.
            w = torch.from_numpy(np.require(w, np.float32, ["C", "W"])).to(device)
        if self.architecture in _NORMS_PLUS_ONE and gguf_name.endswith("norm.weight"):
            w = w - 1.0
        return self._unpermute(gguf_name, w)

    def _raw(self, gguf_name: str, types: frozenset = SUPPORTED_TYPES) -> tuple[tuple[int, ...], QT, np.ndarray]:
        """A tensor's shape, type and bytes (a view of the map), if its type is one of ``types``."""
        shape, qtype, offset = self.tensor_infos[gguf_name]
        if qtype not in types:
            raise ValueError(f"{self.path}: tensor {gguf_name!r} has unsupported type {qtype.name}")
        return shape, qtype, np.frombuffer(self._mm, dtype=np.uint8, count=self._nbytes(shape, qtype),
                                           offset=self._data_start + offset)

    def _unpermute(self, gguf_name: str, w: torch.Tensor) -> torch.Tensor:
        # llama.cpp's converter interleaves each head's rotary halves in q/k rows for the llama
        # architecture (convert_hf_to_gguf.py LlamaModel.permute: reshape(n_head, 2, dim//2).swapaxes);
        # undo it so the weights use HF's rotate-half layout. qwen2/qwen3 files are not permuted.
        arch = self.architecture
        if arch not in _PERMUTED or not (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            return w
        heads = self.metadata[f"{arch}.attention.head_count"]
        n_head = heads if ".attn_q." in gguf_name else self.metadata.get(f"{arch}.attention.head_count_kv", heads)
        return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    @cached_property
    def hf_types(self) -> dict[str, QT]:
        """Each tensor's type by its HF name, a stack of experts' under each expert's. (Once a
        file: a packed load asks for it twice.)"""
        names = {}
        for gguf_name, (shape, qtype, _) in self.tensor_infos.items():
            if experts := self._experts(gguf_name):
                names.update((experts.name(e), qtype) for e in range(shape[0]))
            elif (name := self.hf_name(gguf_name)) is not None:
                names[name] = qtype
        return names

    def packed_parts(self, gguf_name: str, device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
        """A matrix (or a stack of experts' matrices) of a block type as ``gguf_quants.decompose``'s
        parts, in HF shape and order (q/k rows un-permuted for llama): ``(".gguf_q", q (..., N, K)
        uint8), (".gguf_scale", (..., N, K / GROUP) float32), (".gguf_zero", ...)``."""
        shape, qtype, raw = self._raw(gguf_name, gguf_quants.TYPES)
        parts = gguf_quants.decompose(_bytes_on(raw, device), qtype)
        return [(suffix, self._unpermute(gguf_name, t.reshape(*shape[:-1], -1)))
                for suffix, t in zip((".gguf_q", ".gguf_scale", ".gguf_zero"), parts)]

    def iter_weights(self, skip: tuple[str, ...] = (), device: torch.device | str = "cpu",
                     packed: set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, dequantized tensor on ``device``) pairs, but for names starting with one of
        ``skip`` (not read), and the names in ``packed``, which come as ``packed_parts`` (their
        names ``.weight`` replaced by the parts'). Stacked experts come out as HF's, an expert at
        a time."""
        for gguf_name in self.tensor_infos:
            if experts := self._experts(gguf_name):
                if skip and experts.prefix.startswith(skip):
                    continue
                if experts.name(0) in packed:
                    parts = self.packed_parts(gguf_name, device)
                    for e in range(parts[0][1].shape[0]):
                        yield from ((experts.name(e, suffix), t[e]) for suffix, t in parts)
                else:
                    for e, w in enumerate(self.tensor(gguf_name, device)):
                        yield experts.name(e), w
                continue
            name = self.hf_name(gguf_name)
            if name in packed and not (skip and name.startswith(skip)):
                for suffix, t in self.packed_parts(gguf_name, device):
                    yield name.removesuffix(".weight") + suffix, t
            elif name is not None and not (skip and name.startswith(skip)):
                w = self.tensor(gguf_name, device)
                # (llama.cpp stores the shared expert's one-row gate as a vector)
                yield name, w.reshape(1, -1) if gguf_name.endswith("ffn_gate_inp_shexp.weight") else w

    @staticmethod
    def _experts(gguf_name: str) -> _Experts | None:
        """A stack of experts' projections (``blk.N.ffn_gate_exps.weight``, ...), else None."""
        m = _LAYER_RE.fullmatch(gguf_name)
        return _Experts(int(m.group(1)), _EXPERT_NAMES[m.group(2)], m.group(3)) \
            if m and m.group(2) in _EXPERT_NAMES else None

    def __repr__(self) -> str:
        return f"GGUFModel({self.path!r}, arch={self.metadata.get('general.architecture')!r}, " \
               f"tensors={len(self.tensor_infos)})"
