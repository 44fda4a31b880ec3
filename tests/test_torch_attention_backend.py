"""The CPU attention backend (TorchAttentionBackend: grouped decodes, planned once per step)
against the torch reference (reference.write_kv_cache + reference.paged_attention over the
whole batch), on fresh random caches, block tables and queries: odd context lengths, GQA,
decodes alone, decodes mixed with prefills that have a cached prefix, and every grouping from
one group to one request per group."""
import zlib

import pytest
import torch

from pagoda.kernels import reference
from pagoda.model.layers.attention import AttentionMetadata, TorchAttentionBackend
from tests.paged_inputs import random_block_tables

HEAD_DIM, BLOCK_SIZE = 16, 16
HEADS = [(4, 4), (9, 3), (8, 2)]      # (num_heads, num_kv_heads): GQA ratios 1, 3 and 4


def make_step(q_lens, seq_lens, num_heads, num_kv_heads, gen):
    """A step's inputs, decodes first as the runner orders them: new q/k/v for the scheduled
    tokens, a random cache holding the context before them, and block tables whose unused
    entries point at random blocks (padding must not leak into the result)."""
    tables, num_blocks = random_block_tables(seq_lens, BLOCK_SIZE, gen, spare_blocks=8, spare_cols=2, first_block=1)
    n_tokens = sum(q_lens)
    q = torch.randn(n_tokens, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(n_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(n_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        for pos in range(sl - ql, sl):
            slots.append(int(tables[i, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    nd = sum(1 for ql in q_lens if ql == 1)
    md = AttentionMetadata(n_tokens, nd, torch.tensor(slots), qsl, seq, tables.int(), max(q_lens),
                           max(seq_lens), max(seq_lens[:nd], default=0))
    return q, k, v, kv_cache, md


def check(q_lens, seq_lens, num_heads, num_kv_heads, gen):
    q, k, v, kv_cache, md = make_step(q_lens, seq_lens, num_heads, num_kv_heads, gen)
    scale = HEAD_DIM ** -0.5
    ref_cache = kv_cache.clone()
    reference.write_kv_cache(k, v, ref_cache, md.slot_mapping)
    ref = reference.paged_attention(q, ref_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale)
    out = TorchAttentionBackend.forward(q, k, v, kv_cache, md, scale)
    assert torch.equal(kv_cache, ref_cache), "the new K/V must land in their slots"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    return md


def seed_for(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("group_bytes", [1 << 40, 1 << 16, 1])     # one group, a few, one request each
def test_decodes(request, heads, group_bytes, monkeypatch):
    monkeypatch.setattr(TorchAttentionBackend, "DECODE_GROUP_BYTES", group_bytes)
    gen = seed_for(request)
    seq_lens = torch.randint(1, 100, (37,), generator=gen).tolist() + [1, 16, 17, 33]
    md = check([1] * len(seq_lens), seq_lens, *heads, gen)
    groups = md.decode_groups[0]
    assert [i for g in groups for i in range(41)[g.rows]] == list(range(41))
    if group_bytes == 1:
        assert len(groups) == 41
    elif group_bytes == 1 << 40:
        assert len(groups) == 1
    else:
        assert 1 < len(groups) < 41


@pytest.mark.parametrize("heads", HEADS)
def test_decodes_mixed_with_prefills(request, heads, monkeypatch):
    """Decodes in several groups, then a whole prompt and two chunks after a cached prefix."""
    monkeypatch.setattr(TorchAttentionBackend, "DECODE_GROUP_BYTES", 1 << 14)
    gen = seed_for(request)
    decodes = [5, 130, 47, 1, 64, 99, 18]
    check([1] * len(decodes) + [23, 40, 7], decodes + [23, 95, 7], *heads, gen)


@pytest.mark.parametrize("prefill_groups", [1, 3, 8])
def test_prefills_only(request, prefill_groups, monkeypatch):
    """Whole prompts and chunks after a cached prefix, in one group, a few, or one each."""
    monkeypatch.setattr(TorchAttentionBackend, "PREFILL_GROUPS", prefill_groups)
    gen = seed_for(request)
    q_lens = [31, 16, 41, 2, 64, 9, 17]
    md = check(q_lens, [31, 50, 300, 2, 64, 100, 17], 9, 3, gen)
    assert len(md.prefill_groups) == min(prefill_groups, len(q_lens))
    tokens = torch.cat([g.tokens for g in md.prefill_groups])
    assert sorted(tokens.tolist()) == list(range(sum(q_lens))), "each query token in exactly one group"
