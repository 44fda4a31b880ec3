"""Micro-benchmark of a mixture of experts' layer on the GPU: the Triton experts
(pagoda.kernels.triton_moe, what the engine runs on CUDA) against the torch reference (one
expert after another, what it runs on CPU), with one layer of Qwen3-30B-A3B's shapes (128
experts of 2,048 x 768, top 8) in bf16, random routing.

Columns: time of one call (``triton.testing.do_bench``, median, L2 flushed) for each, eager;
the Triton path's GPU time alone (its call captured in a CUDA graph and replayed, as decode
steps run it: eager calls of a few tokens wait on the host's launches), and that path's effective
bandwidth (the bytes of the experts its tokens touch, which each
call must read at least once) and matmul rate; ``layer us``: the same graph with the routing
in it (``triton_moe.select_experts`` on router logits), as the engine's MoE layer runs. Each case
is first checked against the reference (relative error < 1e-2).

With ``--sweep``, each token count's time under every tile configuration of a small grid
(``triton_moe.fused_moe``'s ``tiles``) instead, and the best against ``default_tiles``. With
``--int4``, GPTQ experts (4-bit words in groups of 128 with bf16 scales and zeros, random)
instead of bf16 ones: the bandwidth then counts their packed bytes, the packed kernel runs at every
size, and ``dequant us`` is the graph time of the large batches' path instead (the experts
dequantized whole, then the dense kernel); ``--transposed``: the default
tiles with the converted weight tile as the dot's A operand (``fused_moe``'s ``transposed`` tile).

Run from the repository root:  OUT=/some/dir python benchmarks/moe_kernels.py [--int4] [--transposed]
                                   [--sweep [TOKENS...]]
Prints a table; writes ``$OUT/moe_kernels.json`` (or ``moe_tiles.json``) when OUT is set.
"""
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda.kernels import reference, triton_moe

del common  # (imported for its sys.path entry alone)

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TOKENS = [1, 8, 64, 256, 2048, 4096, 16384]
INT4 = "--int4" in sys.argv     # GPTQ experts instead of bf16 ones
TRANSPOSED = "--transposed" in sys.argv    # the default tiles, the weight tile the dot's A operand


