"""The mixture of experts' Triton path (pagoda.kernels.triton_moe) against its torch version
(reference.fused_moe): the pairs' alignment by expert, and the whole experts' sum. Without a
CUDA device the kernel runs in Triton's CPU interpreter (fp32, fp16); with one compiled, bf16
too, and in a CUDA graph replayed over new routings. Fresh random inputs; experts no token
chose, widths that are not powers of two, top_k 1 to 4. Bounds as in test_triton_ops.py."""
import pytest
import torch

from pagoda.kernels import reference, triton_moe
from pagoda.quant.int4 import pack_rows
from tests.kernels.test_triton_ops import DEVICE, DTYPES, ON_GPU, TOLERANCE, matrix, seed_for

CASES = matrix([1, 6, 45] + ([300, 2049] if ON_GPU else []),    # tokens
               [(4, 2), (8, 3), (16, 4)] + ([(128, 8)] if ON_GPU else []),   # experts, top_k
               [(48, 40), (64, 96)],                              # hidden, intermediate
               DTYPES, cpu=lambda t, ek, hi, dtype: t < 45 or (dtype == torch.float32 and ek[0] == 8))


def routing(tokens, experts, top_k, g):
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, : experts // 4] -= 4.0          # some experts seldom or never chosen
    return reference.select_experts(logits.to(DEVICE), top_k, renormalize=top_k > 2)


def weights(experts, hidden, inter, dtype, g):
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    return w13, w2


@pytest.mark.parametrize("foreign", [False, True])
@pytest.mark.parametrize("tokens,experts_topk,block_m", [(1, (8, 2), 16), (37, (8, 3), 16), (200, (16, 4), 64),
                                                          (5, (64, 8), 16), (3, (128, 8), 16), (600, (8, 2), 128),
                                                          (1100, (4, 4), 64)])
@pytest.mark.parametrize("align", ["reference", "triton"])
def test_moe_align_groups_every_pair_by_expert(tokens, experts_topk, block_m, foreign, align, request):
    """With ``foreign``, about a third of the pairs chose another rank's expert (-1): in no block.
    The one-program kernel (up to ALIGN_MAX_PAIRS; 1,100 tokens x 4 is past it: the torch ops)
    gives what the reference does, to the element."""
    experts, top_k = experts_topk
    g = seed_for(request)
    _, ids = routing(tokens, experts, top_k, g)
    if foreign:
        ids = torch.where(torch.rand(ids.shape, generator=g).to(DEVICE) < 1 / 3, -1, ids)
    pairs, block_experts = reference.moe_align(ids, experts, block_m)
    if align == "triton":
        got_pairs, got_experts = triton_moe.moe_align(ids, experts, block_m)
        assert torch.equal(got_pairs, pairs) and torch.equal(got_experts, block_experts)
    n = tokens * top_k
    flat, pairs, block_experts = ids.flatten().cpu(), pairs.cpu().long(), block_experts.cpu().long()
    assert pairs.numel() == block_experts.numel() * block_m
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == (flat >= 0).nonzero().flatten().tolist()  # each pair once, the rest padding
    assert (pairs <= n).all()
    # every block holds pairs of its own expert only; experts in order; then the unused blocks
    block_of_pair = torch.arange(pairs.numel()) // block_m
    assert (flat[real] == block_experts[block_of_pair[pairs < n]]).all()
    used = block_experts < experts
    assert used.sum() == sum(-(-int((flat == e).sum()) // block_m) for e in range(experts))
    assert (block_experts[used].diff() >= 0).all() and not used[used.sum():].any()


@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 8, 2, True), (45, 60, 3, False), (7, 128, 8, True),
                                                             (0, 16, 4, True)])
