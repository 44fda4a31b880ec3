"""Torch reference kernels: the CPU path and the oracle every Triton kernel is tested against.

KV cache layout, per layer: ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each
``(num_blocks, block_size, num_kv_heads, head_dim)``. A token at position ``pos`` of a request
lives in slot ``block_table[pos // block_size] * block_size + pos % block_size``.

A batch is "varlen": the scheduled query tokens of all requests are concatenated;
request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of ``query``, and those rows
are the *last* positions of its ``seq_lens[i]`` context tokens (the ones before them are already
in the cache). Decode is the case of one query token; prefill and chunked prefill are longer.

An FP8 cache (``torch.float8_e4m3fn`` / ``float8_e5m2``) holds each layer's K / V divided by its
``k_scale`` / ``v_scale`` and clamped to the format's range (``quantize_kv``); readers multiply
back (``dequantize_kv``). Other caches hold the values as they are and ignore the scales. A
one-byte cache also stores each block's values as ``(num_kv_heads, head_dim, block_size)``:
``value_blocks`` gives them in the keys' layout whatever the cache (triton_attention says why).
"""
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: FP8 holds ``x / scale``, clamped to the format's
    largest finite value (a plain cast would turn what lies beyond it into NaN), rounded to
    nearest even."""
    if not is_fp8(dtype):
        return x.to(dtype)
    top = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-top, top).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents back in ``dtype`` (exact for an FP8 cache and scale 1)."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    return x.to(dtype) if scale == 1.0 else (x.float() * scale).to(dtype)


def value_blocks(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache's values as ``(num_blocks, block_size, num_kv_heads, head_dim)``: ``kv_cache[1]``,
    or for a one-byte cache a view of its ``(num_kv_heads, head_dim, block_size)`` blocks."""
    values = kv_cache[1]
    if values.element_size() != 1:
        return values
    num_blocks, block_size, num_kv_heads, head_dim = values.shape
    return values.view(num_blocks, num_kv_heads, head_dim, block_size).permute(0, 3, 1, 2)


