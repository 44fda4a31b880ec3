"""Per-request block tables on top of the block pool, and the prefix cache.

A full block is named by a hash chain: hash(parent block's hash, its token ids, extra keys: the
prompt's cache_salt and LoRA adapter), so equal hashes mean equal prefixes, not just equal
blocks. SHA-256 makes a collision (two prefixes taking each other's KV) practically impossible. A request admitted with a cached
prefix shares those blocks by reference count and computes only the rest.
"""
import hashlib
from dataclasses import dataclass

import numpy as np

from pagoda.core.block_pool import BlockPool, KVCacheBlock
from pagoda.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block_tokens(parent_hash: bytes | None, token_ids, extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent_hash or b"")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


@dataclass
class PrefixHit:
    """KV a request can start from instead of computing it: ``blocks`` to share as they are,
    and optionally a partly filled block to copy (a fork of a running request, whose last
    shared block it will write into)."""
    blocks: list[KVCacheBlock]
    num_tokens: int
    copy_src: KVCacheBlock | None = None
    forked: bool = False


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Every layer's window (Mistral-7B-v0.1's, Phi-3-mini-4k's; 0: none, or not every layer
        # has it): a request's blocks wholly before its next query's window are given back.
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        # (src, dst) block copies the runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the request's full blocks of known tokens, extended as it grows."""
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            extra = ()
            if i == 0:     # (the chain carries them to every later block)
                extra = tuple(k for k in (request.cache_salt, request.lora_id and ("lora", request.lora_id)) if k)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            request.all_token_ids[i * bs:(i + 1) * bs], extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest chain of cached blocks the request starts with. At least its last token
        is left to compute: the model must run on it to sample the next one."""
        if not self.enable_caching or request.skip_prefix_cache:
            return PrefixHit([], 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        cached = [self.pool.get_cached_block(h) for h in self.block_hashes(request)[:max_blocks]]
        if self.sliding_window:
            return self._window_hit(cached)
        hit = []
        for block in cached:
            if block is None:
                break
            hit.append(block)
        return PrefixHit(hit, len(hit) * self.block_size)

    def _window_hit(self, cached: list[KVCacheBlock | None]) -> PrefixHit:
        """With a sliding window a prefix of k blocks needs only the blocks the next query's window
        reaches: the longest k whose window blocks are all cached wins, the blocks before them
        (evicted or not) the null block. (A block's hash names its whole prefix, so a cached block
        past an evicted one is still this request's.)"""
        bs, best, run = self.block_size, 0, 0
        for i, block in enumerate(cached):
            run = run + 1 if block is not None else 0
            if run and i + 1 - run <= max(0, (i + 1) * bs - self.sliding_window + 1) // bs:
                best = i + 1
        first = max(0, best * bs - self.sliding_window + 1) // bs
        return PrefixHit([self.pool.null_block] * first + cached[first:best], best * bs)

    def fork_blocks(self, parent: Request, num_tokens: int) -> PrefixHit | None:
        """Start from the first ``num_tokens`` of a running request's KV: share its blocks
        that lie wholly inside, copy the one that does not (the child writes into it). None if
        the parent has given back blocks the child's window needs (a sliding window)."""
        blocks, bs = self.req_to_blocks[parent.request_id], self.block_size
        if self.sliding_window:
            needed = blocks[max(0, num_tokens - self.sliding_window + 1) // bs:cdiv(num_tokens, bs)]
            if any(b is self.pool.null_block for b in needed):
                return None
        copy_src = blocks[num_tokens // bs] if num_tokens % bs else None
        return PrefixHit(blocks[:num_tokens // bs], num_tokens, copy_src, forked=True)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Index the request's blocks that are full once ``num_tokens`` are computed. They are
        indexed before the step that fills them runs: a request that hits one in the same step
        reads it in the same forward, after every layer has written its new K/V."""
        start, end = self.num_cached_blocks.get(request.request_id, 0), num_tokens // self.block_size
        if end <= start:
            return
        # With async scheduling a block can be full of tokens one of which is still on the
        # device: no hash for it yet, so it is indexed on a later call.
        end = min(end, len(self.block_hashes(request)))
        for i in range(start, end):
            if blocks[i] is not self.pool.null_block:    # (not given back before its hash was known)
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = end

    # ------------------------------------------------------------------ block tables
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       num_lookahead: int = 0) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of KV after the request's computed ones
        (and after ``hit``, a prefix it takes over at admission), and ``num_lookahead`` slots
        after them (a draft model's). Returns the ids of the blocks added to its table (possibly
        none), or None when the pool is too short, in which case nothing changed."""
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        elif hit is None:
            if self.sliding_window:
                self._free_outside_window(blocks, request.num_computed_tokens)
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead <= len(blocks) * self.block_size and (
                    not self.enable_caching or end // self.block_size <= self.num_cached_blocks.get(request.request_id, 0)):
                return []          # most decode steps: room in the last block, no block filled
        shared = hit.blocks if hit else []
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        needed = cdiv(num_computed + num_new_tokens + num_lookahead, self.block_size) - len(blocks) - len(shared)
        revived = sum(b.ref_cnt == 0 for b in shared)      # cached blocks now in the free queue
        if needed + revived > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(shared)
        new_blocks = self.pool.get_new_blocks(needed) if needed > 0 else []
        if hit and hit.copy_src is not None:
            self.pending_copies.append((hit.copy_src.block_id, new_blocks[0].block_id))
        blocks += shared + new_blocks
        if self.enable_caching and not request.skip_prefix_cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        if self.sliding_window and shared:     # (a long prefix taken over: its front is not needed)
            self._free_outside_window(blocks, num_computed)
        return [b.block_id for b in blocks[len(blocks) - len(shared) - len(new_blocks):]]

    def _free_outside_window(self, blocks: list[KVCacheBlock], num_computed: int) -> None:
        """Give back the blocks no query from position ``num_computed`` on can see (its window
        starts at num_computed - window + 1), the null block taking their places in the table:
        the attention never reads a block before a query's window (the Triton kernels skip its
        tiles, the torch path masks what it gathers). A full block keeps its hash, so a later
        request with the same prefix may still find it until it is evicted."""
        end = max(0, num_computed - self.sliding_window + 1) // self.block_size
        null = self.pool.null_block
        if end == 0 or blocks[end - 1] is null:     # (given back from the front: nothing new)
            return
        gone = [b for b in blocks[:end] if b is not null]
        blocks[:end] = [null] * end
        self.pool.free_blocks(reversed(gone))

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def get_block_ids(self, request: Request) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request.request_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
