"""LoRA adapter folders for tests, in PEFT's on-disk format (adapter_config.json +
adapter_model.safetensors, PEFT's tensor names), with random weights."""
import json
import os

import torch
from safetensors.torch import save_file

from pagoda.config import ArchConfig
from pagoda.lora.adapter import TARGETS, module_shapes

ALL_TARGETS = tuple(TARGETS)


def write_adapter(folder: str, arch: ArchConfig | dict, r: int = 8, alpha: float = 16, targets=ALL_TARGETS,
                  layers=None, seed: int = 0, scale: float = 0.1, **config) -> str:
    """A random adapter for a model of shape ``arch`` (or its config.json): each target module of each layer in
    ``layers`` (all by default) gets A (r, in) and B (out, r) of N(0, scale^2) entries. ``config``:
    more adapter_config.json entries (use_rslora, alpha_pattern, use_dora, ...)."""
    os.makedirs(folder, exist_ok=True)
    arch = ArchConfig.from_hf_dict(arch) if isinstance(arch, dict) else arch
    shapes = module_shapes(arch)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers if layers is not None else range(arch.num_hidden_layers):
        for module in targets:
            part = TARGETS[module][0].split(".")[0]          # self_attn or mlp
            name = f"base_model.model.model.layers.{layer}.{part}.{module}"
            fan_in, fan_out = shapes[module]
            tensors[f"{name}.lora_A.weight"] = scale * torch.randn(r, fan_in, generator=g)
            tensors[f"{name}.lora_B.weight"] = scale * torch.randn(fan_out, r, generator=g)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None, **config}, f)
    return folder
