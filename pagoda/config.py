"""Engine configuration as plain dataclasses. `engine/arg_utils.py` builds them from the user's
`LLM(...)` keyword arguments; everything else only reads them."""
from dataclasses import dataclass, field, fields

import torch


@dataclass
class ArchConfig:
    """The transformer's shape, read from a HF config.json dict (or a GGUF's metadata
    rendered as one)."""
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_id: list[int]
    torch_dtype: str | None
    hf_config: dict = field(repr=False, default_factory=dict)
    # Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True           # renormalise the chosen experts' weights to sum to 1
    shared_expert_intermediate_size: int = 0   # Qwen2-MoE: a gated MLP every token runs through too
    shared_expert_gated: bool = True           # (Granite MoE Shared's is added without a gate)
    dense_layers: tuple[int, ...] = ()    # the MoE model's layers with a dense MLP
    # Each query attends to its last this many positions only (Mistral-7B-v0.1 and its
    # fine-tunes); 0: the whole context. With ``layer_types`` (HF's "sliding_attention" /
    # "full_attention" a layer: Gemma 2/3, Qwen2's max_window_layers), on the sliding layers only.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    # Gemma 3's sliding layers' own rope base (no scaling); 0: every layer has the model's rope
    local_rope_theta: float = 0.0
    # The rotary embedding turns each head's first rotary_dim dimensions only (HF's
    # partial_rotary_factor times head_dim: Phi-4-mini's three quarters); 0: all of them
    rotary_dim: int = 0
    # Gemma's: every RMSNorm's weight an offset from 1, applied in float32 before rounding (HF's
    # x * (1 + w)); the MLP's activation; (Gemma 2/3) each sublayer's output normed before it
    # joins the residual; tanh caps on the attention scores and on the logits (0: none)
    rms_norm_unit_offset: bool = False
    hidden_act: str = "silu"
    sandwich_norms: bool = False
    # OLMo 2/3's: no norm of a sublayer's input, only of its output (before it joins the
    # residual); q and k each normed over the whole projection, all heads at once
    post_norms_only: bool = False
    qk_norm_whole: bool = False
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # Granite's scalings: the embeddings times, each sublayer's output times (before it joins the
    # residual), the attention's scores times (in head_dim ** -0.5's place), the logits over
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # SmolLM3's layers without a rotary embedding (NoPE): HF's no_rope_layers, 1 where a layer has one
    no_rope_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def uses_rope(self, layer: int) -> bool:
        return not self.no_rope_layers or bool(self.no_rope_layers[layer])

    def window(self, layer: int) -> int:
        """The layer's sliding window (0: it attends to the whole context)."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return 0
        return self.sliding_window

    def local_layer(self, layer: int) -> bool:
        """A layer of the sliding kind (``layer_types``), whose rotary embedding is Gemma 3's local
        one, its window on or off (disable_sliding_window)."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def windows(self) -> set[int]:
        """The layers' sliding windows (0 among them where some layer attends to its whole context)."""
        return {self.window(i) for i in range(self.num_hidden_layers)}

    @property
    def uniform_window(self) -> int:
        """The sliding window every layer has (Mistral-7B-v0.1's, Phi-3-mini-4k's), so that KV
        before it is never read again; 0 where some layer attends to its whole context."""
        windows = self.windows
        return windows.pop() if len(windows) == 1 else 0

    @property
    def max_context(self) -> int:
        """The longest context the model takes, as vLLM derives it: max_position_embeddings, or
        with a linear, dynamic NTK or YaRN rope scaling that times its factor (YaRN's: original_
        max_position_embeddings times it); Llama-3's scaling is in max_position_embeddings already."""
        s = self.rope_scaling or {}
        kind = s.get("rope_type")
        # (Gemma 3's linear scaling is in its max_position_embeddings already, as vLLM reads it)
        if kind not in ("linear", "dynamic", "yarn") or self.hf_config.get("model_type", "").startswith("gemma3"):
            return self.max_position_embeddings
        base = s.get("original_max_position_embeddings", self.max_position_embeddings) if kind == "yarn" \
            else self.max_position_embeddings
        return int(base * s.get("factor", 1.0))

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ArchConfig":
        d = _as_transformers_reads(d)
        archs = d.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot tell which model this is.")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        model_type = d.get("model_type", "")
        gemma = model_type.startswith("gemma")
        rope_params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
        # (transformers 5 writes Gemma 3's per kind of layer: the full layers' is the model's)
        local_rope = rope_params.get("sliding_attention") or {}
        rope_params = rope_params.get("full_attention", rope_params)
        rope_scaling = d.get("rope_scaling") or (rope_params if "rope_type" in rope_params else None)
        rope_theta = rope_params.get("rope_theta") or d.get("rope_theta") or 10000.0
        if rope_scaling is not None:
            rope_scaling = _rope_scaling(d, rope_scaling, model_type)
        if local_rope.get("rope_type", "default") != "default":
            raise ValueError(f"A rope scaling of the sliding layers ({local_rope['rope_type']!r}) is not supported.")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        partial = d.get("partial_rotary_factor") or rope_params.get("partial_rotary_factor", 1.0)
        rotary_dim = int(head_dim * partial)
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor={partial} turns {rotary_dim} of each head's {head_dim} "
                             "dimensions: it must be a positive even number, at most head_dim.")
        window, layer_types = _sliding_windows(d, model_type)
        hidden_act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
        if gemma and hidden_act == "gelu":   # (Gemma's first configs: HF and vLLM read it as tanh's)
            hidden_act = "gelu_pytorch_tanh"
        pre_attn = d.get("query_pre_attn_scalar")   # (Gemma 2/3: the scores over its root, not head_dim's)
        return cls(
            **_moe_fields(d),
            architecture=archs[0],
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            # Qwen2 always carries q/k/v biases, Qwen2-MoE unless its qkv_bias says not; others say
            # so in attention_bias.
            attention_bias=d.get("attention_bias", model_type == "qwen2" or archs[0] == "Qwen2ForCausalLM"
                                 or (model_type == "qwen2_moe" and d.get("qkv_bias", True))),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            hf_config=d,
            sliding_window=window,
            layer_types=layer_types,
            local_rope_theta=float(local_rope.get("rope_theta") or d.get("rope_local_base_freq") or 0.0),
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            # (Gemma scales its embeddings by the root of the hidden size)
            embedding_multiplier=d["hidden_size"] ** 0.5 if gemma else d.get("embedding_multiplier", 1.0),
            residual_multiplier=d.get("residual_multiplier", 1.0),
            attention_multiplier=pre_attn ** -0.5 if gemma and pre_attn else d.get("attention_multiplier"),
            logits_scaling=d.get("logits_scaling", 1.0),
            no_rope_layers=tuple(d.get("no_rope_layers") or ()),
            rms_norm_unit_offset=gemma,
            hidden_act=hidden_act,
            sandwich_norms=model_type.startswith(("gemma2", "gemma3")),
            post_norms_only=model_type in ("olmo2", "olmo3"),
            qk_norm_whole=model_type in ("olmo2", "olmo3"),
            attn_logit_softcapping=d.get("attn_logit_softcapping") or 0.0,
            final_logit_softcapping=d.get("final_logit_softcapping") or 0.0,
        )


