"""Per-request block tables on top of the block pool, and the prefix cache.

A full block is named by a hash chain: hash(parent block's hash, its token ids, extra keys: the
prompt's cache_salt and LoRA adapter), so equal hashes mean equal prefixes, not just equal
blocks. SHA-256 makes a collision (two prefixes taking each other's KV) practically impossible. A request admitted with a cached
prefix shares those blocks by reference count and computes only the rest.

A request has a block table per KV cache group (config.KVCacheGroup: one for most models; Gemma
2/3's full and sliding layers apart), all drawn from one pool and all as long as its tokens need;
a group with a sliding window gives back the blocks its next query's window has left (the null
block takes their place). A block is indexed by (group, hash): a prefix hit is as long as every
group can serve, the full groups' whole prefix and the sliding groups' last window of it.
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


def max_blocks_per_request(windows: tuple[int, ...], block_size: int, num_tokens: int, max_step_tokens: int) -> int:
    """The most blocks one request of ``num_tokens`` holds at once in groups of these windows, if
    its steps compute at most ``max_step_tokens`` each: a full group all its blocks, a sliding
    group its window and a step's."""
    full = cdiv(num_tokens, block_size)
    return sum(min(full, cdiv(w + max_step_tokens, block_size) + 1) if w else full for w in windows)


