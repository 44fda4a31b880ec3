"""Property-based tests of the block pool and the KV cache manager: random allocate / append /
free / preempt / fork / prefix-hit / reset sequences keep the pool's invariants, and every
request reads back exactly its own tokens."""
from hypothesis import given, settings
from hypothesis import strategies as st

from pagoda.core.block_pool import BlockPool
from pagoda.core.kv_cache_manager import KVCacheManager, PrefixHit, cdiv, max_blocks_per_request
from pagoda.core.request import Request
from pagoda.sampling_params import SamplingParams


def check_invariants(kv: KVCacheManager) -> None:
    pool = kv.pool
    free_ids = list(pool.free_queue)
    assert all(pool.free_queue[i].block_id == i for i in free_ids)
    assert len(free_ids) == len(set(free_ids)), "a block is twice in the free list"
    held: dict[int, int] = {}
    for tables in kv.req_to_blocks.values():
        assert len({len(blocks) for blocks in tables}) == 1, "a request's group tables differ in length"
        for b in (b for blocks in tables for b in blocks):
            if b is not pool.null_block:   # (in place of a block given back: a sliding window)
                held[b.block_id] = held.get(b.block_id, 0) + 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert b.ref_cnt == held.get(b.block_id, 0), f"ref count of {b} != holders"
        assert (b.ref_cnt == 0) == (b.block_id in set(free_ids)), f"{b} free-ness disagrees"
        if b.block_hash is not None:
            assert pool.cached_blocks[b.block_hash] is b, "a hashed block missing from the index"
    assert all(b.block_hash == h for h, b in pool.cached_blocks.items()), "the index names a reused block"
    assert 0 not in free_ids and pool.null_block.ref_cnt == 1
    assert len(free_ids) + len(held) == pool.num_usable_blocks, "a block leaked"


# Prompts share prefixes: a request's tokens are one of three base sequences cut at a random
# length, plus a random tail, so the prefix cache gets hits, partial hits and misses.
BASES = [[(7 * k + j) % 50 for k in range(200)] for j in range(3)]


def make_request(i: int, n: int, base: int = 0, cut: int | None = None, tail: int = 0) -> Request:
    cut = n if cut is None else min(cut, n)
    tokens = (BASES[base][:cut] + [100 + (i * 13 + k) % 37 for k in range(tail)])[:n] or [1]
    return Request(str(i), tokens, SamplingParams(), eos_token_id=None, max_tokens=1000)


# KV cache groups' windows: one group (none, or a window every layer has), or hybrid ones (Gemma
# 2/3's full and sliding groups).
WINDOWS = [(0,), (0,), (1,), (5,), (16,), (40,), (0, 5), (0, 16, 16), (40, 0)]

ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt", "fork", "reset"]),
                         st.integers(0, 7), st.integers(1, 70), st.integers(0, 2), st.integers(0, 70)),
               max_size=80)


