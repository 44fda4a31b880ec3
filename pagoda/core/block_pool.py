"""The pool of physical KV cache blocks: reference counts and a free list.

Block 0 is the null block: never handed out, so padded batch entries (CUDA graphs) can point
their block tables and slots at it without touching a live request's cache.
"""
from collections import deque


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"The KV cache needs at least 2 blocks (one is reserved), got {num_blocks}.")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # permanently held
        self.free_queue: deque[KVCacheBlock] = deque(self.blocks[1:])

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"Cannot allocate {n} blocks: only {len(self.free_queue)} are free.")
        blocks = [self.free_queue.popleft() for _ in range(n)]
        for b in blocks:
            assert b.ref_cnt == 0, b
            b.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take one more reference on blocks that are already in use (sharing)."""
        for b in blocks:
            assert b.ref_cnt > 0, f"touching free block {b}"
            b.ref_cnt += 1

    def free_blocks(self, blocks) -> None:
        """Drop one reference on each block; a block whose count reaches 0 goes back to the free
        list. Callers pass a request's blocks tail first, so the least useful blocks are reused
        first once blocks are kept for prefix caching."""
        for b in blocks:
            assert b.ref_cnt > 0, f"double free of {b}"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue.append(b)

    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_usable_blocks