def _rope_scaling(d: dict, s: dict, model_type: str) -> dict | None:
    """A config's rope scaling with one name a kind ("rope_type": older configs say "type"; Phi-3's
    first said "su", or "yarn", for LongRoPE, as transformers reads them), None for the default;
    LongRoPE's with its original context and factor filled in from the top level, as HF does."""
    kind = s.get("rope_type", s.get("type"))
    if kind == "default":
        return None
    if kind == "su" or (kind == "yarn" and model_type == "phi3"):
        kind = "longrope"
    s = dict(s, rope_type=kind)
    if kind in ("linear", "dynamic") and not s.get("factor"):
        raise ValueError(f"rope_scaling of type {kind!r} needs its 'factor'.")
    if kind == "longrope":
        old_len = s.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
        if not old_len or "short_factor" not in s or "long_factor" not in s:
            raise ValueError("rope_scaling of type 'longrope' needs 'short_factor', 'long_factor' and "
                             "'original_max_position_embeddings' (in it or beside it in config.json).")
        s["original_max_position_embeddings"] = old_len
        # (Phi-3's give no factor: it is the context's growth, which sets the attention factor)
        s.setdefault("factor", d.get("max_position_embeddings", old_len) / old_len)
    return s


# transformers' defaults of the entries a config.json may leave out (or null), by model_type:
# Gemma 3's text model (its multimodal checkpoints give their text_config only where it differs)
_CONFIG_DEFAULTS = {
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
        rms_norm_eps=1e-6, bos_token_id=2, eos_token_id=1, tie_word_embeddings=True, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=6),
}
# Multimodal checkpoints whose text model runs alone (text prompts only: images are not
# supported), by architecture: that model's type
_TEXT_MODELS = {"Gemma3ForConditionalGeneration": "gemma3_text"}
# (what the top level of such a config.json says for the whole model)
_TOP_LEVEL_KEYS = ("architectures", "quantization_config", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
                   "tie_word_embeddings")