def test_select_experts_matches_reference(tokens, experts, top_k, renormalize, request):
    """The largest top_k of the softmax, largest first, renormalised or not; router logits in bf16
    and float32 (a row's stride past its width: a slice of a wider output). bf16 logits tie: then
    either expert of a tie is right, so each id's own weight is checked."""
    g = seed_for(request)
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(tokens, experts + 3, generator=g).to(DEVICE, dtype)[:, :experts]
        want_w, want_ids = reference.select_experts(logits, top_k, renormalize)
        got_w, got_ids = triton_moe.select_experts(logits, top_k, renormalize)
        assert got_w.dtype == torch.float32 and got_ids.dtype == torch.int64
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
        if dtype == torch.float32:
            assert torch.equal(got_ids, want_ids)
        probs = logits.float().softmax(-1).gather(1, got_ids)
        torch.testing.assert_close(probs / (probs.sum(-1, keepdim=True) if renormalize else 1), got_w)
        assert all(len(set(row)) == top_k for row in got_ids.tolist())


@pytest.mark.parametrize("tokens", [3, 40])
def test_expert_parallel_shares_sum_to_the_whole(tokens, request):
    """Expert parallelism: each of 2 ranks holds half of the experts and an ``expert_map`` from
    global ids to its own (-1 elsewhere); its partial sums (Triton's and the reference's agree)
    add up to the whole layer's output."""
    g = seed_for(request)
    experts, top_k, ranks = 8, 3, 2
    topk_weights, topk_ids = routing(tokens, experts, top_k, g)
    w13, w2 = weights(experts, 48, 40, torch.float32, g)
    x = torch.randn(tokens, 48, generator=g).to(DEVICE)
    local = experts // ranks
    total = torch.zeros_like(x)
    for r in range(ranks):
        expert_map = torch.full((experts,), -1, dtype=torch.int32, device=DEVICE)
        expert_map[r * local:(r + 1) * local] = torch.arange(local, dtype=torch.int32, device=DEVICE)
        shard = w13[r * local:(r + 1) * local], w2[r * local:(r + 1) * local]
        want = reference.fused_moe(x, *shard, topk_weights, topk_ids, expert_map)
        got = triton_moe.fused_moe(x, *shard, topk_weights, topk_ids, expert_map)
        assert (got - want).norm() / want.norm() < TOLERANCE[torch.float32]
        total += got
    whole = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert (total - whole).norm() / whole.norm() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tokens,experts_topk,hidden_inter,dtype", CASES)
def test_fused_moe_matches_reference(tokens, experts_topk, hidden_inter, dtype, request):
    (experts, top_k), (hidden, inter) = experts_topk, hidden_inter
    g = seed_for(request)
    topk_weights, topk_ids = routing(tokens, experts, top_k, g)
    w13, w2 = weights(experts, hidden, inter, dtype, g)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).norm() / want.float().norm()
    assert err < TOLERANCE[dtype], err


@pytest.mark.parametrize("block,inter,dtype", [((32, 32), 64, torch.float8_e4m3fn), ((16, 64), 48, torch.float8_e4m3fn),
                                               (None, 48, torch.float8_e4m3fn), (None, 48, torch.int8)])
