"""Rotary position embedding (rotate-half / NeoX layout, as HF checkpoints use), with the
Llama-3 and linear scalings of the frequencies: the cos/sin table. The attention backends
apply it (``reference.Rope``), on the GPU inside the KV-write and attention kernels."""
import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind not in (None, "default"):
            raise ValueError(f"Unsupported rope_scaling type {kind!r}.")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # (max_position, head_dim): cos for the first half, sin for the second.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1).float(),
                             persistent=False)

