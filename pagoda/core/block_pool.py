"""The pool of physical KV cache blocks: reference counts, a free queue, and the prefix-cache
index of full blocks by content hash (the manager's key: its KV cache group and the hash).

Block 0 is the null block: never handed out, so padded batch entries (CUDA graphs) can point
their block tables and slots at it without touching a live request's cache.

A full block keeps its hash after its last user frees it: it waits in the free queue, where a
later request with the same prefix can take it back (a cache hit), until it is the least
recently freed one and a new allocation evicts it.
"""
from collections import OrderedDict


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None        # its key in the index, while it is there

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks (one is reserved), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently held
        # Unreferenced blocks in eviction order (least recently freed first). An OrderedDict
        # so a cache hit can take a block out of the middle in O(1).
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached_blocks: dict[object, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: the never-used and the cached-but-unreferenced ones."""
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"Cannot allocate {n} blocks: only {len(self.free_queue)} are free.")
        blocks = [self.free_queue.popitem(last=False)[1] for _ in range(n)]
        for b in blocks:
            assert b.ref_cnt == 0, b
            if b.block_hash is not None:        # evict: its contents are about to be overwritten
                del self.cached_blocks[b.block_hash]
                b.block_hash = None
            b.ref_cnt = 1
        return blocks

    def touch(self, blocks) -> None:
        """Take one more reference on each block: sharing a live block, or reviving a cached
        one from the free queue."""
        for b in blocks:
            if b is self.null_block:      # (in a table in place of a block given back: a sliding window)
                continue
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference on each block; a block whose count reaches 0 joins the end of the
        free queue. Callers pass a request's blocks tail first: a prefix's tail is the part
        least likely to be shared, so it is evicted first."""
        for b in blocks:
            if b is self.null_block:
                continue
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    # ------------------------------------------------------------------ prefix cache
    def get_cached_block(self, block_hash) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash) -> None:
        """Index a block that is (or is being) filled with the tokens ``block_hash`` names. When
        another block already holds the same tokens, that one stays the index entry."""
        if block.block_hash is None and block_hash not in self.cached_blocks:
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use, as in vLLM."""
        if len(self.free_queue) != self.num_usable_blocks:
            return False
        self.forget_cached_blocks()
        return True

    def forget_cached_blocks(self) -> None:
        """Drop the whole index, in use or not: after a failed step, the blocks it was meant to
        fill may hold garbage."""
        for b in self.cached_blocks.values():
            b.block_hash = None
        self.cached_blocks.clear()