# Entries some configs name otherwise (transformers' attribute_map), by model_type; and the
# architecture a model_type is, whatever class name transformers saved it under
_ATTRIBUTE_MAPS = {"exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
                              "activation_function": "hidden_act"},
                   "internlm3": {"qkv_bias": "attention_bias"}}
_ARCHITECTURES = {"exaone": "ExaoneForCausalLM", "internlm3": "InternLM3ForCausalLM"}


def _as_transformers_reads(d: dict) -> dict:
    """config.json as transformers' config class reads it: a multimodal one (``_TEXT_MODELS``) as
    its text model's, entries under their usual names (``_ATTRIBUTE_MAPS``), and the defaults
    (``_CONFIG_DEFAULTS``) of the entries it leaves out."""
    text_type = _TEXT_MODELS.get((d.get("architectures") or [None])[0])
    if text_type and isinstance(d.get("text_config"), dict):
        d = {"model_type": text_type, **d["text_config"], **{k: d[k] for k in _TOP_LEVEL_KEYS if d.get(k) is not None}}
    model_type = d.get("model_type")
    if model_type in _ATTRIBUTE_MAPS:
        d = {_ATTRIBUTE_MAPS[model_type].get(k, k): v for k, v in d.items()}
    if model_type in _ARCHITECTURES and d.get("architectures"):
        d = dict(d, architectures=[_ARCHITECTURES[model_type]])
    defaults = _CONFIG_DEFAULTS.get(d.get("model_type"), {})
    return {**defaults, **{k: v for k, v in d.items() if v is not None or k not in defaults}}


def _sliding_windows(d: dict, model_type: str) -> tuple[int, tuple[str, ...]]:
    """The window HF's attention applies and the layers it applies to (none named: all): Mistral's,
    Mixtral's and Phi-3's on every layer; Gemma 2's on every other layer, Gemma 3's on five of six
    (``layer_types``, or the ``sliding_window_pattern`` older configs give), OLMo 3's on three of
    four. Configs with a ``use_sliding_window`` switch (Qwen2/3, SmolLM3) name a window they do not
    use while it is off; on, HF applies it from layer ``max_window_layers`` on."""
    window, n = d.get("sliding_window") or 0, d["num_hidden_layers"]
    types = d.get("layer_types")
    if model_type.startswith(("qwen2", "qwen3")) or "use_sliding_window" in d:
        if not d.get("use_sliding_window"):
            return 0, ()
        types = types or ["sliding_attention" if i >= d.get("max_window_layers", n) else "full_attention"
                          for i in range(n)]
    elif model_type.startswith("gemma2"):
        types = types or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif model_type == "olmo3":    # (three layers of four, as transformers' config fills it in)
        types = types or ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    elif model_type.startswith("gemma3"):
        pattern = d["sliding_window_pattern"]
        types = types or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    types = tuple(types or ())
    if not window or (types and "sliding_attention" not in types):
        return 0, ()
    return window, types


def _moe_fields(d: dict) -> dict:
    """The MoE entries of config.json: Mixtral's (num_local_experts, every layer's MLP an MoE of
    intermediate_size, weights renormalised) or Qwen2/3-MoE's (num_experts, moe_intermediate_size,
    norm_topk_prob, an MoE every decoder_sparse_step layers but mlp_only_layers; Qwen2-MoE's
    shared expert, and Granite MoE Shared's ungated one)."""
    experts = d.get("num_experts") or d.get("num_local_experts") or 0
    if not experts:
        return {}
    layers, step = d["num_hidden_layers"], d.get("decoder_sparse_step") or 1
    dense = sorted(set(d.get("mlp_only_layers") or ()) | {i for i in range(layers) if (i + 1) % step})
    return {"num_experts": experts, "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d.get("moe_intermediate_size") or d["intermediate_size"],
            # (Mixtral always renormalises; transformers' Qwen2/3-MoE configs default to not)
            "norm_topk_prob": d.get("norm_topk_prob", d.get("model_type") not in ("qwen2_moe", "qwen3_moe")),
            "shared_expert_intermediate_size": (d.get("shared_expert_intermediate_size")
                                                or d.get("shared_intermediate_size") or 0),
            "shared_expert_gated": d.get("model_type") != "granitemoeshared",
            "dense_layers": tuple(dense)}