def test_fused_moe_with_8bit_experts(block, inter, dtype, request):
    """FP8 experts: block-wise (Qwen3-30B-A3B-FP8's), each tile scaled by its block's scale as it
    is converted, blocks as wide as a tile or narrower; or (None) a scale a row, a block of one
    row by the whole input (vLLM's per-tensor checkpoints, quantization="fp8"); INT8 experts
    (compressed-tensors W8A8) a scale a row."""
    g = seed_for(request)
    experts, top_k, hidden = 8, 2, 96
    topk_weights, topk_ids = routing(13, experts, top_k, g)
    w13, w2 = (torch.randn(experts, *shape, generator=g).mul(100).clamp(-400, 400) for shape in
               ((2 * inter, hidden), (hidden, inter)))
    w13, w2 = ((w.round().clamp(-127, 127) if dtype == torch.int8 else w).to(dtype) for w in (w13, w2))
    blocks = [block or (1, w.shape[2]) for w in (w13, w2)]
    s13, s2 = (torch.rand(experts, -(-w.shape[1] // b[0]), -(-w.shape[2] // b[1]), generator=g) * 1e-3
               for w, b in zip((w13, w2), blocks))
    x = torch.randn(13, hidden, generator=g)
    args = [t.to(DEVICE) for t in (x, w13, w2, topk_weights, topk_ids)]
    scales = (s13.to(DEVICE), blocks[0]), (s2.to(DEVICE), blocks[1])
    want = reference.fused_moe(*args, scales=scales)
    dense = [torch.stack([reference.dequantize_blocks(w[e], s[e], b, torch.float32) for e in range(experts)])
             for w, s, b in ((w13, s13, blocks[0]), (w2, s2, blocks[1]))]
    assert torch.allclose(want, reference.fused_moe(args[0], *[d.to(DEVICE) for d in dense], *args[3:]))
    for transposed in (False, True):
        tiles = dict(triton_moe.default_tiles(13 * top_k, experts), transposed=transposed)
        got = triton_moe.fused_moe(*args, scales=scales, tiles=tiles)
        assert (got - want).norm() / want.norm() < TOLERANCE[torch.float32], transposed


def int4_experts(experts, n, k, bits, group, dtype, g, halves=0, int_zeros=True):
    """Random GPTQ / AWQ experts in pagoda's layout, with the dense weights they stand for.
    ``halves``: act-order, each half of the N columns its own random order of groups;
    ``int_zeros`` off: zero points with fractions (GGUF's)."""
    top = (1 << bits) - 1
    groups = -(-k // group)
    q = torch.randint(0, top + 1, (experts, k, n), generator=g, dtype=torch.int32)
    zeros = (torch.randint(0, top + 1, (experts, groups, n), generator=g) if int_zeros
             else torch.rand(experts, groups, n, generator=g) * top).to(dtype)
    scales = ((torch.rand(experts, groups, n, generator=g) + 0.5) / (top * k ** 0.5)).to(dtype)
    by_rule = torch.arange(k) // group
    g_idx = (torch.stack([torch.stack([by_rule[torch.randperm(k, generator=g)] for _ in range(halves)])
                          for _ in range(experts)]).int() if halves else None)
    dense = torch.empty(experts, n, k)
    for e in range(experts):
        for h, cols in enumerate((torch.arange(n) // (n // max(halves, 1))).unique()):
            sel = (torch.arange(n) // (n // max(halves, 1))) == cols
            gi = (by_rule if g_idx is None else g_idx[e, h]).long()
            dense[e][sel] = ((q[e][:, sel] - zeros[e][gi][:, sel]) * scales[e][gi][:, sel]).float().t()
    packed = pack_rows(q.flatten(0, 1), bits).view(experts, k * bits // 32, n)
    moved = [t if t is None else t.to(DEVICE) for t in (packed, scales, zeros, g_idx)]
    return reference.Int4Experts(*moved, bits, group, int_zeros), dense.to(DEVICE, dtype)


@pytest.mark.parametrize("bits,group,act_order,tokens,int_zeros", [
    (4, 32, False, 13, True), (4, 128, False, 3, True), (8, 16, False, 9, True), (4, 32, True, 13, True),
    (4, 48, False, 7, True), (4, 32, False, 11, False), (8, 16, False, 5, False)])
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if ON_GPU else [torch.float16]))
def test_fused_moe_with_int4_experts(bits, group, act_order, tokens, int_zeros, dtype, request):
    """GPTQ / AWQ experts (``reference.Int4Experts``): the words unpacked and each tile
    dequantized in registers, groups whole tiles, smaller than one (32 and 16 of 64-input steps,
    48: tiles across groups), one group over the whole input (128), or (act-order) each input's
    group read from its expert's g_idx, w13's gate and up halves their own; GGUF's zero points
    with fractions. The reference's experts are the dense weights the words stand for, and the
    kernel's sum is the reference's."""
    g = seed_for(request)
    experts, top_k, hidden, inter = 8, 2, 128, 64
    topk_weights, topk_ids = routing(tokens, experts, top_k, g)
    w13, d13 = int4_experts(experts, 2 * inter, hidden, bits, min(group, hidden), dtype, g, 2 * act_order, int_zeros)
    w2, d2 = int4_experts(experts, hidden, inter, bits, min(group, inter), dtype, g, act_order, int_zeros)
    x = torch.randn(tokens, hidden, generator=g).to(DEVICE, dtype)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(want, reference.fused_moe(x, d13, d2, topk_weights, topk_ids))
    # (the weight tile the dot's B operand, or its A; the decode tiles of packed experts)
    for tiles in (dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, transposed=False),
                  dict(block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2, transposed=True),
                  triton_moe.default_tiles(64, experts, packed=True)):
        got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, tiles=tiles)
        err = (got.float() - want.float()).norm() / want.float().norm()
        assert err < TOLERANCE[dtype], (tiles, err)


@pytest.mark.parametrize("bits,group,act_order,int_zeros", [(4, 32, False, True), (8, 16, False, True),
                                                             (4, 32, True, True), (4, 48, False, True),
                                                             (4, 16, False, False), (8, 32, False, False)])
def test_dequantize_experts(bits, group, act_order, int_zeros, monkeypatch, request):
    """Packed experts dequantized whole (large batches) hold ``Int4Experts.dense``'s values
    exactly (GGUF's zero points with fractions too), and the MoE layer through them gives the
    reference's sum."""
    g = seed_for(request)
    experts, top_k, hidden, inter = 8, 2, 128, 64
    w13, _ = int4_experts(experts, 2 * inter, hidden, bits, group, torch.float32, g, 2 * act_order, int_zeros)
    w2, _ = int4_experts(experts, hidden, inter, bits, min(group, inter), torch.float32, g, act_order, int_zeros)
    for w in (w13, w2):
        want = torch.stack([w.dense(e) for e in range(experts)])
        assert torch.equal(triton_moe.dequantize_experts(w, torch.float32), want)
    topk_weights, topk_ids = routing(19, experts, top_k, g)
    x = torch.randn(19, hidden, generator=g).to(DEVICE)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    monkeypatch.setattr(triton_moe, "DEQUANTIZE_FROM_TOKENS", 19)
    got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    assert (got - want).norm() / want.norm() < TOLERANCE[torch.float32]


@pytest.mark.parametrize("tiles", [dict(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2),
                                   dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2)])
def test_fused_moe_with_other_tiles(tiles, request):
    """The tile sizes a sweep tries (benchmarks/moe_kernels.py --sweep) give the same sum:
    tiles wider than the matrices, K not a multiple of the tile."""
    g = seed_for(request)
    topk_weights, topk_ids = routing(21, 8, 2, g)
    w13, w2 = weights(8, 80, 48, torch.float32, g)
    x = torch.randn(21, 80, generator=g).to(DEVICE)
    want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
    got = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, tiles=tiles)
    assert (got - want).norm() / want.norm() < TOLERANCE[torch.float32]


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_fused_moe_in_a_cuda_graph(request):
    """No host sync: captured once, replayed over routings it was not captured with."""
    g = seed_for(request)
    tokens, experts, top_k = 64, 32, 4
    w13, w2 = weights(experts, 256, 128, torch.bfloat16, g)
    x = torch.randn(tokens, 256, generator=g).to(DEVICE, torch.bfloat16)
    topk_weights, topk_ids = routing(tokens, experts, top_k, g)
    triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)    # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    for _ in range(3):
        new_weights, new_ids = routing(tokens, experts, top_k, g)
        topk_weights.copy_(new_weights)
        topk_ids.copy_(new_ids)
        x.copy_(torch.randn(tokens, 256, generator=g).to(DEVICE, torch.bfloat16))
        graph.replay()
        want = reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
        assert (out.float() - want.float()).norm() / want.float().norm() < TOLERANCE[torch.bfloat16]
