"""The torch elementwise ops of the CPU path against HF transformers' own formulas, bit for bit
in float32 (the greedy outputs must equal HF's token for token)."""
import pytest
import torch

from pagoda.kernels import reference
from pagoda.model.layers.rotary import RotaryEmbedding

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 2, 1, 32), (37, 9, 3, 64), (300, 4, 2, 128)])
def test_rotary_equals_hf_bit_for_bit(tokens, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    before = qkv.clone()
    out_q, out_k = reference.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
    assert torch.equal(qkv, before), "q and k must be left unchanged"

    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    for x, out in ((q, out_q), (k, out_k)):
        x = x.reshape(tokens, -1, head_dim)
        hf = x * cos + modeling_llama.rotate_half(x) * sin
        assert out.shape == (tokens, x.shape[1] * head_dim)
        assert torch.equal(out.view_as(hf), hf)


@pytest.mark.parametrize("tokens,head_dim,rotary_dim", [(1, 32, 16), (37, 64, 48), (300, 128, 96)])
def test_partial_rotary_equals_hf_bit_for_bit(tokens, head_dim, rotary_dim):
    """Phi-4-mini's partial rotary embedding: the table turns each head's first rotary_dim
    dimensions, the rest pass as they are, bit for bit as HF's Phi-3 applies it."""
    modeling_phi3 = pytest.importorskip("transformers.models.phi3.modeling_phi3")
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, rotary_dim=rotary_dim)
    assert rope.cos_sin_cache.shape == (4096, rotary_dim)
    q = torch.randn(tokens, 3 * head_dim, generator=gen)
    k = torch.randn(tokens, head_dim, generator=gen)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    out_q, out_k = reference.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim)
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    hf_q, hf_k = modeling_phi3.apply_rotary_pos_emb(q.view(tokens, 3, head_dim), k.view(tokens, 1, head_dim), cos, sin)
    assert torch.equal(out_q.view(tokens, 3, head_dim), hf_q)
    assert torch.equal(out_k.view(tokens, 1, head_dim), hf_k)
    assert torch.equal(out_q.view(tokens, 3, head_dim)[..., rotary_dim:], q.view(tokens, 3, head_dim)[..., rotary_dim:])


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 65, 300])
def test_cpu_dense_linear(rows, monkeypatch):
    """The CPU's dense matmul (``quant.base.dense_linear``): F.linear's result in float32 at every
    row count, contiguous, with and without bias; 2-64 rows go the transposed way
    (``weight @ x.T``), the others through F.linear."""
    import torch.nn.functional as F

    from pagoda.quant import base
    gen = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(200, 96, generator=gen) * 0.1, torch.randn(200, generator=gen)
    x = torch.randn(rows, 96, generator=gen)
    transposed = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: transposed.append(a.shape) or real_mm(a, b))
    for b in (None, bias):
        out = base.dense_linear(x, w, b)
        assert out.is_contiguous() and out.shape == (rows, 200)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    lo, hi = base.CPU_TRANSPOSED_ROWS
    assert transposed == ([(200, 96)] * 2 if lo <= rows <= hi else [])