class HFConfigDict(dict):
    """config.json as read: a dict whose entries are also attributes, so that an ``hf_overrides``
    function written for transformers' PretrainedConfig (``config.x = ...``) works on it."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


def apply_hf_overrides(d: dict, overrides) -> dict:
    """vLLM's ``hf_overrides``: config.json entries to set (a dict given for a dict entry is merged
    into it), or a function that takes the config (``HFConfigDict``) and returns it. Then a causal
    LM named a classifier with ``classifier_from_token`` (by the overrides, or by its config.json
    itself) gets its label count (see ``classifier_from_tokens``)."""
    if overrides is None:
        return _classifier_labels(d)
    if callable(overrides):
        d = overrides(HFConfigDict(d))
        if not isinstance(d, dict):
            raise TypeError(f"The hf_overrides function returned {type(d).__name__}, not the config.")
        d = dict(d)
    elif isinstance(overrides, dict):
        d = {**d, **{k: {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
                     for k, v in overrides.items()}}
    else:
        raise TypeError(f"hf_overrides must be a dict of config entries or a function of the config, not "
                        f"{type(overrides).__name__}.")
    return _classifier_labels(d)


# vLLM's conversions of a causal LM into a classifier whose score head is rows of its LM head
# (hf_overrides' "method"): the rows of the classifier_from_token tokens as they are, or, for a
# reranker that answers "no" / "yes" (Qwen3-Reranker: is_original_qwen3_reranker), the
# difference yes - no as one label, whose sigmoid is the 2-way softmax's probability of "yes".
CLASSIFIER_METHODS = ("no_post_processing", "from_2_way_softmax")


def classifier_from_tokens(arch: "ArchConfig") -> tuple[list[str], bool] | None:
    """(the tokens whose LM-head rows make the score head, whether as a 2-way softmax), or None
    for a model that is not converted."""
    tokens = arch.hf_config.get("classifier_from_token")
    return None if tokens is None else (list(tokens), arch.hf_config["method"] == "from_2_way_softmax")


def _classifier_labels(d: dict) -> dict:
    tokens = d.get("classifier_from_token")
    if tokens is None:
        return d
    if not (isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must be a list of token strings, got {tokens!r}.")
    if not is_classifier((d.get("architectures") or [""])[0]):
        raise ValueError("classifier_from_token makes a causal LM's LM-head rows a classifier's score head: set "
                         "'architectures' to its *ForSequenceClassification too (e.g. "
                         "['Qwen3ForSequenceClassification']).")
    method = "from_2_way_softmax" if d.get("is_original_qwen3_reranker") else d.get("method", "no_post_processing")
    if method not in CLASSIFIER_METHODS:
        raise ValueError(f"Unknown method {method!r} for classifier_from_token; choose one of {CLASSIFIER_METHODS}.")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"A 2-way softmax classifier takes two tokens, [false, true] (e.g. ['no', 'yes']), "
                         f"got {list(tokens)}.")
    labels = tokens[1:] if method == "from_2_way_softmax" else tokens
    return {**d, "method": method, "num_labels": len(labels), "id2label": {str(i): t for i, t in enumerate(labels)}}


# The sampling fields of a generation_config.json that become the model's default SamplingParams
# (vLLM's generation_config="auto"), by their SamplingParams names
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(generation_config: dict) -> dict:
    """The SamplingParams fields a generation config sets (those it has, renamed)."""
    return {ours: generation_config[key] for key, ours in GENERATION_CONFIG_FIELDS.items()
            if generation_config.get(key) is not None}


POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass
class PoolerConfig:
    """How a pooling model's hidden states (after the final norm) become one vector: the last
    token's (decoder embedding models), their mean, or the first token's; then L2-normalized."""
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        self.pooling_type = self.pooling_type.upper()
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"Unknown pooling_type {self.pooling_type!r}; choose one of {', '.join(POOLING_TYPES)}.")


@dataclass
class ModelConfig:
    model: str                    # what the user passed
    path: str                     # resolved local folder or .gguf file
    arch: ArchConfig
    dtype: torch.dtype            # dtype the weights are stored in
    compute_dtype: torch.dtype    # dtype the math runs in (float32 on CPUs without bf16 units)
    seed: int = 0
    load_format: str = "auto"     # auto | safetensors | gguf | dummy
    quantization: str | None = None
    quant_config: dict | None = None   # the checkpoint's quantization config
    tokenizer: str | None = None
    revision: str | None = None
    generation_config: dict = field(default_factory=dict)     # the model's own (its eos_token_id is a stop token)
    # The sampling fields of the generation config in use (EngineArgs.generation_config) that
    # requests take where they do not set them: LLM.get_default_sampling_params, the server
    sampling_defaults: dict = field(default_factory=dict)
    runner: str = "generate"      # or "pooling" (vLLM's runner): LLM.embed / encode instead of generate
    pooler: PoolerConfig | None = None   # with the pooling runner
    # A causal LM read as a classifier (classifier_from_tokens): its tokens' ids, whose LM-head
    # rows make the score head at load
    classifier_token_ids: tuple[int, ...] = ()
    # The model thinks before it answers (vLLM's reasoning_parser: "qwen3", "deepseek_r1"): a
    # structured output's grammar then holds the answer after its </think>, not the thinking
    reasoning_parser: str | None = None
    max_logprobs: int = 20        # the most logprobs (sample or prompt) a request may ask for; -1: no limit

    @property
    def is_gguf(self) -> bool:
        return self.path.endswith(".gguf")

    @property
    def pooling_task(self) -> str:
        """What the pooling runner returns: a sequence classification model's class
        probabilities ("classify"), any other model's embedding ("embed")."""
        return "classify" if is_classifier(self.arch.architecture) else "embed"


