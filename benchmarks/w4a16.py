"""W5, the matmul alone: the W4A16 Triton kernel (``pagoda/kernels/triton_w4a16.py``) on the decode
matrices of Qwen3-0.6B and Llama-3-8B (4-bit, groups of 128), against what a bf16 model runs
(cuBLAS on the bf16 weight) and what quantized layers ran before it (dequantize the whole weight,
then cuBLAS). Microseconds per matmul in a CUDA graph, and the kernel's GB/s of packed weights
read. Needs a GPU.

  python benchmarks/w4a16.py [--rows 1 16 64] [--sweep]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import graph_ms  # noqa: E402
from pagoda.kernels import triton_w4a16 as tw  # noqa: E402
from pagoda.quant.int4 import dequantize, pack_rows  # noqa: E402

# (model, matrix): (K, N) of x @ W
MATRICES = {("qwen3-0.6b", "qkv"): (1024, 4096), ("qwen3-0.6b", "o"): (2048, 1024),
            ("qwen3-0.6b", "gate_up"): (1024, 6144), ("qwen3-0.6b", "down"): (3072, 1024),
            ("llama3-8b", "qkv"): (4096, 6144), ("llama3-8b", "o"): (4096, 4096),
            ("llama3-8b", "gate_up"): (4096, 28672), ("llama3-8b", "down"): (14336, 4096)}
GROUP = 128


# --sweep: tile configurations (the kernel module's constants), all eight matrices each
SWEEP = [dict(), dict(BLOCK_N=64), dict(BLOCK_N=128, NUM_WARPS=8), dict(BLOCK_K=256), dict(PROGRAMS_PER_SM=8),
         dict(NUM_STAGES=4), dict(BLOCK_N=32)]


def layer(k, n, dev, dtype, gen):
    q = torch.randint(0, 16, (k, n), device=dev, dtype=torch.int32, generator=gen)
    scales = (torch.rand(k // GROUP, n, device=dev, generator=gen) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // GROUP, n), device=dev, generator=gen).to(dtype)
    return pack_rows(q, 4), scales, zeros, (torch.arange(k, device=dev) // GROUP).to(torch.int32)


def sweep(rows, out):
    """Each configuration's microseconds for the eight matrices at each row count; the fastest
    (summed over the row counts) written as --knob arguments to ``out/w4a16_best_knobs.txt``."""
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    layers = {key: layer(k, n, dev, dtype, gen) for key, (k, n) in MATRICES.items()}
    xs = {(m, k): torch.randn(m, k, device=dev, dtype=dtype, generator=gen)
          for m in rows for k in {k for k, _ in MATRICES.values()}}
    default = {name: getattr(tw, name) for c in SWEEP for name in c}
    totals = []
    try:
        for config in SWEEP:
            for name, value in {**default, **config}.items():
                setattr(tw, name, value)
            per_rows = [sum(graph_ms(lambda: tw.w4a16_linear(xs[m, k], *layers[key], 4, None, GROUP))
                            for key, (k, _) in MATRICES.items()) * 1e3 for m in rows]
            totals.append((sum(per_rows), config))
            print(f"sweep {str(config):45s} " + "  ".join(f"{m} rows {t:6.1f} us" for m, t in zip(rows, per_rows)))
    finally:
        for name, value in default.items():
            setattr(tw, name, value)
    best = min(totals, key=lambda t: t[0])[1]
    print(f"sweep best: {best or 'the defaults'}")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "w4a16_best_knobs.txt"), "w") as f:
        f.write(" ".join(f"--knob triton_w4a16.{name}={int(value)}" for name, value in best.items()))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--sweep", action="store_true", help="only time the tile configurations in SWEEP")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    if args.sweep:
        return sweep(args.rows, args.out)
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    print(f"{'matrix':22s} {'rows':>4s} {'bf16 cuBLAS':>11s} {'dequant+mm':>10s} {'W4A16':>7s} {'GB/s':>6s} "
          f"{'vs bf16':>7s} {'rel err':>8s}")
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
            deq = graph_ms(lambda: torch.nn.functional.linear(x, dequantize(qweight, scales, zeros, g_idx, 4).t()))
            kern = graph_ms(lambda: tw.w4a16_linear(x, qweight, scales, zeros, g_idx, 4, None, GROUP)) * 1e3
            rate = packed_bytes / kern / 1e3
            rows.append(dict(model=model, matrix=name, k=k, n=n, rows=m, bf16_us=bf16, dequant_us=deq * 1e3,
                             w4a16_us=kern, gbps=rate, rel_err=err))
            print(f"{model + ' ' + name:22s} {m:4d} {bf16:11.1f} {deq * 1e3:10.1f} {kern:7.1f} {rate:6.0f} "
                  f"{bf16 / kern:6.2f}x {err:8.1e}")
        torch.cuda.empty_cache()
    for m in args.rows:
        sel = [r for r in rows if r["rows"] == m]
        print(f"all eight at {m} rows: bf16 {sum(r['bf16_us'] for r in sel):.1f} us, W4A16 "
              f"{sum(r['w4a16_us'] for r in sel):.1f} us, dequantize + matmul {sum(r['dequant_us'] for r in sel):.1f} us")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "w4a16.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