@dataclass
class PrefixHit:
    """KV a request can start from instead of computing it: ``blocks`` to share as they are (a
    list per group), and optionally partly filled blocks to copy (a fork of a running request,
    whose last shared block it will write into; one a group)."""
    blocks: list[list[KVCacheBlock]]
    num_tokens: int
    copy_src: list[KVCacheBlock] | None = None
    forked: bool = False


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, windows: tuple[int, ...] = (0,)):
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Each group's sliding window (0: none): a request's blocks of the group wholly before
        # its next query's window are given back.
        self.windows = tuple(windows)
        # The sliding groups by window: groups of one window give blocks back in step (their
        # tables' null blocks reach equally far), so one of them tells whether any has some to.
        self.sliding_groups = [(w, [g for g, x in enumerate(self.windows) if x == w]) for w in sorted(set(windows)) if w]
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}     # a table per group
        # How many leading blocks of each request are already in the prefix-cache index.
        self.num_cached_blocks: dict[str, int] = {}
        # (src, dst) block copies the runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []

    def _window_start(self, num_tokens: int, window: int) -> int:
        """The first block a query at position ``num_tokens`` reads with ``window`` (0: none)."""
        return max(0, num_tokens - window + 1) // self.block_size if window else 0

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
        """The longest prefix of cached blocks the request can start from: k blocks if every
        group has those of them its next query reads (a full group all k, a sliding group those
        in the window of position k x block_size; the blocks before it are the null block). A
        block's hash names its whole prefix, so a cached block past an evicted one is still this
        request's. At least its last token is left to compute: the model must run on it to
        sample the next one."""
        if not self.enable_caching or request.skip_prefix_cache:
            return PrefixHit([[] for _ in self.windows], 0)
        hashes = self.block_hashes(request)[:(request.num_tokens - 1) // self.block_size]
        cached = self.pool.get_cached_block
        k = len(hashes)
        for g, window in enumerate(self.windows):     # a full group: its run from the start
            if not window:
                k = next((i for i in range(k) if cached((g, hashes[i])) is None), k)
        # A sliding group's block i missing from the window of k: no k' past i serves (their
        # windows start no later), so try k = i; looked up from the window's end, a miss ends
        # the search sooner.
        while k:
            first = [self._window_start(k * self.block_size, w) for w in self.windows]
            missing = next((i for g, w in enumerate(self.windows) if w
                            for i in range(k - 1, first[g] - 1, -1) if cached((g, hashes[i])) is None), None)
            if missing is None:
                break
            k = missing
        tables = []
        for g, window in enumerate(self.windows):
            first = self._window_start(k * self.block_size, window)
            tables.append([self.pool.null_block] * first + [cached((g, h)) for h in hashes[first:k]])
        return PrefixHit(tables, k * self.block_size)

    def fork_blocks(self, parent: Request, num_tokens: int) -> PrefixHit | None:
        """Start from the first ``num_tokens`` of a running request's KV: share its blocks
        that lie wholly inside, copy the one that does not (the child writes into it). None if
        the parent has given back blocks the child's window needs (a sliding window)."""
        tables, bs = self.req_to_blocks[parent.request_id], self.block_size
        for window, blocks in zip(self.windows, tables):
            if any(b is self.pool.null_block for b in blocks[self._window_start(num_tokens, window):cdiv(num_tokens, bs)]):
                return None
        copy_src = [blocks[num_tokens // bs] for blocks in tables] if num_tokens % bs else None
        return PrefixHit([blocks[:num_tokens // bs] for blocks in tables], num_tokens, copy_src, forked=True)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, tables: list[list[KVCacheBlock]], num_tokens: int) -> None:
        """Index the request's blocks that are full once ``num_tokens`` are computed. They are
        indexed before the step that fills them runs: a request that hits one in the same step
        reads it in the same forward, after every layer has written its new K/V."""
        start, end = self.num_cached_blocks.get(request.request_id, 0), num_tokens // self.block_size
        if end <= start:
            return
        # With async scheduling a block can be full of tokens one of which is still on the
        # device: no hash for it yet, so it is indexed on a later call.
        end = min(end, len(self.block_hashes(request)))
        for g, blocks in enumerate(tables):
            for i in range(start, end):
                if blocks[i] is not self.pool.null_block:    # (not given back before its hash was known)
                    self.pool.cache_block(blocks[i], (g, request.block_hashes[i]))
        self.num_cached_blocks[request.request_id] = end

    # ------------------------------------------------------------------ block tables
    def allocate_slots(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None,
                       num_lookahead: int = 0) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` more tokens of KV after the request's computed ones
        (and after ``hit``, a prefix it takes over at admission), and ``num_lookahead`` slots
        after them (a draft model's). Returns the ids of the blocks added to each group's table
        (an empty tuple when none were), or None when the pool is too short, in which case
        nothing changed."""
        tables = self.req_to_blocks.get(request.request_id)
        if tables is None:
            tables = self.req_to_blocks[request.request_id] = [[] for _ in self.windows]
        elif hit is None:
            if self.sliding_groups:     # (every request, every step: no call where no group slides)
                self._free_outside_windows(tables, request.num_computed_tokens)
            end = request.num_computed_tokens + num_new_tokens
            if end + num_lookahead <= len(tables[0]) * self.block_size and (
                    not self.enable_caching or end // self.block_size <= self.num_cached_blocks.get(request.request_id, 0)):
                return ()          # most decode steps: room in the last block, no block filled
        shared = hit.blocks if hit else [[] for _ in self.windows]
        num_computed = request.num_computed_tokens + (hit.num_tokens if hit else 0)
        needed = cdiv(num_computed + num_new_tokens + num_lookahead, self.block_size) - len(tables[0]) - len(shared[0])
        revived = sum(b.ref_cnt == 0 for blocks in shared for b in blocks)      # cached blocks now in the free queue
        if max(needed, 0) * len(tables) + revived > self.pool.num_free_blocks:
            if not tables[0]:
                del self.req_to_blocks[request.request_id]
            return None
        added = []
        for g, blocks in enumerate(tables):
            self.pool.touch(shared[g])
            new_blocks = self.pool.get_new_blocks(needed) if needed > 0 else []
            if hit and hit.copy_src is not None:
                self.pending_copies.append((hit.copy_src[g].block_id, new_blocks[0].block_id))
            blocks += shared[g] + new_blocks
            added.append([b.block_id for b in blocks[len(blocks) - len(shared[g]) - len(new_blocks):]])
        if self.enable_caching and not request.skip_prefix_cache:
            self._cache_full_blocks(request, tables, num_computed + num_new_tokens)
        if hit:      # (a long prefix taken over: its front is not needed)
            self._free_outside_windows(tables, num_computed)
        return tuple(added)

    def _free_outside_windows(self, tables: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Give back the blocks of the sliding groups that no query from position
        ``num_computed`` on can see (its window starts at num_computed - window + 1), the null
        block taking their places in the table: the attention never reads a block before a
        query's window (the Triton kernels skip its tiles, the torch path masks what it
        gathers). A full block keeps its hash, so a later request with the same prefix may
        still find it until it is evicted."""
        null = self.pool.null_block
        for window, groups in self.sliding_groups:
            end = self._window_start(num_computed, window)
            if end == 0 or tables[groups[0]][end - 1] is null:     # (given back from the front: nothing new)
                continue
            for g in groups:
                gone = [b for b in tables[g][:end] if b is not null]
                tables[g][:end] = [null] * end
                self.pool.free_blocks(reversed(gone))

    def free(self, request: Request) -> None:
        """Give back all the request's blocks, the tails of its tables first (a prefix's tail is
        the part least likely to be shared: it is evicted first)."""
        tables = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(b for row in zip(*map(reversed, tables)) for b in row)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def get_block_ids(self, request: Request) -> list[list[int]]:
        """The request's block table of each group."""
        tables = self.req_to_blocks.get(request.request_id) or [[] for _ in self.windows]
        return [[b.block_id for b in blocks] for blocks in tables]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks
