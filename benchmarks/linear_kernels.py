"""Decode matmuls on the GPU: pagoda's small-batch Triton kernel (``pagoda.kernels.triton_linear``)
against cuBLAS (``F.linear``), as they run in a decode step's CUDA graph.

Each case captures one graph of back-to-back matmuls over enough copies of the weight (>= 512 MB
in all) that none is still in L2 when its turn comes, as in a real step where every layer has
its own weights; time per matmul = graph replay time / copies. Shapes: the linear layers of
Qwen3-0.6B and Llama-3-8B, including the large ones the engine leaves to cuBLAS; batch 1-4 (the rows the kernel takes; the engine uses it at batch 1
only), bf16.

  python3 benchmarks/linear_kernels.py           # cuBLAS against the kernel, 1-4 rows
  python3 benchmarks/linear_kernels.py --sweep   # the kernel's slab size and warps, one row
  python3 benchmarks/linear_kernels.py --blas    # cuBLAS against cuBLASLt at 16-256 rows
  python3 benchmarks/linear_kernels.py --inductor  # cuBLAS against inductor's max-autotune at 64-256 rows
"""
import sys

import torch
import torch.nn.functional as F
import triton

from common import graph_ms
from pagoda.kernels import triton_linear

SHAPES = {"qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024),
          "qwen3 down": (1024, 3072), "llama qkv": (6144, 4096), "llama o": (4096, 4096),
          "llama gate_up": (28672, 4096), "llama down": (4096, 14336), "llama lm_head": (128256, 4096),
          "qwen3 lm_head": (151936, 1024)}
BATCHES = [1, 2, 4]


def graph_time_us(fn, copies: int) -> float:
    return graph_ms(fn) * 1e3 / copies