def is_classifier(architecture: str) -> bool:
    return architecture.endswith("ForSequenceClassification")


def class_labels(arch: ArchConfig) -> list[str]:
    """A classification model's label names in class order: config.json's ``id2label``, else
    ``num_labels`` (2 when absent, as in transformers) names LABEL_0, LABEL_1, ..."""
    id2label = arch.hf_config.get("id2label")
    if id2label:
        return [id2label[k] for k in sorted(id2label, key=int)]
    return [f"LABEL_{i}" for i in range(arch.hf_config.get("num_labels", 2))]


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None     # explicit KV budget (the CPU default is 4 GiB)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # The KV cache's storage: "auto" keeps the model's compute dtype; "fp8" (= "fp8_e4m3") and
    # "fp8_e5m2" store one byte per element, each layer's K and V divided by its k_scale /
    # v_scale (the checkpoint's, else 1.0, as in vLLM): twice the tokens in the same memory, and
    # half the bytes for the decode attention to read.
    cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: each layer's k_scale / v_scale from the first step's keys and
    # values (their largest magnitude over K_SCALE_RANGE / V_SCALE_RANGE), not the checkpoint's
    # or 1.0. For caches of models whose keys exceed FP8's range (E4M3: 448).
    calculate_kv_scales: bool = False
    num_blocks: int = 0                          # decided by the runner after profiling
    # How the layers' KV shares the blocks (kv_cache_groups); set by EngineArgs.
    groups: tuple["KVCacheGroup", ...] = ()


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose KV follows one block table (vLLM's KV cache group). A block of the pool holds
    a block's worth of tokens for as many layers as the largest group has: layer j of a group
    keeps its KV in the j-th cache tensor, at the block ids of its group's table. A group's
    layers share a sliding window (0: none), outside which its blocks are given back."""
    window: int
    layers: tuple[int, ...]


def kv_cache_groups(arch: ArchConfig, hybrid: bool = True) -> tuple[KVCacheGroup, ...]:
    """The layers' KV cache groups: one for all layers where they share one window (or where
    ``hybrid`` is off: then every layer keeps its whole context). Else, as vLLM groups Gemma 2/3's
    layers, each kind of layer (by window) cut into groups of as many layers as the rarest kind
    has: Gemma-3-1B's 4 full and 22 sliding layers make a full group of 4 and six sliding
    groups (the last of 2), so a block is 4 layers' KV, and a long request holds its whole
    context in the full group only, a window's worth in each sliding group."""
    n = arch.num_hidden_layers
    by_window: dict[int, list[int]] = {}
    for i in range(n):
        by_window.setdefault(arch.window(i), []).append(i)
    if len(by_window) == 1 or not hybrid:
        return (KVCacheGroup(arch.uniform_window, tuple(range(n))),)
    size = min(len(layers) for layers in by_window.values())
    return tuple(KVCacheGroup(w, tuple(layers[i:i + size])) for w, layers in sorted(by_window.items())
                 for i in range(0, len(layers), size))


KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for CacheConfig.cache_dtype (checked by EngineArgs)."""
    return KV_CACHE_DTYPES[cache_dtype] or compute_dtype


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    # Schedule step N+1 while the device runs step N (see LLMEngine.step).
    async_scheduling: bool = False
    # Steps in flight at once (vLLM's batch queue): the pipeline's stages, each on its own batch.
    # Above 1, a request whose sampled token is still in flight waits for it.
    max_concurrent_batches: int = 1
    # "fcfs": first come, first served; "priority": lowest priority value first, then arrival
    # (vLLM's scheduling_policy); preemption then takes the lowest-priority running request.
    policy: str = "fcfs"


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Where the replicas of data_parallel_size > 1 run: processes of this node ("mp"), or Ray
    # actors that the cluster places on any of its nodes ("ray"; DPEngine only).
    data_parallel_backend: str = "mp"
    # A mixture of experts' experts over the tensor-parallel ranks (vLLM's expert parallelism,
    # within one replica): each rank holds num_experts / tp whole experts, instead of a 1/tp slice
    # of every expert's intermediate size (fewer, larger matmuls; what slices too thin want).
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify(self, arch: ArchConfig, device: str) -> None:
        """Fail before anything is loaded or started on a layout this engine cannot run."""
        tp, pp, dp = self.tensor_parallel_size, self.pipeline_parallel_size, self.data_parallel_size
        if dp < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {dp}.")
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {tp}.")
        if pp < 1:
            raise ValueError(f"pipeline_parallel_size must be at least 1, got {pp}.")
        if pp > arch.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {arch.num_hidden_layers} "
                             f"layers: every stage needs at least one; use at most {arch.num_hidden_layers}.")
        backend, dp_backend = self.distributed_executor_backend, self.data_parallel_backend
        if backend not in (None, "mp", "uni", "ray"):
            raise ValueError(f"Unknown distributed_executor_backend {backend!r}; choose 'mp' or 'ray'.")
        if dp_backend not in ("mp", "ray"):
            raise ValueError(f"Unknown data_parallel_backend {dp_backend!r}; choose 'mp' or 'ray'.")
        import importlib.util
        for name, value in (("distributed_executor_backend", backend), ("data_parallel_backend", dp_backend)):
            if value == "ray" and importlib.util.find_spec("ray") is None:
                raise ValueError(f"{name}='ray' needs Ray, which is not installed: pip install ray "
                                 f"(or leave {name} unset for multiprocessing).")
        if backend == "ray" and dp > 1:
            # A replica's ranks stay on its node (they are its engine's processes); the replicas
            # themselves are what may go to other nodes.
            raise ValueError(f"distributed_executor_backend='ray' runs one engine's ranks over Ray, not "
                             f"data_parallel_size={dp} replicas: leave it unset, and set data_parallel_backend="
                             f"'ray' to run each replica (with its ranks) as a Ray actor on the cluster's nodes.")
        gpus = dp * self.world_size
        # (Over Ray the GPUs may be on other nodes: the cluster is asked instead, and each
        # replica checks its own.)
        over_ray = backend == "ray" or (dp > 1 and dp_backend == "ray")
        if device == "cuda" and gpus > 1 and not over_ray and torch.cuda.device_count() < gpus:
            layout = f"data_parallel_size={dp} x " if dp > 1 else ""
            raise ValueError(f"{layout}tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {gpus} "
                             f"GPUs (one per rank), but {torch.cuda.device_count()} are visible.")
        if self.world_size == 1:
            return
        if backend == "uni":
            raise ValueError(f"distributed_executor_backend='uni' runs one process: it cannot run "
                             f"tensor_parallel_size={tp} x pipeline_parallel_size={pp}; use 'mp'.")
        if tp == 1:
            return
        heads, kv = arch.num_attention_heads, arch.num_key_value_heads
        if heads % tp:
            raise ValueError(f"The model's {heads} attention heads are not divisible by tensor_parallel_size="
                             f"{tp}; use a tensor_parallel_size that divides {heads}.")
        if (kv % tp) if kv >= tp else (tp % kv):
            raise ValueError(f"The model's {kv} KV heads do not split over tensor_parallel_size={tp}: it must "
                             f"divide {kv}, or be a multiple of it (each KV head then lives on several ranks).")
        if arch.intermediate_size % tp:
            raise ValueError(f"The model's intermediate_size {arch.intermediate_size} is not divisible by "
                             f"tensor_parallel_size={tp}.")
        if self.enable_expert_parallel and arch.num_experts % tp:
            raise ValueError(f"enable_expert_parallel shares the model's {arch.num_experts} experts out over "
                             f"tensor_parallel_size={tp} ranks: use a tensor_parallel_size that divides "
                             f"{arch.num_experts}.")
        for what, size in (("experts'", 0 if self.enable_expert_parallel else arch.moe_intermediate_size),
                           ("shared expert's", arch.shared_expert_intermediate_size)):
            if size % tp:
                raise ValueError(f"The model's {what} intermediate size {size} is not divisible by "
                                 f"tensor_parallel_size={tp}.")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config: each decode step checks up to ``num_speculative_tokens``
    draft tokens after a request's last one, in one forward. The drafts come from

    - ``method="ngram"`` (prompt lookup): the tokens that followed the latest earlier
      occurrence of the sequence's last n tokens (n from ``prompt_lookup_max`` down to
      ``prompt_lookup_min``; with neither bound given both are 5, with one the other equals it,
      vLLM's rule);
    - ``method="draft_model"`` (the method when ``model`` is given, as in vLLM): a smaller model
      of the same vocabulary, ``model`` (a local folder or .gguf), run greedily for k tokens
      after each step. It shares the target's block tables (its own KV in the same blocks),
      dtype and tensor parallelism; ``quantization`` is its checkpoint's.

    ``disable_by_batch_size``: no drafts while that many requests or more are in the engine
    (running or waiting), whose batch already keeps the GPU busy."""
    method: str | None = None
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None
    model: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int | None = None
    # The draft model's, filled in by EngineArgs (not a user key)
    draft_model_config: "ModelConfig | None" = field(default=None, repr=False)

    def __post_init__(self):
        if self.model in ("ngram", "[ngram]"):       # (vLLM's older spelling of the method)
            self.method, self.model = self.method or "ngram", None
        self.method = self.method or ("draft_model" if self.model else "ngram")
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"Unknown speculative method {self.method!r}: this engine proposes drafts by n-gram "
                             "lookup ('ngram') or with a draft model ('draft_model', or give 'model'); EAGLE, "
                             "Medusa and MTP are not supported.")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config with method 'draft_model' needs 'model': the draft model's path.")
        if self.method == "ngram" and self.model:
            raise ValueError(f"speculative_config: method 'ngram' takes no model (got {self.model!r}); leave the "
                             "method out, or set it to 'draft_model', to draft with that model.")
        if self.num_speculative_tokens < 1:
            raise ValueError("speculative_config needs num_speculative_tokens >= 1 (the most draft tokens a step "
                             f"checks), got {self.num_speculative_tokens}.")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (lo or hi, hi or lo)
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}.")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        known = {f.name for f in fields(cls)} - {"draft_model_config"}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"Unknown speculative_config keys {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**d)


@dataclass
class LoRAConfig:
    """vLLM's LoRA arguments (``enable_lora=True``): ``max_loras`` adapters in one step (each
    adapted layer keeps that many on the device), of rank up to ``max_lora_rank``, and up to
    ``max_cpu_loras`` adapters kept read on the host (default: max_loras)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self):
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {self.max_loras} and "
                             f"{self.max_lora_rank}.")
        self.max_cpu_loras = self.max_cpu_loras or self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}).")


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str = "cpu"
    enforce_eager: bool = False
    log_stats: bool = False
    enable_sleep_mode: bool = False
    worker_extension_cls: str | None = None     # vLLM's: "module.Class" whose methods every rank's worker gets
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None              # enable_lora
