"""A LoRA adapter as PEFT saves it (``save_pretrained``), read and checked against the model.

The folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``,
``alpha_pattern``, ...) and ``adapter_model.safetensors`` (or the older ``adapter_model.bin``),
whose tensors are named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
(``(r, in_features)``) and ``...lora_B.weight`` (``(out_features, r)``). A module's output gains
``scaling * B @ A @ x``, with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA); the
scaling is folded into B here. Adapters of the seven projections of a Llama-family layer are
supported; anything else in the folder is an error that names it, never silently dropped.
"""
import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from pagoda.config import ArchConfig
from pagoda.lora.request import LoRARequest

# A checkpoint module -> (the layer that computes it, in a decoder layer; its slice there). The
# q/k/v and gate/up projections are fused into one matmul each (see model/llama.py).
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
# The fused layers and their slices' shard ids (their weight_loader's, which cuts B's rows for a
# tensor-parallel rank as it cuts the weight's)
FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": (None,),
         "mlp.gate_up_proj": (0, 1), "mlp.down_proj": (None,)}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module, unsharded."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


@dataclass
class LoRAAdapter:
    """An adapter's weights: (decoder layer, fused layer) -> one (A, scaled B) per slice, or None
    for a slice the adapter leaves alone."""
    weights: dict[tuple[int, str], list] = field(default_factory=dict)

    def slices(self, layer: int, fused: str) -> list | None:
        return self.weights.get((layer, fused))


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern: the first key that matches the module's name's end."""
    for key, value in (pattern or {}).items():
        if re.match(rf"(.*\.)?(?:{key})$", module):
            return value
    return default


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"No LoRA adapter at {path!r}: it has no adapter_config.json (a PEFT adapter folder, "
                         "as save_pretrained writes it).")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"Could not read {config_file}: {e}") from e
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_file}: peft_type {config['peft_type']!r} is not a LoRA adapter.")
    unsupported = [(config.get("use_dora"), "DoRA (use_dora)"),
                   (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')}"),
                   (config.get("bias", "none") != "none" or config.get("lora_bias"), "LoRA biases"),
                   (config.get("fan_in_fan_out"), "fan_in_fan_out (Conv1D weights)"),
                   (config.get("target_parameters"), "target_parameters")]
    for present, what in unsupported:
        if present:
            raise ValueError(f"The LoRA adapter at {path!r} uses {what}, which pagoda does not support.")
    if "r" not in config or "lora_alpha" not in config:
        raise ValueError(f"{config_file} has no 'r' or 'lora_alpha'.")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file
            return load_file(st)
        if os.path.isfile(pt):
            return torch.load(pt, map_location="cpu", weights_only=True)
    except Exception as e:      # (a truncated or corrupt file: safetensors and pickle raise their own)
        raise ValueError(f"Could not read the LoRA adapter's weights in {path!r}: {e}") from e
    raise ValueError(f"The LoRA adapter at {path!r} has no adapter_model.safetensors or adapter_model.bin.")


def load_adapter(request: LoRARequest, arch: ArchConfig, max_rank: int) -> LoRAAdapter:
    """The adapter ``request`` names, checked against the model's shapes and ``max_rank``."""
    path = request.lora_path
    config = _read_config(path)
    tensors = _read_tensors(path)
    shapes = module_shapes(arch)
    pairs: dict[tuple[int, str], dict] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(3) not in TARGETS:
            raise ValueError(f"The LoRA adapter at {path!r} has weights for {key!r}: pagoda applies adapters to "
                             f"the decoder layers' {', '.join(TARGETS)} only.")
        layer, module = int(m.group(1)), m.group(3)
        if layer >= arch.num_hidden_layers:
            raise ValueError(f"The LoRA adapter at {path!r} has weights for layer {layer}; the model has "
                             f"{arch.num_hidden_layers}.")
        pairs.setdefault((layer, module), {})[m.group(4)] = t
    if not pairs:
        raise ValueError(f"The LoRA adapter at {path!r} holds no LoRA weights.")
    adapter = LoRAAdapter()
    for (layer, module), ab in sorted(pairs.items()):
        a, b = ab.get("A"), ab.get("B")
        name = f"model.layers.{layer}.{module}"
        if a is None or b is None:
            raise ValueError(f"The LoRA adapter at {path!r} has lora_{'A' if a is None else 'B'} missing for {name}.")
        rank = a.shape[0]
        fan_in, fan_out = shapes[module]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, rank):
            raise ValueError(f"The LoRA adapter at {path!r} does not fit this model: {name} has A {tuple(a.shape)} "
                             f"and B {tuple(b.shape)}, the model needs ({rank}, {fan_in}) and ({fan_out}, {rank}).")
        if rank > max_rank:
            raise ValueError(f"The LoRA adapter at {path!r} has rank {rank} ({name}), above max_lora_rank={max_rank}: "
                             "raise max_lora_rank.")
        alpha = _pattern_value(config.get("alpha_pattern"), name, config["lora_alpha"])
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        fused, index = TARGETS[module]
        slices = adapter.weights.setdefault((layer, fused), [None] * len(FUSED[fused]))
        slices[index] = (a.float(), b.float() * scaling)
    return adapter
