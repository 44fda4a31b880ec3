"""LoRA adapter folders for tests, in PEFT's on-disk format (adapter_config.json +
adapter_model.safetensors, PEFT's tensor names), with random weights."""
import json
import os

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each projection, from a config.json's entries."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(folder: str, cfg: dict, r: int = 8, alpha: float = 16, targets=ALL_TARGETS, layers=None,
                  seed: int = 0, scale: float = 0.1, **config) -> str:
    """A random adapter for a model of config.json ``cfg``: each target module of each layer in
    ``layers`` (all by default) gets A (r, in) and B (out, r) of N(0, scale^2) entries. ``config``:
    more adapter_config.json entries (use_rslora, alpha_pattern, use_dora, ...)."""
    os.makedirs(folder, exist_ok=True)
    shapes = module_shapes(cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(cfg["num_hidden_layers"]):
        for module in targets:
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{name}.lora_A.weight"] = scale * torch.randn(r, fan_in, generator=g)
            tensors[f"{name}.lora_B.weight"] = scale * torch.randn(fan_out, r, generator=g)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None, **config}, f)
    return folder