def sweep(dev, dtype):
    """One row: the kernel's slab size and warps (triton_linear.SLAB_ELEMENTS, SLAB_WARPS) on
    every shape, the three fastest against the default."""
    default = (triton_linear.SLAB_ELEMENTS, triton_linear.SLAB_WARPS)
    try:
        for name, (n, k) in SHAPES.items():
            nbytes = n * k * 2
            copies = max(8, (512 << 20) // nbytes)
            weights = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
            x = torch.randn(1, k, device=dev, dtype=dtype)
            times = {}
            for slab in (4096, 8192, 16384, 32768):
                for warps in (4, 8, 16):
                    if slab // min(triton.next_power_of_2(k), triton_linear.CHUNK_K) > 64 or slab // (32 * warps) > 128:
                        continue  # the kernel caps BLOCK_N at 64; over 128 elements a thread spills
                    triton_linear.SLAB_ELEMENTS, triton_linear.SLAB_WARPS = slab, warps
                    try:
                        times[(slab, warps)] = graph_time_us(
                            lambda: [triton_linear.small_m_linear(x, w) for w in weights], copies)
                    except Exception as e:  # out of resources
                        print(f"{name}: slab {slab} warps {warps}: {type(e).__name__}")
            best = sorted(times.items(), key=lambda kv: kv[1])[:3]
            line = "  ".join(f"slab {s:5d} warps {w:2d}: {t:7.2f} us {nbytes / t / 1e3:5.0f}" for (s, w), t in best)
            print(f"{name:14s} default {times.get(default, float('nan')):7.2f} us | {line}", flush=True)
            del weights
            torch.cuda.empty_cache()
    finally:
        triton_linear.SLAB_ELEMENTS, triton_linear.SLAB_WARPS = default


def layer_gemms(dev, dtype, batch_rows):
    """(matrix name, rows, input, copies of the weight) for each layer matrix of both models at
    each batch size: enough copies (512 MB) that a timed graph reads its weights from memory,
    not from the L2 cache."""
    for name, (n, k) in SHAPES.items():
        if "lm_head" in name:
            continue
        copies = max(8, (512 << 20) // (n * k * 2))
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        for m in batch_rows:
            yield name, m, torch.randn(m, k, device=dev, dtype=dtype), weights
        del weights
        torch.cuda.empty_cache()


def blas_libraries(dev, dtype):
    """The decode GEMMs at W1's batch sizes through each BLAS library torch can call (cuBLAS,
    cuBLASLt): at Qwen3-0.6B's small matrices a GEMM takes 5-6 us in the engine where its
    weights take 1-3 us to read."""
    default = torch.backends.cuda.preferred_blas_library()
    names = ["cublas", "cublaslt"]
    print(f"{'shape':14s} {'M':>4s} " + " ".join(f"{n + ' us':>12s}" for n in names))
    try:
        for name, m, x, weights in layer_gemms(dev, dtype, (16, 64, 256)):
            times = []
            for lib in names:
                torch.backends.cuda.preferred_blas_library(lib)
                times.append(graph_time_us(lambda: [F.linear(x, w) for w in weights], len(weights)))
            print(f"{name:14s} {m:4d} " + " ".join(f"{t:12.2f}" for t in times), flush=True)
    finally:
        torch.backends.cuda.preferred_blas_library(default)


def inductor_autotune(dev, dtype):
    """The decode GEMMs at W1's batch sizes: cuBLAS against whatever torch.compile's max-autotune
    picks among its Triton templates (persistent TMA ones included) and cuBLAS itself. A
    template that beats cuBLAS is a GEMM that could also wait under programmatic dependent
    launch, which cuBLAS's kernels do not (``pdl_gemm_probe.py``)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code
    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    inductor_config.triton.enable_persistent_tma_matmul = True
    rows = []
    for name, m, x, weights in layer_gemms(dev, dtype, (64, 128, 256)):
        torch._dynamo.reset()
        compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        out, code = run_and_get_code(compiled, x, weights[0])
        # every module imports extern_kernels; only a call of its mm means cuBLAS won
        picked = "cuBLAS" if "extern_kernels.mm(" in "".join(code) else "Triton"
        err = ((out.float() - F.linear(x.float(), weights[0].float())).norm()
               / F.linear(x.float(), weights[0].float()).norm()).item()
        assert err < 1e-2, (name, m, err)
        t_cublas = graph_time_us(lambda: [F.linear(x, w) for w in weights], len(weights))
        t_ind = graph_time_us(lambda: [compiled(x, w) for w in weights], len(weights))
        rows.append((name, m, t_cublas, t_ind, picked))
        print(f"{name:14s} {m:4d} cuBLAS {t_cublas:8.2f} us  inductor {t_ind:8.2f} us ({picked})", flush=True)
    print(f"\n{'shape':14s} {'M':>4s} {'cuBLAS us':>9s} {'inductor us':>11s} {'picked':>7s} {'speed-up':>8s}")
    for name, m, tc, ti, picked in rows:
        print(f"{name:14s} {m:4d} {tc:9.2f} {ti:11.2f} {picked:>7s} {tc / ti:7.2f}x")
    for m in (64, 128, 256):
        tc = sum(r[2] for r in rows if r[1] == m)
        ti = sum(r[3] for r in rows if r[1] == m)
        print(f"{'all eight':14s} {m:4d} {tc:9.2f} {ti:11.2f} {'':>7s} {tc / ti:7.2f}x")


def main():
    dev, dtype = "cuda", torch.bfloat16
    if "--sweep" in sys.argv:
        return sweep(dev, dtype)
    if "--blas" in sys.argv:
        return blas_libraries(dev, dtype)
    if "--inductor" in sys.argv:
        return inductor_autotune(dev, dtype)
    print(f"{'shape':14s} {'M':>3s} {'cuBLAS us':>9s} {'GB/s':>6s} {'Triton us':>9s} {'GB/s':>6s} {'speed-up':>8s}")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(8, (512 << 20) // nbytes)
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * k ** -0.5 for _ in range(copies)]
        for m in BATCHES:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            err = ((triton_linear.small_m_linear(x, weights[0]).float() - F.linear(x.float(), weights[0].float())).norm()
                   / F.linear(x.float(), weights[0].float()).norm()).item()
            assert err < 1e-2, (name, m, err)
            t_cublas = graph_time_us(lambda: [F.linear(x, w) for w in weights], copies)
            t_triton = graph_time_us(lambda: [triton_linear.small_m_linear(x, w) for w in weights], copies)
            print(f"{name:14s} {m:3d} {t_cublas:9.2f} {nbytes / t_cublas / 1e3:6.0f} {t_triton:9.2f} "
                  f"{nbytes / t_triton / 1e3:6.0f} {t_cublas / t_triton:7.2f}x", flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