class Simulation:
    """Drives a KVCacheManager the way the scheduler does and keeps what each block would hold,
    to check that a cache hit or a fork only ever yields the request's own tokens, and that no
    one writes into a block someone else holds."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool, windows: tuple[int, ...] = (0,)):
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, windows=windows)
        self.bs, self.windows = block_size, windows
        self.content: dict[int, dict[int, int]] = {}      # block id -> {offset: token}
        self.live: dict[int, Request] = {}

    def admit(self, req: Request, hit: PrefixHit) -> bool:
        n = req.num_tokens - hit.num_tokens
        before = self.kv.num_free_blocks
        got = self.kv.allocate_slots(req, n, hit)
        if got is None:
            assert self.kv.num_free_blocks == before, "a failed allocation must allocate nothing"
            assert req.request_id not in self.kv.req_to_blocks
            return False
        req.num_computed_tokens = hit.num_tokens
        self.run_step(req, n)
        return True

    def run_step(self, req: Request, n: int) -> None:
        """Do the pending copies, then write the tokens the step computes into their slots."""
        for src, dst in self.kv.take_pending_copies():
            self.content[dst] = dict(self.content.get(src, {}))
        for blocks in self.kv.req_to_blocks[req.request_id]:
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                b = blocks[pos // self.bs]
                assert b.ref_cnt == 1, f"writing position {pos} into shared {b}"
                self.content.setdefault(b.block_id, {})[pos % self.bs] = req.all_token_ids[pos]
        req.num_computed_tokens += n

    def check_contents(self, req: Request) -> None:
        """In each group, every position the request's next query attends to (its window's, with
        one) holds the request's own token; a block it gave back is the null block in its table."""
        for window, blocks in zip(self.windows, self.kv.req_to_blocks[req.request_id]):
            start = max(0, req.num_computed_tokens - window + 1) if window else 0
            for pos in range(start, req.num_computed_tokens):
                got = self.content.get(blocks[pos // self.bs].block_id, {}).get(pos % self.bs)
                assert got == req.all_token_ids[pos], f"request {req.request_id} reads a wrong token at {pos}"
            if window:
                # (given back at its last allocation: at most the blocks of one window and a step behind)
                assert all(b is self.kv.pool.null_block for b in blocks[:max(0, start - 70) // self.bs])


def longest_hit(kv: KVCacheManager, req: Request) -> int:
    """The hit's definition, by brute force: the most blocks k whose blocks every group's next
    query reads (a full group's all k, a sliding group's in its window) are all cached."""
    hashes = kv.block_hashes(req)[:(req.num_tokens - 1) // kv.block_size]

    def serves(k):
        return all(kv.pool.get_cached_block((g, hashes[i])) is not None for g, w in enumerate(kv.windows)
                   for i in range(max(0, k * kv.block_size - w + 1) // kv.block_size if w else 0, k))
    return max(k for k in range(len(hashes) + 1) if serves(k)) * kv.block_size


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(2, 24), block_size=st.sampled_from([1, 4, 16]), caching=st.booleans(), ops=ops,
       windows=st.sampled_from(WINDOWS))
def test_random_allocation_sequences_keep_invariants(num_blocks, block_size, caching, ops, windows):
    """(With a sliding window, blocks before a request's window are given back as it grows, in
    a group of its own beside full ones too: forks and prefix hits still read only the
    request's own tokens.)"""
    sim = Simulation(num_blocks, block_size, caching, windows)
    kv, live = sim.kv, sim.live
    for op, i, n, base, cut in ops:
        req = live.get(i)
        # (what each request holds, by its place in the table: with a window a block may be
        # given back and handed out again within one op, which is no eviction of a held block)
        held = {(r, g, j): (b, b.block_hash) for r, tables in kv.req_to_blocks.items()
                for g, blocks in enumerate(tables) for j, b in enumerate(blocks) if b.block_hash}
        if op == "add" and req is None:
            req = make_request(i, n, base, cut, tail=n)
            hit = kv.get_computed_blocks(req)
            assert hit.num_tokens == (longest_hit(kv, req) if caching else 0)
            if sim.admit(req, hit):
                live[i] = req
        elif op == "fork" and req is None and live:
            parent = live[min(live)]
            child = Request(str(i), parent.all_token_ids, SamplingParams(), None, 1000)
            at = min(cut, parent.num_computed_tokens - 1)
            hit = kv.fork_blocks(parent, at) if at > 0 else None
            if hit is not None and sim.admit(child, hit):
                live[i] = child
        elif op == "grow" and req is not None:
            req.all_token_ids += [200 + k % 5 for k in range(n)]
            if kv.allocate_slots(req, n) is not None:
                sim.run_step(req, n)
                assert len(kv.req_to_blocks[req.request_id][0]) == cdiv(req.num_computed_tokens, block_size)
            else:
                del req.all_token_ids[-n:]
        elif op in ("free", "preempt") and req is not None:
            kv.free(req)
            del live[i]
        elif op == "reset":   # (refused while a block is held: with a window a live request may hold none)
            in_use = any(b is not kv.pool.null_block for tables in kv.req_to_blocks.values()
                         for blocks in tables for b in blocks)
            assert kv.reset_prefix_cache() == (not in_use)
            assert in_use or 0 not in windows or not live
        check_invariants(kv)
        for (r, g, j), (b, h) in held.items():
            if r in kv.req_to_blocks and kv.req_to_blocks[r][g][j] is b:
                assert b.block_hash == h, "a referenced block was evicted"
        for r in live.values():
            sim.check_contents(r)
    for req in live.values():
        kv.free(req)
    check_invariants(kv)
    assert kv.num_free_blocks == num_blocks - 1
    if not caching:
        assert kv.pool.num_cached_blocks == 0


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
        assert b.ref_cnt == 0 and b.block_id in pool.free_queue
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


def test_cached_blocks_are_evicted_least_recently_freed_first_and_revived_on_hit():
    kv = KVCacheManager(num_blocks=7, block_size=4)          # 6 usable blocks
    a = make_request(0, 12, base=0)                          # 3 full blocks
    b = make_request(1, 12, base=1)
    for r in (a, b):
        assert kv.allocate_slots(r, 12) is not None
        r.num_computed_tokens = 12
    assert kv.pool.num_cached_blocks == 6
    (a_ids,), (b_ids,) = kv.get_block_ids(a), kv.get_block_ids(b)
    kv.free(a)
    kv.free(b)                                               # a's blocks were freed first
    # A request with a's prompt (plus one token) finds all three of a's blocks, and taking them
    # back from the free queue leaves them cached.
    a2 = make_request(2, 13, base=0)
    hit = kv.get_computed_blocks(a2)
    assert hit.num_tokens == 12 and [x.block_id for x in hit.blocks[0]] == a_ids
    assert kv.allocate_slots(a2, 1, hit) is not None
    assert all(x.ref_cnt == 1 and x.block_hash is not None for x in hit.blocks[0])
    # One new block needed: the least recently freed unreferenced block is b's last (freed
    # tail first), so b's first two blocks stay cached.
    assert kv.pool.num_cached_blocks == 5 and kv.get_block_ids(a2)[0][3] == b_ids[2]
    b2 = make_request(3, 9, base=1)
    assert kv.get_computed_blocks(b2).num_tokens == 8


def test_window_hit_needs_only_the_window_blocks():
    """With a sliding window (6 positions, blocks of 4) a cached prompt with a block evicted in
    its middle is still a hit as long as the blocks its next query's window reaches are cached;
    the ones before stand as the null block. (A request gives its blocks before the window back
    while it runs, so they are the first a new allocation evicts.)"""
    kv = KVCacheManager(num_blocks=9, block_size=4, windows=(6,))          # 8 usable blocks
    a = make_request(0, 24, base=0)                                        # 6 full blocks
    assert kv.allocate_slots(a, 24) is not None
    a.num_computed_tokens = 24
    a.all_token_ids.append(7)
    assert kv.allocate_slots(a, 1) is not None        # blocks 0-3 given back (window 19-24), one new
    a.num_computed_tokens = 25
    b = make_request(1, 8, base=1)
    assert kv.allocate_slots(b, 8) is not None        # the last unused block, then a's block 3 evicted
    kv.free(a)
    again = make_request(2, 25, base=0)
    hit = kv.get_computed_blocks(again)
    cached = [kv.pool.get_cached_block((0, h)) is not None for h in kv.block_hashes(again)[:6]]
    assert cached == [True, True, True, False, True, True]
    assert hit.num_tokens == 24            # (from the left, the hit would end at block 3: 12 tokens)
    assert [b.block_id for b in hit.blocks[0][:4]] == [0] * 4 and all(b.block_hash for b in hit.blocks[0][4:])
    free = kv.num_free_blocks
    assert kv.allocate_slots(again, 1, hit) is not None
    assert kv.num_free_blocks == free - 3              # blocks 4 and 5 revived, one new


def test_a_whole_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    a = make_request(0, 8)
    kv.allocate_slots(a, 8)
    a.num_computed_tokens = 8
    again = make_request(1, 8)
    assert kv.get_computed_blocks(again).num_tokens == 4     # not 8: the last block is recomputed
    salted = make_request(2, 8)
    salted.cache_salt = "tenant-b"
    assert kv.get_computed_blocks(salted).num_tokens == 0
    assert kv.reset_prefix_cache() is False                  # a is still running
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(again).num_tokens == 0 and kv.pool.num_cached_blocks == 0


def test_block_hashes_chain_each_block_and_extend_incrementally():
    # The hash of block i covers its parent's hash and its own token ids (with the cache salt in
    # block 0), however the request's tokens arrived: all at once, or a few per step.
    import hashlib

    import numpy as np
    bs, tokens = 4, [(5 * k + 3) % 97 for k in range(23)]
    expected, parent = [], b""
    for i in range(len(tokens) // bs):
        h = hashlib.sha256(parent)
        h.update(np.asarray(tokens[i * bs:(i + 1) * bs], dtype=np.int64).tobytes())
        if i == 0:
            h.update(repr(("salt",)).encode())
        parent = h.digest()
        expected.append(parent)
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    whole = Request("a", tokens, SamplingParams(), None, 8, cache_salt="salt")
    assert kv.block_hashes(whole) == expected
    grown = Request("b", tokens[:6], SamplingParams(), None, 32, cache_salt="salt")
    assert kv.block_hashes(grown) == expected[:1]
    for t in tokens[6:]:
        grown.append_output_token(t)
        kv.block_hashes(grown)
    assert grown.block_hashes == expected
    assert kv.block_hashes(Request("c", tokens, SamplingParams(), None, 8))[1:] != expected[1:]  # no salt


def test_hybrid_groups_hit_what_every_group_can_serve():
    """A full group and a sliding one (6 positions), blocks of 4. A request of 24 tokens that
    grows by one gives its sliding group's blocks 0-3 back and keeps all of its full group's. The
    same prompt then hits 24 tokens: the full group's 6 blocks, the sliding group's last 2 (the
    null block before them). With the full group's block 2 evicted the hit ends at 8 tokens (the
    sliding group's blocks 0-1, given back but still cached, serve it); with the sliding group's
    block 1 evicted too, at 4."""
    kv = KVCacheManager(num_blocks=30, block_size=4, windows=(0, 6))
    a = make_request(0, 24, base=0)
    assert [len(ids) for ids in kv.allocate_slots(a, 24)] == [6, 6]
    a.num_computed_tokens = 24
    a.all_token_ids.append(7)
    assert kv.allocate_slots(a, 1) is not None
    a.num_computed_tokens = 25
    null = kv.pool.null_block
    assert [b is null for b in kv.req_to_blocks[a.request_id][1]] == [True] * 4 + [False] * 3
    assert kv.num_free_blocks == 29 - 10
    kv.free(a)
    assert kv.num_free_blocks == 29
    again = make_request(1, 25, base=0)
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 24 and null not in hit.blocks[0] and len(hit.blocks[0]) == 6
    assert [b is null for b in hit.blocks[1]] == [True] * 4 + [False] * 2

    def evict(group, i):
        key = (group, kv.block_hashes(again)[i])
        kv.pool.cached_blocks.pop(key).block_hash = None

    evict(0, 2)
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 8 and null not in hit.blocks[0] + hit.blocks[1]
    evict(1, 1)
    assert kv.get_computed_blocks(again).num_tokens == 4


def test_max_blocks_per_request():
    """What a request holds at most: a full group all its blocks, a sliding group its window and
    a step's tokens (at most all its blocks)."""
    assert max_blocks_per_request((0, 6, 6), 4, 100, 8) == 25 + 2 * (cdiv(6 + 8, 4) + 1)
    assert max_blocks_per_request((0, 6, 6), 4, 8, 100) == 3 * 2
    assert max_blocks_per_request((0,), 16, 100, 8192) == 7