def graph_us(fn) -> float:
    """GPU time of fn (no host sync inside) replayed from a CUDA graph, microseconds."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, return_mode="median") * 1e3


def layer(g):
    if INT4:
        return int4_experts(2 * INTER, HIDDEN, g), int4_experts(HIDDEN, INTER, g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=g).div_(HIDDEN ** 0.5).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=g).div_(INTER ** 0.5).bfloat16()
    return w13, w2


def int4_experts(n: int, k: int, g, group: int = 128) -> reference.Int4Experts:
    """Random GPTQ experts ``(EXPERTS, n, k)``: words of 8 values, zero points 8, scales about
    the bf16 weights' size over 8."""
    qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (EXPERTS, k // 8, n), dtype=torch.int32, device="cuda", generator=g)
    scales = torch.rand(EXPERTS, k // group, n, device="cuda", generator=g).add_(0.5).div_(4 * k ** 0.5).bfloat16()
    return reference.Int4Experts(qweight, scales, torch.full_like(scales, 8.0), None, 4, group)


def expert_bytes(w) -> int:
    """Bytes of one expert of a stacked weight (bf16, or packed words + scales + zeros)."""
    if isinstance(w, reference.Int4Experts):
        return w.qweight[0].numel() * 4 + w.scales[0].numel() * 2 * 2
    return w[0].numel() * w.element_size()


def inputs(t, g, w13, w2):
    """t tokens and their random routing; the reference's output."""
    x = torch.randn(t, HIDDEN, device="cuda", generator=g).bfloat16()
    weights, ids = reference.select_experts(torch.randn(t, EXPERTS, device="cuda", generator=g), TOP_K, True)
    return x, weights, ids, reference.fused_moe(x, w13, w2, weights, ids)


def check(got, want, *what):
    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert err < 1e-2, (*what, err)


def tile_grid(tokens: int) -> list[dict]:
    """The configurations to try: at decode batches (a few pairs an expert, the weights' read
    the whole cost) narrow and deep ones, for more programs each streaming longer; else wide."""
    if tokens <= 256:
        axes = [16], [16, 32, 64], [128, 256], [2, 4], [3, 4]
    else:
        axes = [16, 32, 64, 128], [64, 128], [64, 128], [4, 8], [3]
    transposed = [False, True] if INT4 else [False]     # (the converted weight tile the dot's A operand)
    return [dict(block_m=m, block_n=n, block_k=k, num_warps=w, num_stages=s, transposed=t)
            for m, n, k, w, s, t in itertools.product(*axes, transposed)]


def sweep(tokens: list[int]):
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = layer(g)
    rows = []
    print(f"{'tokens':>6} {'default us':>10} {'best us':>8}  best tiles (GPU time, in a CUDA graph)")
    for t in tokens:
        x, weights, ids, want = inputs(t, g, w13, w2)
        times = []
        for tiles in tile_grid(t):
            try:
                got = triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=tiles)
            except Exception as e:      # out of shared memory: that configuration does not exist
                times.append((float("inf"), tiles, type(e).__name__))
                continue
            check(got, want, t, tiles)
            us = graph_us(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=tiles))
            times.append((us, tiles, None))
        default = graph_us(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids))
        best = min(times, key=lambda r: r[0])
        rows.append(dict(tokens=t, default_us=default, best_us=best[0], best=best[1],
                         all=[dict(us=u, **c) for u, c, _ in times]))
        print(f"{t:6d} {default:10.1f} {best[0]:8.1f}  {best[1]}")
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "moe_tiles_int4.json" if INT4 else "moe_tiles.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [EXPERTS, TOP_K, HIDDEN, INTER],
                       "rows": rows}, f, indent=2)


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = layer(g)
    one_expert = expert_bytes(w13) + expert_bytes(w2)
    rows = []
    print(f"{'tokens':>6} {'torch us':>9} {'triton us':>9} {'speed-up':>8} {'graph us':>8} {'GB/s':>7} {'TFLOP/s':>7}"
          f" {'layer us':>8}" + (f" {'dequant us':>11}" if INT4 else ""))
    for t in TOKENS:
        x, weights, ids, want = inputs(t, g, w13, w2)
        tiles = dict(triton_moe.default_tiles(t * TOP_K, EXPERTS, 2, INT4), transposed=True) if TRANSPOSED else None
        check(triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=tiles), want, t)
        us_torch = do_bench(lambda: reference.fused_moe(x, w13, w2, weights, ids), return_mode="median") * 1e3
        us_triton = do_bench(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=tiles),
                             return_mode="median") * 1e3
        triton_moe.DEQUANTIZE_FROM_TOKENS = 1 << 30      # (packed experts: the packed kernel at every size)
        us_graph = graph_us(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, tiles=tiles))
        us_dequant = None
        if INT4:    # the experts dequantized whole first, then the dense kernel (large batches' path)
            triton_moe.DEQUANTIZE_FROM_TOKENS = 0
            check(triton_moe.fused_moe(x, w13, w2, weights, ids), want, t, "dequantized")
            us_dequant = graph_us(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids))
            triton_moe.DEQUANTIZE_FROM_TOKENS = 1 << 30
        logits = torch.randn(t, EXPERTS, device="cuda", generator=g).bfloat16()
        us_layer = graph_us(lambda: triton_moe.fused_moe(x, w13, w2, *triton_moe.select_experts(logits, TOP_K, True),
                                                         tiles=tiles))
        touched = ids.unique().numel()
        flops = 2 * t * TOP_K * 3 * HIDDEN * INTER
        row = dict(tokens=t, experts_touched=touched, torch_us=us_torch, triton_us=us_triton, graph_us=us_graph,
                   gb_s=touched * one_expert / us_graph / 1e3, tflop_s=flops / us_graph / 1e6, layer_us=us_layer,
                   dequantized_us=us_dequant)
        rows.append(row)
        print(f"{t:6d} {us_torch:9.1f} {us_triton:9.1f} {us_torch / us_triton:8.2f} {us_graph:8.1f} {row['gb_s']:7.0f} "
              f"{row['tflop_s']:7.1f} {us_layer:8.1f}" + (f" {us_dequant:11.1f}" if INT4 else ""))
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        name = f"moe_kernels{'_int4' if INT4 else ''}{'_transposed' if TRANSPOSED else ''}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": [EXPERTS, TOP_K, HIDDEN, INTER],
                       "int4": INT4, "rows": rows}, f, indent=2)

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--sweep" in args:
        sweep([int(a) for a in args if a.isdigit()] or TOKENS)
    else:
        main()
