"""W5, the matmul alone: the W4A16 Triton kernel (``pagoda/kernels/triton_w4a16.py``) on the decode
matrices of Qwen3-0.6B and Llama-3-8B (4-bit, groups of 128), against what a bf16 model runs
(cuBLAS on the bf16 weight) and what batches over its ``PACKED_MAX_M`` rows run (the whole weight
dequantized by ``triton_w4a16.dequantize``, then cuBLAS). Microseconds per matmul in a CUDA
graph, and the kernel's GB/s of packed weights read. Needs a GPU.

  python benchmarks/w4a16.py [--rows 1 16 64] [--sweep] [--gemv-sweep]
  python benchmarks/w4a16.py --rows 64 128 192 256 512 2048   # where dequantize + cuBLAS wins (PACKED_MAX_M)
  python benchmarks/w4a16.py --w8 [--rows 2 8 64 256]   # FP8 weights: W8A16 kernel against W8A8
  python benchmarks/w4a16.py --w8 --int8 --rows 64 256 512 2048 16384   # INT8: W8A16 / dequantized against W8A8
  python benchmarks/w4a16.py --w8 --int8 --sweep --rows 300 2048 16384   # also each INT8_SWEEP tile of the INT8 kernel
"""
import argparse
import collections
import json
import os

import torch

from common import graph_ms
from pagoda.kernels import triton_w4a16 as tw
from pagoda.quant.int4 import dequantize, pack_rows

# (model, matrix): (K, N) of x @ W
MATRICES = {("qwen3-0.6b", "qkv"): (1024, 4096), ("qwen3-0.6b", "o"): (2048, 1024),
            ("qwen3-0.6b", "gate_up"): (1024, 6144), ("qwen3-0.6b", "down"): (3072, 1024),
            ("llama3-8b", "qkv"): (4096, 6144), ("llama3-8b", "o"): (4096, 4096),
            ("llama3-8b", "gate_up"): (4096, 28672), ("llama3-8b", "down"): (14336, 4096)}
GROUP = 128


# --sweep: entries tried for TILES[block_m] (merged into the current one), by block_m: the rows a
# program takes. At 128-256 rows a program's accumulator is BLOCK_N x BLOCK_M float32: 8 warps or
# narrower tiles keep it in registers.
SWEEP = {
    64: [dict(), dict(BLOCK_N=64), dict(BLOCK_N=128, num_warps=8), dict(BLOCK_K=256), dict(num_stages=4)],
    128: [dict(), dict(num_warps=8), dict(BLOCK_N=64), dict(BLOCK_N=64, num_warps=8),
          dict(BLOCK_K=64, num_warps=8, num_stages=4), dict(BLOCK_N=64, BLOCK_K=64, num_stages=4), dict(BLOCK_N=32)],
    256: [dict(), dict(num_warps=8), dict(BLOCK_N=64), dict(BLOCK_N=64, num_warps=8),
          dict(BLOCK_N=64, BLOCK_K=64, num_warps=8, num_stages=4), dict(BLOCK_N=32), dict(BLOCK_N=32, num_warps=8),
          dict(BLOCK_N=64, BLOCK_K=64, num_stages=3)],
}


# --w8 --int8 --sweep: tiles of the INT8 W8A8 kernel (``triton_int8_mm``) timed at every row count.
INT8_SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=8, num_warps=w, num_stages=s) for m, n, k, w, s in (
    (64, 128, 128, 4, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4), (128, 128, 64, 4, 5), (128, 256, 128, 8, 3),
    (128, 256, 64, 8, 4), (256, 128, 128, 8, 3), (64, 256, 128, 4, 4), (64, 64, 128, 4, 4), (16, 64, 256, 4, 4),
    (32, 64, 256, 4, 4), (32, 128, 128, 4, 4), (64, 64, 256, 4, 4))]


def tile_name(t):
    return f"{t['BLOCK_M']}x{t['BLOCK_N']}x{t['BLOCK_K']}w{t['num_warps']}s{t['num_stages']}"


# --gemv-sweep: the GEMV kernel's settings tried at one row, (BLOCK_N, num_warps, GEMV_STEP,
# GEMV_PROGRAMS_PER_SM)
GEMV_SWEEP = [(64, 4, 128, 4), (64, 4, 128, 8), (32, 4, 128, 8), (64, 2, 128, 8), (128, 4, 128, 4),
              (64, 4, 64, 4), (64, 4, 256, 4), (32, 2, 128, 16), (64, 8, 128, 4), (32, 4, 128, 4)]


def layer(k, n, dev, dtype, gen):
    q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // GROUP, n, device=dev, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // GROUP, n), device=dev, generator=gen).to(dtype)
    return pack_rows(q, 4), scales, zeros, (torch.arange(k, device=dev) // GROUP).to(torch.int32)


def sweep(rows, out):
    """For each row count, each SWEEP entry of its row tile: microseconds for the eight matrices
    (a configuration that fails to compile or to match the dequantized matmul is skipped); the
    fastest entry of each row tile written as one --knob argument to ``out/w4a16_best_knobs.txt``."""
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = {key: layer(k, n, dev, dtype, gen) for key, (k, n) in MATRICES.items()}
    refs = {key: dequantize(*layers[key], 4).float() for key in MATRICES}
    best = {}
    for m in rows:
        block_m = min(max(tw.TILES), max(16, 1 << (m - 1).bit_length()))
        default = dict(tw.TILES[block_m])
        xs = {k: torch.randn(m, k, device=dev, dtype=dtype, generator=gen) for k in {k for k, _ in MATRICES.values()}}
        timed = []
        try:
            for config in SWEEP.get(block_m, [dict()]):
                tw.TILES[block_m] = {**default, **config}
                try:
                    for key, (k, _) in MATRICES.items():
                        got = tw.w4a16_linear(xs[k], *layers[key], 4, None, GROUP).float()
                        ref = xs[k].float() @ refs[key]
                        assert ((got - ref).norm() / ref.norm()).item() < 1e-2, f"{key} wrong"
                    us = sum(graph_ms(lambda: tw.w4a16_linear(xs[k], *layers[key], 4, None, GROUP))
                             for key, (k, _) in MATRICES.items()) * 1e3
                except Exception as e:   # out of shared memory, registers, or wrong
                    print(f"sweep {m} rows {str(config):60s} failed: {str(e).splitlines()[0][:80]}")
                    continue
                timed.append((us, config))
                print(f"sweep {m} rows {str(config):60s} {us:7.1f} us")
        finally:
            tw.TILES[block_m] = default
        us, config = min(timed, key=lambda t: t[0])
        print(f"sweep best at {m} rows: {config or 'the default'} ({us:.1f} us)")
        best[block_m] = min(best.get(block_m, (us, config)), (us, config), key=lambda t: t[0])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "w4a16_best_knobs.txt"), "w") as f:
        f.write("--knob triton_w4a16.TILES=" + repr({b: c for b, (_, c) in best.items()}).replace(" ", ""))


def w8(rows, out, int8=False, sweep_tiles=False):
    """8-bit weights (a scale a row, ``quant.w8``), FP8: the W8A16 kernel (``w8a16_linear``)
    against W8A8 (per-token FP8 activations + ``torch._scaled_mm``, ``w8.fp8_linear``) and bf16
    cuBLAS; INT8 (``int8``): the W8A16 kernel (up to its MAX_M rows), the weight dequantized for
    cuBLAS and cuBLAS's INT8 matmul (``torch._int_mm``, the scales applied after it) against W8A8
    in the INT8 kernel (``w8.int8_linear``; with ``sweep_tiles``, also each of ``INT8_SWEEP``'s
    tiles). Us per matmul in a CUDA graph, summed over the eight matrices; the rows where each wins."""
    from pagoda.kernels.triton_int8_mm import int8_mm
    from pagoda.kernels.triton_ops import per_token_quant
    from pagoda.quant.w8 import fp8_linear, int8_linear, quantize_rows
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    table = []
    swept = [tile_name(t) for t in INT8_SWEEP]
    for m in rows:
        paths = (["bf16", "dequant", "w8a8"] + (["int_mm"] if m > 16 else [])   # (cuBLAS: over 16 rows)
                 + (["w8a16"] if m <= tw.MAX_M else []) + (swept if sweep_tiles else [])) if int8 \
            else ["bf16", "w8a16", "w8a8"]
        sums = dict.fromkeys(paths, 0.0)
        for (model, name), (k, n) in MATRICES.items():
            w = torch.randn(n, k, device=dev, dtype=dtype, generator=gen) * k ** -0.5
            if int8:
                scale = w.float().abs().amax(dim=1, keepdim=True) / 127
                w_q = (w.float() / scale).round().to(torch.int8)
            else:
                w_q, scale = quantize_rows(w)
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            ref = x.float() @ (w_q.float() * scale).t()
            fns = {"bf16": lambda: torch.nn.functional.linear(x, w),
                   "w8a16": lambda: tw.w8a16_linear(x, w_q, scale),
                   "dequant": lambda: torch.nn.functional.linear(x, w_q.to(dtype) * scale.to(dtype)),
                   "w8a8": lambda: (int8_linear if int8 else fp8_linear)(x, w_q, scale, None),
                   "int_mm": lambda: int_mm(x, w_q, scale)}
            fns.update({tile_name(t): lambda t=t: int8_mm(*per_token_quant(x, torch.int8), w_q, scale, None, dtype, t)
                        for t in INT8_SWEEP})
            for label in paths:
                fn = fns[label]
                try:
                    if label != "bf16":
                        err = ((fn().float() - ref).norm() / ref.norm()).item()
                        assert err < 5e-2, f"{label} {model} {name} at {m} rows: relative error {err:.1e}"
                    us = graph_ms(fn) * 1e3
                except Exception as e:   # a swept tile out of shared memory (or wrong): left out
                    if label not in swept:
                        raise
                    print(f"{label} at {m} rows failed: {str(e).splitlines()[0][:100]}")
                    us = float("inf")
                sums[label] += us
                table.append(dict(rows=m, model=model, matrix=name, path=label, us=us))
            del w, w_q, x, ref
        best = min((p for p in paths if p != "bf16"), key=sums.get)
        print(f"{'int8' if int8 else 'fp8'} at {m:5d} rows: " + ", ".join(f"{p} {sums[p]:8.1f} us" for p in paths
                                                                         if p not in swept) + f": {best} wins")
        for p in paths:
            if p in swept:
                print(f"  tile {p:20s} {sums[p]:9.1f} us")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "w8_int8.json" if int8 else "w8.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=table), f, indent=1)


