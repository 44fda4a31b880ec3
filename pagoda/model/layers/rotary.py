"""Rotary position embedding (rotate-half / NeoX layout, as HF checkpoints use), with the
Llama-3, linear, YaRN and LongRoPE scalings of the frequencies (and a factor a frequency, as GGUF
files give Llama-3's): the cos/sin table, over each head's first ``rotary_dim`` dimensions (all of
them but for a partial rotary embedding, Phi-4-mini's). The attention backends apply it
(``reference.Rope``), on the GPU inside the KV-write and attention kernels."""
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


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen2.5's and Qwen3's long-context setting): each frequency between its own (those
    that turn more than ``beta_fast`` times over the original context) and its own over
    ``factor`` (those that turn fewer than ``beta_slow`` times), on a linear ramp over the pairs of
    dimensions in between; and the attention factor (0.1 ln(factor) + 1 unless the config gives
    it), by which cos and sin are scaled, as HF does, so that the scores grow by its square."""
    if "factor" not in s or "original_max_position_embeddings" not in s:
        raise ValueError("rope_scaling of type 'yarn' needs 'factor' and 'original_max_position_embeddings'.")
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def pair_turning(turns):   # the pair of dimensions whose frequency turns `turns` times over old_len
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = pair_turning(s.get("beta_fast") or 32), pair_turning(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=inv_freq.dtype) - lo) / (hi - lo or 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    attention = s.get("attention_factor")
    if attention is None:
        both = s.get("mscale") and s.get("mscale_all_dim")
        attention = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if both else mscale(1.0)
    return inv_freq, attention


def _longrope_inv_freq(inv_freq: torch.Tensor, max_position: int, s: dict) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini): each frequency over its own factor, the long
    ones or the short ones, and the attention factor (the root of 1 + ln(factor) / ln(original
    context) unless the config gives it) by which cos and sin are scaled. Which factors is fixed
    for the engine's life, as vLLM fixes it: the long ones if a sequence may run past the
    original context (``use_long_rope``, from max_model_len; the table's length where not set).
    HF picks them at each forward by the longest sequence in it, so where max_model_len is the
    longer a prompt within the original context gets other frequencies here than in HF, as in
    vLLM, and the KV cache never holds keys of both kinds."""
    old_len = s["original_max_position_embeddings"]
    long = s.get("use_long_rope", max_position > old_len)
    factor = s["factor"]
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return _divided(inv_freq, s, "long_factor" if long else "short_factor"), attention


def _divided(inv_freq: torch.Tensor, s: dict, key: str) -> torch.Tensor:
    """Each frequency over its own factor, ``s[key]``: one a frequency."""
    factors = s[key]
    if len(factors) != len(inv_freq):
        raise ValueError(f"rope_scaling's {key} has {len(factors)} entries; "
                         f"the rotary embedding has {len(inv_freq)} frequencies (half its dimensions).")
    return inv_freq / torch.tensor(factors, dtype=inv_freq.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim = head_dim
        rotary_dim = rotary_dim or head_dim
        kind = (rope_scaling or {}).get("rope_type")   # (ArchConfig names every kind so)
        if kind == "dynamic":
            # vLLM's dynamic NTK scaling, which is static: the base raised once for the context the
            # factor allows (max_position_embeddings times it), whatever a sequence's length (HF
            # raises it only past max_position_embeddings, by the sequence's length)
            f = rope_scaling["factor"]
            base = base * (f * f - f + 1) ** (rotary_dim / (rotary_dim - 2))
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        attention = 1.0
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind == "yarn":
            inv_freq, attention = _yarn_inv_freq(inv_freq, rotary_dim, base, rope_scaling)
        elif kind == "longrope":
            inv_freq, attention = _longrope_inv_freq(inv_freq, max_position, rope_scaling)
        elif kind == "freq_factors":
            # (a GGUF file's rope_freqs tensor: llama.cpp's converter writes Llama-3's scaling so)
            inv_freq = _divided(inv_freq, rope_scaling, "factors")
        elif kind not in (None, "default", "dynamic"):
            raise ValueError(f"Unsupported rope_scaling type {kind!r} (supported: llama3, linear, yarn, longrope, "
                             "dynamic, freq_factors).")
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)
        # (max_position, rotary_dim): cos for the first half, sin for the second.
        self.register_buffer("cos_sin_cache", (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention).float(),
                             persistent=False)