def quantize_kv_cache(kv_cache: torch.Tensor, dtype: torch.dtype, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """A cache of ``dtype`` holding what ``kv_cache`` (keys' layout for both) holds (tests,
    benchmarks)."""
    out = torch.empty(kv_cache.shape, dtype=dtype, device=kv_cache.device)
    out[0] = quantize_kv(kv_cache[0], k_scale, dtype)
    value_blocks(out).copy_(quantize_kv(kv_cache[1], v_scale, dtype))
    return out


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter new K/V ``(num_tokens, num_kv_heads, head_dim)`` into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = quantize_kv(key, k_scale, kv_cache.dtype)
    block_size = kv_cache.shape[2]
    value_blocks(kv_cache)[slot_mapping // block_size, slot_mapping % block_size] = quantize_kv(
        value, v_scale, kv_cache.dtype)


def copy_blocks(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole blocks ``src[i] -> dst[i]`` (K and V) in every layer's cache."""
    for cache in kv_caches:
        if cache.element_size() == 1:   # (the CPU has no index_copy_ for float8: copy bytes)
            cache = cache.view(torch.uint8)
        cache.index_copy_(1, dst, cache.index_select(1, src))


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int):
    """Keys and values of every request's first ``max_len`` positions, read through its block
    table: two tensors ``(batch, max_len, num_kv_heads, head_dim)`` (positions past a request's
    length hold whatever its table points at and must be masked by the caller)."""
    num_blocks = -(-max_len // kv_cache.shape[2])
    ids = block_tables[:, :num_blocks].reshape(-1).long()
    return gather_blocks(kv_cache, ids, block_tables.shape[0], max_len)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, batch: int, max_len: int):
    """``gather_context`` from the flattened ``(batch * num_blocks,)`` int64 block ids."""
    # index_select copies whole blocks; advanced indexing ran 4x slower on the CPU.
    k, v = (blocks.index_select(0, block_ids).reshape(batch, -1, *kv_cache.shape[3:])
            for blocks in (kv_cache[0], value_blocks(kv_cache)))
    return k[:, :max_len], v[:, :max_len]


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_seq_len: int | None = None, max_query_len: int | None = None,
                    k_scale: float = 1.0, v_scale: float = 1.0, sliding_window: int = 0,
                    softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of a varlen query batch ``(num_tokens, num_heads, head_dim)`` against
    each request's paged context. GQA: query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``. Returns ``(num_tokens, num_heads, head_dim)`` in the query's dtype.
    ``sliding_window`` (0: none): a query at position p attends to positions (p - window, p] only
    (Mistral's; HF's mask). ``softcap`` (0: none): scores capped as ``sdpa``'s.

    All requests are padded to the longest query and context and computed by one masked
    scaled_dot_product_attention in float32, so the Python work is O(1) whatever the batch.
    Padding reads slots that belong to no one or to other requests: they are masked out, but
    must hold finite numbers (0 * NaN is NaN), so the runner zeroes blocks when it gets them.
    """
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_seq_len = max_seq_len or int(seq_lens.max())
    max_query_len = max_query_len or int(q_lens.max())
    k, v = gather_context(kv_cache, block_tables, max_seq_len)

    # Pad the varlen queries into (batch, max_query_len): row j of request i sits at
    # context position seq_len - q_len + j.
    device = query.device
    j = torch.arange(max_query_len, device=device)
    q_valid = j[None, :] < q_lens[:, None]                                   # (B, Q)
    q_index = (query_start_loc[:-1, None] + j[None, :]).clamp(max=num_tokens - 1)
    q = query[q_index.flatten()].view(batch, max_query_len, num_heads, head_dim)

    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]                        # (B, Q)
    k_pos = torch.arange(max_seq_len, device=device)
    in_context = k_pos[None, :] < seq_lens[:, None]                          # (B, S)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & in_context[:, None, :]
    if sliding_window:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    out = sdpa(q.float().transpose(1, 2), dequantize_kv(k, k_scale, torch.float32).transpose(1, 2),
               dequantize_kv(v, v_scale, torch.float32).transpose(1, 2), allowed[:, None], scale, softcap)
    return out.transpose(1, 2)[q_valid].to(query.dtype)                      # (B, H, Q, D) ->


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
         softcap: float = 0.0) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of ``(..., heads, queries, head_dim)`` against fewer
    KV heads (GQA), with a boolean or additive ``mask``; ``softcap`` (Gemma 2's, 0: none): each
    score ``softcap * tanh(score / softcap)`` before the mask, computed in float32 by hand."""
    if not softcap:   # (enable_gqa where the heads differ; the torch backend's decodes fold GQA into q's rows)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, -3).float(), v.repeat_interleave(group, -3).float()
    s = softcap * torch.tanh(q.float() @ k.transpose(-1, -2) * (scale / softcap))
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return (s.softmax(-1) @ v).to(q.dtype)


# --------------------------------------------------------------------------------------------
# Elementwise ops of the decoder layer (the torch path of pagoda.model.layers; the oracle of
# pagoda.kernels.triton_ops, which has the same functions with the same signatures).


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype | None = None,
             unit_offset: bool = False):
    """RMSNorm over the last dim, as HF computes it: normalise in float32, cast back to the
    input dtype, then multiply by ``weight`` (in the promoted dtype of the two). ``unit_offset``
    (Gemma's): times ``1 + weight`` instead, in float32 before the cast. ``quant_dtype`` (INT8 or
    FP8): that output quantized per token for the W8A8 matmul that takes it (``QuantizedInput``)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return quantized((x * (1.0 + weight.float())).to(dtype), quant_dtype)
    return quantized(x.to(dtype) * weight, quant_dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, quant_dtype: torch.dtype | None = None, unit_offset: bool = False) -> tuple:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's residual add and norm; the
    sum (in the inputs' dtype) is the next residual. The inputs are left unchanged."""
    x = x + residual
    return rms_norm(x, weight, eps, quant_dtype, unit_offset), x


