"""Torch reference kernels: the CPU path and the oracle every Triton kernel is tested against.

KV cache layout, per layer: ``kv_cache[0]`` holds keys and ``kv_cache[1]`` values, each
``(num_blocks, block_size, num_kv_heads, head_dim)``. A token at position ``pos`` of a request
lives in slot ``block_table[pos // block_size] * block_size + pos % block_size``.

A batch is "varlen": the scheduled query tokens of all requests are concatenated;
request ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]`` of ``query``, and those rows
are the *last* positions of its ``seq_lens[i]`` context tokens (the ones before them are already
in the cache). Decode is the case of one query token; prefill and chunked prefill are longer.
"""
import torch


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V ``(num_tokens, num_kv_heads, head_dim)`` into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slot_mapping] = key.to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slot_mapping] = value.to(kv_cache.dtype)


def gather_context(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int):
    """Keys and values of every request's first ``max_len`` positions, read through its block
    table: two tensors ``(batch, max_len, num_kv_heads, head_dim)`` (positions past a request's
    length hold whatever its table points at and must be masked by the caller)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_len // block_size)
    tables = block_tables[:, :num_blocks].long()
    k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]
    v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]
    return k, v


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_seq_len: int | None = None, max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of a varlen query batch ``(num_tokens, num_heads, head_dim)`` against
    each request's paged context. GQA: query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``. Returns ``(num_tokens, num_heads, head_dim)`` in the query's dtype.

    All requests are padded to the longest query and context and computed in one batched
    softmax in float32, so the Python work is O(1) per call whatever the batch holds.
    """
    num_tokens, num_heads, head_dim = query.shape
    batch = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_seq_len = max_seq_len or int(seq_lens.max())
    max_query_len = max_query_len or int(q_lens.max())
    k, v = gather_context(kv_cache, block_tables, max_seq_len)
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads

    # Pad the varlen queries into (batch, max_query_len): row j of request i sits at
    # context position seq_len - q_len + j.
    device = query.device
    j = torch.arange(max_query_len, device=device)
    q_valid = j[None, :] < q_lens[:, None]                                   # (B, Q)
    q_index = (query_start_loc[:-1, None] + j[None, :]).clamp(max=num_tokens - 1)
    q = query[q_index.flatten()].view(batch, max_query_len, num_kv_heads, group, head_dim)

    q_pos = (seq_lens - q_lens)[:, None] + j[None, :]                        # (B, Q)
    k_pos = torch.arange(max_seq_len, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]                      # causal, and
    allowed &= k_pos[None, None, :] < seq_lens[:, None, None]                # inside context

    scores = torch.einsum("bqkgd,bskd->bkgqs", q.float(), k.float()) * scale
    scores.masked_fill_(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)   # fully masked padded rows -> 0
    # Slots past a request's length may hold garbage (even NaN): zero them, as 0 * NaN = NaN.
    v = v.float().masked_fill_((k_pos[None, :] >= seq_lens[:, None])[:, :, None, None], 0.0)
    out = torch.einsum("bkgqs,bskd->bqkgd", probs, v)
    out = out.reshape(batch, max_query_len, num_heads, head_dim)[q_valid]
    return out.to(query.dtype)
