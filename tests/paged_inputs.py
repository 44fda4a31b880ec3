"""Random paged-attention inputs shared by the attention tests."""
import torch


def random_block_tables(seq_lens, block_size, gen, spare_blocks, spare_cols, first_block=0):
    """Block tables for requests of these context lengths: each request gets distinct physical
    blocks (from ``first_block`` on) in random order, and unused entries point at random blocks,
    so padding that leaks into a result shows. Returns (tables, number of blocks in the cache)."""
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + spare_blocks
    perm = torch.randperm(num_blocks - first_block, generator=gen) + first_block
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(blocks) + spare_cols), generator=gen)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start:start + n]
        start += n
    return tables, num_blocks
