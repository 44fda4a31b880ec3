"""Decode GEMMs of 64-256 rows: the tiled Triton GEMM (``pagoda.kernels.triton_gemm``) over a
sweep of tiles, pointer loads and TMA, against cuBLAS (``F.linear``). Each matmul follows a PDL
RMSNorm, as in a decode step, in one CUDA graph over enough copies of the weight that none is
still in L2 when its turn comes. Writes every time to ``$OUT/gemm_probe.json``.

  python3 benchmarks/gemm_probe.py
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pagoda.kernels import triton_gemm, triton_ops  # noqa: E402
from common import graph_ms  # noqa: E402  (the script's folder is on sys.path)

SHAPES = {"qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024),
          "qwen3 down": (1024, 3072), "llama qkv": (6144, 4096), "llama o": (4096, 4096),
          "llama gate_up": (28672, 4096), "llama down": (4096, 14336)}
ROWS = [64, 128, 256]
# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
TILES = [(64, 32, 128, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 3, 4), (64, 64, 128, 4, 4),
         (64, 128, 64, 4, 4), (64, 128, 128, 3, 4), (64, 256, 64, 3, 4), (128, 32, 128, 4, 4),
         (128, 64, 64, 4, 4), (128, 64, 128, 3, 4), (128, 128, 64, 3, 4), (128, 128, 64, 4, 8),
         (128, 128, 128, 3, 8), (128, 256, 64, 3, 8)]


def main():
    dev, dtype = "cuda", torch.bfloat16
    out_dir = os.environ.get("OUT", "results")
    os.makedirs(out_dir, exist_ok=True)
    rows_out = []
    print(f"{'shape':14s} {'M':>4s} {'cuBLAS':>7s} {'ptr':>7s} {'tma':>7s} {'best':>6s}  best ptr tile; best tma tile (us)")
    totals = {m: [0.0, 0.0] for m in ROWS}
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(8, (512 << 20) // nbytes)
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        norm_w = torch.ones(k, device=dev, dtype=dtype)
        for m in ROWS:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            ref = F.linear(x.float(), weights[0].float())
            t_norm = graph_ms(lambda: [triton_ops.rms_norm(x, norm_w, 1e-6) for _ in weights]) * 1e3 / copies

            def chain(mm):
                return graph_ms(lambda: [mm(triton_ops.rms_norm(x, norm_w, 1e-6), w) for w in weights]) * 1e3 / copies - t_norm

            t_cublas = chain(F.linear)
            times = {}
            for tile in TILES:
                bm, bn, bk, st, wp = tile
                for tma in (False, True):
                    def mm(a, w):
                        return triton_gemm.gemm(a, w, bm, bn, bk, st, wp, tma)
                    try:
                        err = ((mm(x, weights[0]).float() - ref).norm() / ref.norm()).item()
                        assert err < 1e-2, (name, m, tile, tma, err)
                        times[(tile, tma)] = chain(mm)
                    except triton_gemm.triton.runtime.errors.OutOfResources:
                        continue
            best = {tma: min(((t, tile) for (tile, f), t in times.items() if f == tma), default=(float("inf"), None))
                    for tma in (False, True)}
            t_best = min(best[False][0], best[True][0])
            totals[m][0] += t_cublas
            totals[m][1] += t_best
            rows_out.append({"shape": name, "n": n, "k": k, "m": m, "norm_us": t_norm, "cublas_us": t_cublas,
                             "triton_us": {f"{tile} {'tma' if tma else 'ptr'}": t for (tile, tma), t in times.items()}})
            print(f"{name:14s} {m:4d} {t_cublas:7.2f} {best[False][0]:7.2f} {best[True][0]:7.2f} "
                  f"{t_cublas / t_best:5.2f}x  {best[False][1]}; {best[True][1]}", flush=True)
        del weights
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "gemm_probe.json"), "w") as f:
        json.dump(rows_out, f, indent=1)
    for m, (c, t) in totals.items():
        print(f"all shapes, {m} rows: cuBLAS {c:.1f} us, Triton (best tile each) {t:.1f} us, {c / t:.2f}x")


if __name__ == "__main__":
    main()
