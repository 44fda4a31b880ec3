"""Host time per eager launch, for steps that run outside CUDA graphs (prefill and mixed): W1's
prefill steps of Qwen3-0.6B take 32 ms of host time to queue their forward (about 300 kernels)
where the GPU needs about 31 ms (BENCHMARKS.md). Each op is queued many times without waiting for
the device; the host's microseconds per call are printed.

  python3 benchmarks/host_launch.py [--cprofile]   # with cProfile of 2,000 RMSNorm launches
"""
import sys

import torch
import torch.nn.functional as F

from common import host_seconds
from pagoda.kernels import triton_ops


def host_us(fn) -> float:
    return host_seconds(fn) * 1e6


def profile_launches(norm_w, calls: int = 2000) -> None:
    """cProfile of one Triton launch path (RMSNorm), repeated: where its host time goes."""
    import cProfile
    import pstats
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    triton_ops.rms_norm(x, norm_w, 1e-6, out=out)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        triton_ops.rms_norm(x, norm_w, 1e-6, out=out)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main():
    dev, dtype = "cuda", torch.bfloat16
    w = torch.randn(4096, 1024, device=dev, dtype=dtype)
    norm_w = torch.ones(1024, device=dev, dtype=dtype)
    ids = torch.zeros(16384, dtype=torch.long, device=dev)
    dst = torch.arange(0, 16384, 64, device=dev)
    src = torch.ones(dst.shape[0], dtype=torch.long, device=dev)
    print(f"{'op':44s} {'us/call (host)':>14s}")
    for m in (256, 16384):
        x = torch.randn(m, 1024, device=dev, dtype=dtype)
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            print(f"{f'F.linear {m}x1024 @ 1024x4096, {lib}':44s} {host_us(lambda: F.linear(x, w)):14.1f}")
        torch.backends.cuda.preferred_blas_library("cublas")
        print(f"{f'triton rms_norm, {m} rows':44s} {host_us(lambda: triton_ops.rms_norm(x, norm_w, 1e-6)):14.1f}")
        print(f"{f'torch.empty_like, {m} rows':44s} {host_us(lambda: torch.empty_like(x)):14.1f}")
    print(f"{'index_put (input_ids[dst] = src)':44s} {host_us(lambda: ids.__setitem__(dst, src)):14.1f}")
    if "--cprofile" in sys.argv:
        profile_launches(norm_w)


if __name__ == "__main__":
    main()