class Rope(NamedTuple):
    """The rotary embedding of a step's new tokens: their positions and the cos/sin table, plus
    the per-head RMSNorm weights applied to q and k first where the model has them (Qwen3; Gemma 3,
    whose norms are of their own kind: ``rms_norm``'s ``unit_offset``)."""
    positions: torch.Tensor                    # (num_tokens,) integer
    cos_sin_cache: torch.Tensor                # (max_position, rotary_dim) float32: cos | sin
    q_norm_weight: torch.Tensor | None = None  # (head_dim,)
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    norm_unit_offset: bool = False


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_dim: int, q_norm_weight: torch.Tensor | None = None,
                     k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, norm_unit_offset: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX) rotary embedding of ``q (tokens, heads * head_dim)`` and
    ``k (tokens, kv_heads * head_dim)`` at ``positions``; ``cos_sin_cache (max_position,
    rotary_dim)`` float32 holds cos in its first half and sin in its second, and turns each head's
    first rotary_dim dimensions (all of them but for Phi-4-mini's partial rotary embedding: the rest
    pass unrotated). Math in float32, results in the inputs' dtype, as new tensors (q and k are
    left unchanged). With ``q_norm_weight`` / ``k_norm_weight`` each head is first RMS-normalised
    (Qwen3; Gemma 3's norm with ``norm_unit_offset``)."""
    if q_norm_weight is not None:
        q = rms_norm(q.unflatten(-1, (-1, head_dim)), q_norm_weight, eps, unit_offset=norm_unit_offset).flatten(-2)
        k = rms_norm(k.unflatten(-1, (-1, head_dim)), k_norm_weight, eps, unit_offset=norm_unit_offset).flatten(-2)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    rotary_dim = cos_sin_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        shape, dtype = x.shape, x.dtype
        heads = x.view(shape[0], -1, head_dim).float()
        x1, x2 = heads[..., :rotary_dim].chunk(2, dim=-1)
        out = heads.clone() if rotary_dim < head_dim else torch.empty_like(heads)
        o1, o2 = out[..., :rotary_dim].chunk(2, dim=-1)
        tmp = torch.empty_like(o1)
        # The same products and sums as x1 * cos - x2 * sin and x2 * cos + x1 * sin (bit for
        # bit), written in place: no temporaries per product and no cat (half the time on CPU).
        torch.mul(x1, cos, out=o1).sub_(torch.mul(x2, sin, out=tmp))
        torch.mul(x2, cos, out=o2).add_(torch.mul(x1, sin, out=tmp))
        return out.to(dtype).view(shape)

    return rotate(q), rotate(k)


def silu_and_mul(x: torch.Tensor, quant_dtype: torch.dtype | None = None):
    """``silu(gate) * up`` of ``x = [gate, up]`` (tokens, 2 * d) -> (tokens, d), in x's dtype
    (``quant_dtype``: then quantized per token, as ``rms_norm``'s)."""
    gate, up = x.chunk(2, dim=-1)
    return quantized(F.silu(gate) * up, quant_dtype)


def gelu_tanh_and_mul(x: torch.Tensor, quant_dtype: torch.dtype | None = None):
    """``gelu(gate) * up`` with GELU's tanh approximation (Gemma's MLP), as ``silu_and_mul``."""
    gate, up = x.chunk(2, dim=-1)
    return quantized(F.gelu(gate, approximate="tanh") * up, quant_dtype)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' routing, as HF's: the ``top_k`` largest of the softmax (in float32)
    over the experts, renormalised to sum to 1 if asked. Returns ``(weights float32, expert ids)``,
    both (tokens, top_k)."""
    weights, ids = router_logits.softmax(-1, dtype=torch.float32).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def moe_align_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks of ``block_m`` pairs any routing of ``num_pairs`` pairs needs."""
    return -(-(num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``p = token * top_k + slot`` grouped by expert (in pair order within one), each
    group padded with ``num_pairs`` (no pair) to a multiple of ``block_m``: ``(pairs
    (num_blocks * block_m,) int32, block_experts (num_blocks,))``, the expert of each block of
    block_m (``num_experts`` past the last group). Pairs of expert -1 (another rank's) are in no
    group. Sizes depend on the number of pairs alone; device ops only (no host sync: CUDA graphs)."""
    flat = topk_ids.flatten().long()
    n = flat.numel()
    flat = torch.where(flat < 0, num_experts, flat)      # another rank's experts: a last bin, left out
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, flat,
                                                                                              torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = flat.argsort(stable=True)
    expert = flat[order]
    rank = torch.arange(n, device=flat.device) - (counts.cumsum(0) - counts)[expert]   # within its expert's group
    num_blocks = moe_align_blocks(n, num_experts, block_m)
    # (one slot more, where the left-out pairs go: a boolean mask would sync with the host)
    pairs = torch.full((num_blocks * block_m + 1,), n, dtype=torch.int32, device=flat.device)
    dest = torch.where(expert < num_experts, (ends - padded)[expert] + rank, num_blocks * block_m)
    pairs[dest] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=flat.device) * block_m
    return pairs[:-1], torch.searchsorted(ends[:num_experts], starts, right=True).to(torch.int32)


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    """``weight (N, K) * scale`` of each ``block`` (bn, bk) of it (block-wise FP8: ``scale
    (ceil(N / bn), ceil(K / bk))``), in ``dtype``, rounded once from float32."""
    n, k = weight.shape
    full = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight.float() * full).to(dtype)


@dataclass(frozen=True)
class Int4Experts:
    """A mixture of experts' stacked GPTQ / AWQ / GGUF weight (w13 or w2) in ``quant.int4``'s
    layout, an expert a row: ``qweight (E, K / pack, N)`` int32, ``scales`` / ``zeros (E, groups,
    N)``; ``g_idx (E, halves, K)``, each input's group for each half of the N columns (act-order:
    w13's gate and up rows have their own), or None: groups of ``group_size`` inputs in order.
    ``int_zeros`` off: zero points with fractions (GGUF's types with a minimum)."""
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int
    group_size: int
    int_zeros: bool = True

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K), as a dense stacked weight's."""
        e, words, n = self.qweight.shape
        return e, n, words * 32 // self.bits

    def dense(self, e: int) -> torch.Tensor:
        """Expert ``e``'s weight ``(N, K)`` in the scales' dtype (``int4.dequantize``'s values)."""
        from pagoda.quant.int4 import dequantize
        _, n, k = self.shape
        g_idx = (torch.arange(k, device=self.scales.device) // self.group_size)[None] if self.g_idx is None \
            else self.g_idx[e]
        cols = n // g_idx.shape[0]
        halves = [slice(h * cols, (h + 1) * cols) for h in range(g_idx.shape[0])]
        return torch.cat([dequantize(self.qweight[e, :, c], self.scales[e, :, c], self.zeros[e, :, c], g, self.bits)
                          for c, g in zip(halves, g_idx)], 1).t()


def fused_moe(x: torch.Tensor, w13: torch.Tensor | Int4Experts, w2: torch.Tensor | Int4Experts,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None,
              scales: tuple | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for every token, an expert
    being ``w2[e] @ silu_and_mul(w13[e] @ x)``; expert by expert over the tokens that chose it,
    each output weighted in x's dtype and summed in it (HF's order). With ``expert_map`` (expert
    parallelism: a global expert id's index in w13 / w2, -1 for another rank's expert), the sum
    over this rank's experts alone. ``scales = ((w13_scale, block), (w2_scale, block))``: FP8
    experts with a scale per block of each (``dequantize_blocks``; a block of one row by the whole
    input for a scale a row). GPTQ / AWQ experts come as ``Int4Experts``."""
    if expert_map is not None:
        topk_ids = expert_map[topk_ids]
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        if e < 0:
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if isinstance(w13, Int4Experts):
            w13e, w2e = w13.dense(e).to(x.dtype), w2.dense(e).to(x.dtype)
        else:
            w13e, w2e = w13[e], w2[e]
        if scales is not None:
            (s13, b13), (s2, b2) = scales
            w13e, w2e = dequantize_blocks(w13e, s13[e], b13, x.dtype), dequantize_blocks(w2e, s2[e], b2, x.dtype)
        y = F.linear(silu_and_mul(F.linear(x[tokens], w13e)), w2e)
        out.index_add_(0, tokens, y * topk_weights[tokens, slots, None].to(x.dtype))
    return out


FP8_MAX = 448.0   # E4M3's largest finite value


INT8_MAX = 127.0  # (symmetric: -128 is never used)


class QuantizedInput(NamedTuple):
    """A W8A8 matmul's input, its rows quantized per token (``per_token_quant``) by the kernel
    that computed them (the RMSNorm or SiLU-and-mul before the matmul: one pass over the rows
    fewer): ``q (M, K)`` INT8 or FP8, ``scale (M, 1)`` float32, and ``dtype``, the rows' own
    (the matmul's output's)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantized(x: torch.Tensor, dtype: torch.dtype | None):
    """``x``, or (``dtype`` given) its rows quantized per token as a ``QuantizedInput``."""
    return x if dtype is None else QuantizedInput(*per_token_quant(x, dtype), x.dtype)


def per_token_quant(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x (M, K)`` as FP8 E4M3 or INT8 over its own float32 scale ``(M, 1)``, its
    largest magnitude / 448 (or 127) (dynamic per-token activation quantization, W8A8's). INT8
    rounds half away from zero."""
    top = INT8_MAX if dtype == torch.int8 else FP8_MAX
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / torch.full_like(amax, top)   # (tensor divisors: exact on every device)
    v = (xf / scale).clamp(-top, top)
    if dtype == torch.int8:
        v = v.sign() * (v.abs() + 0.5).floor()
    return v.to(dtype), scale


def scaled_mm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``(x_q * x_scale) @ (w_q * w_scale).T + bias`` in float32, rounded once: what an 8-bit
    tensor-core matmul with a scale per row of x ``(M, 1)`` and of w ``(N, 1)`` computes."""
    out = (x_q.float() @ w_q.float().t()) * x_scale * w_scale.reshape(1, -1)
    return (out if bias is None else out + bias.float()).to(out_dtype)


def lora_expand(xa: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor, width: int,
                out: torch.Tensor) -> torch.Tensor:
    """LoRA's second matmul for a batch of tokens of different adapters (lora/layers.py):
    ``out += xa' @ b.T`` in place, where ``xa'`` is ``xa`` (tokens, slots * width) with each
    token's row kept only in its own slot's ``width`` columns (``token_slots[t]``; -1: none).
    ``b``: (out features, slots * width)."""
    cols = torch.arange(xa.shape[1], device=xa.device) // width
    return out.addmm_(xa * (token_slots[:, None] == cols).to(xa.dtype), b.t())


def float_key(x: torch.Tensor) -> torch.Tensor:
    """The order-preserving int32 image of float32 values (-0.0 as +0.0): thresholds on logits
    are thresholds on these keys."""
    b = (x.float() + 0.0).view(torch.int32)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


def sampling_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The tokens each row's filters keep (bool, like ``logits``), as ``sample_triton`` decides
    them, in float64: min-p keeps the tokens whose probability is at least min_p times the
    max's; top-k (0 or >= vocab: off) the tokens at or above the k-th largest logit; top-p (1:
    off), over what those two keep, the tokens at or above the smallest logit whose strictly
    larger kept tokens hold less than top_p of the kept mass. Thresholds keep every token tied
    with the boundary (the sorted torch path keeps ties in sort order instead)."""
    x = logits.float()
    key = float_key(x).long()
    vocab = x.shape[-1]
    probs = (x.double() / temperature.double().clamp(min=1e-30)[:, None]).softmax(-1)
    keep = probs >= probs.amax(-1, keepdim=True) * min_p.double()[:, None]
    kth = key.sort(-1, descending=True).values.gather(-1, (top_k.long().clamp(1, vocab) - 1)[:, None])
    keep &= (key >= kth) | ((top_k <= 0) | (top_k >= vocab))[:, None]
    mass = probs * keep
    asc, order = key.sort(-1)
    at_or_below = mass.gather(-1, order).cumsum(-1).gather(-1, torch.searchsorted(asc, key, right=True) - 1)
    total = mass.sum(-1, keepdim=True)
    cut = torch.where(keep & (total - at_or_below < top_p.double()[:, None] * total), key, 2**40).amin(-1)
    return keep & ((key >= cut[:, None]) | (top_p >= 1)[:, None])


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Gumbel-max sampling given the noise (the oracle of ``triton_sampling.sample_triton`` for
    rows without filters): ``argmax(logits / temperature + noise)`` per row, the plain argmax
    where ``temperature`` is 0."""
    x = logits.float()
    noisy = (x / temperature.clamp(min=1e-30)[:, None] + noise).argmax(-1)
    return torch.where(temperature > 0, noisy, x.argmax(-1))


def inverse_cdf_sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                       keep: torch.Tensor | None = None) -> torch.Tensor:
    """Sampling by inverting the CDF of ``softmax(logits / temperature)`` (restricted to
    ``keep``, e.g. a ``sampling_mask``) at ``u * total`` per row (float64), the first index
    whose cumulative mass passes it; the plain argmax where ``temperature`` is 0. The oracle of
    ``triton_sampling.sample_triton``, given its uniforms."""
    x = logits.double()
    probs = (x / temperature.double().clamp(min=1e-30)[:, None]).softmax(-1)
    if keep is not None:
        probs = probs * keep
    cdf = probs.cumsum(-1)
    drawn = torch.searchsorted(cdf, (u.double() * cdf[:, -1])[:, None], right=True).squeeze(-1)
    return torch.where(temperature > 0, drawn.clamp(max=x.shape[-1] - 1), x.argmax(-1))
