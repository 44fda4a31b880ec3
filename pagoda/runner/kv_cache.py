"""The KV cache's tensors and which layer writes where. A model's layers are split into KV cache
groups (config.KVCacheGroup), each following its own block table; layer j of every group keeps
its KV in the j-th tensor, so a block id names the same place in all of them, a block's worth
of tokens for as many layers as the largest group has. With one group (most models) that is a
tensor a layer."""
import torch

from pagoda.config import KVCacheGroup


def layer_slots(model, groups: tuple[KVCacheGroup, ...]) -> list[tuple[int, int]]:
    """(group, cache tensor) of each of the model's layers on this rank (its pipeline stage's)."""
    where = {layer: (g, j) for g, group in enumerate(groups) for j, layer in enumerate(group.layers)}
    return [where[i] for i in range(model.model.start_layer, model.model.end_layer)]


def kv_bytes_per_block(model, groups: tuple[KVCacheGroup, ...], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block over the cache tensors this rank's layers use."""
    attn = model.model.local_layers[0].self_attn.attn
    num_tensors = len({j for _, j in layer_slots(model, groups)})
    return 2 * num_tensors * block_size * attn.num_kv_heads * attn.head_dim * dtype.itemsize


def bind_kv_caches(model, groups: tuple[KVCacheGroup, ...], num_blocks: int, block_size: int, dtype: torch.dtype,
                   device) -> list[torch.Tensor]:
    """The cache tensors, (2, num_blocks, block_size, kv heads, head dim) each, given to the
    layers that use them, with each layer's group. Uninitialised (so untouched pages of a large
    CPU cache are never committed) but for the null block, which padding reads; the runner
    zeroes blocks as it hands them out where the backend needs it."""
    caches: dict[int, torch.Tensor] = {}
    for layer, (g, j) in zip(model.model.local_layers, layer_slots(model, groups)):
        attn = layer.self_attn.attn
        if j not in caches:
            caches[j] = torch.empty((2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim), dtype=dtype,
                                    device=device)
            caches[j][:, 0] = 0.0
        attn.kv_cache, attn.kv_group = caches[j], g
    return list(caches.values())
