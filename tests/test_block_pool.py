"""Property-based tests of the block pool and the KV cache manager: random allocate / append /
free / preempt sequences keep the pool's invariants."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_cache_manager import KVCacheManager, cdiv
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)), "a block is twice in the free list"
    held: dict[int, int] = {}
    for blocks in kv.req_to_blocks.values():
        for b in blocks:
            held[b.block_id] = held.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held.get(b.block_id, 0), f"ref count of {b} != holders"
        assert (b.ref_cnt == 0) == (b.block_id in set(free_ids)), f"{b} free-ness disagrees"
    assert 0 not in free_ids and pool.null_block.ref_cnt == 1
    assert len(free_ids) + len(held) == pool.num_usable_blocks, "a block leaked"


def make_request(i: int, n: int) -> Request:
    return Request(str(i), list(range(n)), SamplingParams(), eos_token_id=None, max_tokens=1000)


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt"]),
                         st.integers(0, 7), st.integers(1, 70)), max_size=80)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 4, 16]), ops=ops)
def test_random_allocation_sequences_keep_invariants(num_blocks, block_size, ops):
    kv = KVCacheManager(num_blocks, block_size)
    live: dict[int, Request] = {}
    for op, i, n in ops:
        req = live.get(i)
        if op == "add" and req is None:
            req = make_request(i, n)
            before = kv.num_free_blocks
            got = kv.allocate_slots(req, n)
            if got is None:
                assert kv.num_free_blocks == before, "a failed allocation must allocate nothing"
                kv.req_to_blocks.pop(req.request_id, None)
            else:
                assert len(got) == cdiv(n, block_size)
                req.num_computed_tokens = n
                live[i] = req
        elif op == "grow" and req is not None:
            got = kv.allocate_slots(req, n)
            if got is not None:
                req.num_computed_tokens += n
                assert len(kv.req_to_blocks[req.request_id]) == cdiv(req.num_computed_tokens, block_size)
        elif op in ("free", "preempt") and req is not None:
            kv.free(req)
            del live[i]
        check_invariants(kv)
    for req in live.values():
        kv.free(req)
    check_invariants(kv)
    assert kv.num_free_blocks == num_blocks - 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=30))
def test_shared_blocks_return_to_pool_only_when_last_reference_drops(counts):
    pool = BlockPool(40)
    blocks = pool.get_new_blocks(min(len(counts), 39))
    for b, c in zip(blocks, counts):
        pool.touch([b] * (c - 1))
    for b, c in zip(blocks, counts):
        for k in range(c):
            assert b not in pool.free_queue
            pool.free_blocks([b])
        assert b.ref_cnt == 0 and b in pool.free_queue
    assert pool.num_free_blocks == 39


def test_pool_rejects_over_allocation_and_double_free():
    import pytest
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="only 3 are free"):
        pool.get_new_blocks(4)
    b = pool.get_new_blocks(1)
    pool.free_blocks(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks(b)