def int_mm(x, w_q, scale):
    """INT8 W8A8 through cuBLAS (what ``w8.int8_linear`` ran in the thirty-third session)."""
    from pagoda.kernels.triton_ops import per_token_quant
    x_q, x_scale = per_token_quant(x, torch.int8)
    return torch._int_mm(x_q, w_q.t()).float().mul_(x_scale).mul_(scale.view(1, -1)).to(x.dtype)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--sweep", action="store_true", help="only time the TILES entries in SWEEP, by row count "
                   "(with --w8 --int8: time INT8_SWEEP's tiles as well)")
    p.add_argument("--w8", action="store_true", help="FP8 weights: the W8A16 kernel against W8A8 and bf16")
    p.add_argument("--int8", action="store_true", help="with --w8: INT8 weights, W8A8 on INT8 tensor cores")
    p.add_argument("--gemv-sweep", action="store_true", help="also time GEMV_SWEEP's tiles at one row")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    if args.w8:
        return w8(args.rows, args.out, args.int8, args.sweep)
    if args.sweep:
        return sweep(args.rows, args.out)
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    sweep_us = collections.defaultdict(float)
    print(f"{'matrix':22s} {'rows':>4s} {'bf16 cuBLAS':>11s} {'dequant+mm':>10s} {'W4A16':>7s} {'GB/s':>6s} "
          f"{'vs bf16':>7s} {'rel err':>8s} {'TC only':>7s}")
    for (model, name), (k, n) in MATRICES.items():
        qweight, scales, zeros, g_idx = layer(k, n, dev, dtype, gen)
        w_t = dequantize(qweight, scales, zeros, g_idx, 4).t().contiguous()   # (N, K), as F.linear takes it
        packed_bytes = qweight.numel() * 4 + 2 * scales.numel() * 2
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
            ref = x.float() @ w_t.float().t()
            out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            bf16 = graph_ms(lambda: torch.nn.functional.linear(x, w_t)) * 1e3
            deq = graph_ms(lambda: torch.nn.functional.linear(x, tw.dequantize(qweight, scales, zeros, g_idx, 4, GROUP,
                                                                                 dtype)))
            kern = graph_ms(lambda: tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)) * 1e3
            gemv, tw.GEMV = tw.GEMV, 0      # one row without the GEMV kernel: the tensor-core one
            tc = graph_ms(lambda: tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)) * 1e3
            tw.GEMV = gemv
            rate = packed_bytes / kern / 1e3
            rows.append(dict(model=model, matrix=name, k=k, n=n, rows=m, bf16_us=bf16, dequant_us=deq * 1e3,
                             w4a16_us=kern, tensor_core_us=tc, gbps=rate, rel_err=err))
            print(f"{model + ' ' + name:22s} {m:4d} {bf16:11.1f} {deq * 1e3:10.1f} {kern:7.1f} {rate:6.0f} "
                  f"{bf16 / kern:6.2f}x {err:8.1e} {tc:7.1f}")
            if m == 1 and args.gemv_sweep:
                for bn, warps, step, per_sm in GEMV_SWEEP:
                    saved = tw.GEMV_TILES, tw.GEMV_STEP, tw.GEMV_PROGRAMS_PER_SM
                    tw.GEMV_TILES = dict(BLOCK_N=bn, num_warps=warps)
                    tw.GEMV_STEP, tw.GEMV_PROGRAMS_PER_SM = step, per_sm
                    out = tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)
                    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
                    sweep_us[bn, warps, step, per_sm] += graph_ms(
                        lambda: tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)) * 1e3
                    tw.GEMV_TILES, tw.GEMV_STEP, tw.GEMV_PROGRAMS_PER_SM = saved
        torch.cuda.empty_cache()
    for m in args.rows:
        sel = [r for r in rows if r["rows"] == m]
        kern, deq = sum(r['w4a16_us'] for r in sel), sum(r['dequant_us'] for r in sel)
        print(f"all eight at {m} rows: bf16 {sum(r['bf16_us'] for r in sel):.1f} us, W4A16 {kern:.1f} us "
              f"(tensor-core kernel {sum(r['tensor_core_us'] for r in sel):.1f}), dequantize + cuBLAS {deq:.1f} us: "
              f"{'the kernel' if kern < deq else 'dequantize + cuBLAS'} wins (PACKED_MAX_M {tw.PACKED_MAX_M})")
    for tiles, us in sorted(sweep_us.items(), key=lambda t: t[1]):
        print(f"GEMV (BLOCK_N, warps, step, programs an SM) {tiles}: {us:.1f} us for the eight at one row")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w4a16.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
