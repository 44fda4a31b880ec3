"""One row of x against 4-bit GPTQ weights (a batch-1 decode step): can a GEMV that works on two
weights per instruction (bf16x2) read the weights nearer the copy rate than the merged GEMV
kernel (``triton_w4a16._w4a16_gemv_kernel``)?

Variants, each timed over the decode matrices of Llama-3-8B and Qwen3-0.6B (groups of 128),
ten launches a CUDA graph over ten copies of the weight (L2 cold), us per launch, with the
relative error against the float32 product:
  - gemv:     the merged kernel;
  - fp32:     the probe's kernel in float32 math: a K step of whole groups (a row of scales and
              zeros a group), each value made a float through the mantissa of 2^23;
  - TILES:    the probe's kernel with each word's eight values in inline PTX (BF16X2_ASM): two
              values at a time masked into bf16 (128 + q), the zero subtracted and the x
              multiplied in bf16x2 (exact, then rounded once a product), the word's four pair
              sums added in bf16 and the two halves once in fp32; the group's scale in fp32.
              Labelled BLOCK_N x warps, pipeline stages, groups a K step, "pf" (the next step's
              words loaded into registers instead of a shared-memory pipeline), programs an SM;
  - bf16:     cuBLAS on the bf16 weight.
Results: BENCHMARKS.md, forty-fourth session. The best variant is the engine's GEMV since the
forty-fifth (``pagoda/kernels/triton_w4a16.py``).

  python3 benchmarks/gemv_probe.py [--ncu]
"""
import argparse

import torch
import triton
import triton.language as tl

from common import graph_ms
from w4a16 import GROUP, MATRICES, layer as weights
from pagoda.kernels import triton_w4a16 as tw
from pagoda.kernels.triton_utils import num_sms
from pagoda.quant.int4 import dequantize

COPIES = 10

# Eight 4-bit values of a word in bf16x2 instructions, and a 16-bit float's bits: the engine's
BF16X2_ASM, _bits16 = tw.BF16X2_ASM, tw._bits16


@triton.jit
def _load_words(qweight_ptr, k0, k_hi, g3, r3, offs_n3, n_ok3, stride_w, GROUP_K: tl.constexpr):
    """The words of K step ``k0``: (groups, word rows of a group, columns)."""
    rows = k0 // 8 + g3 * (GROUP_K // 8) + r3
    return tl.load(qweight_ptr + rows.to(tl.int64) * stride_w + offs_n3,
                   mask=n_ok3 & (k0 + g3 * GROUP_K < k_hi), other=0)


@triton.jit
def _step(acc, words, k0, k_hi, x_ptr, scales_ptr, zeros_ptr, g3, r3, offs_n3, n_ok3, stride_sg,
          GROUP_K: tl.constexpr, BF16X2: tl.constexpr):
    g_ok = (k0 + g3 * GROUP_K < k_hi)
    sz = (k0 // GROUP_K + g3) * stride_sg + offs_n3
    s = tl.load(scales_ptr + sz, mask=n_ok3 & g_ok, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + sz, mask=n_ok3 & g_ok, other=0.0).to(tl.float32)
    xk = x_ptr + k0 + g3 * GROUP_K + r3 * 8
    if BF16X2:
        nz = _bits16((-(z + 128.0)).to(tl.bfloat16))
        x0 = _bits16(tl.load(xk, mask=g_ok)) | (_bits16(tl.load(xk + 4, mask=g_ok)) << 16)
        x1 = _bits16(tl.load(xk + 1, mask=g_ok)) | (_bits16(tl.load(xk + 5, mask=g_ok)) << 16)
        x2 = _bits16(tl.load(xk + 2, mask=g_ok)) | (_bits16(tl.load(xk + 6, mask=g_ok)) << 16)
        x3 = _bits16(tl.load(xk + 3, mask=g_ok)) | (_bits16(tl.load(xk + 7, mask=g_ok)) << 16)
        part = tl.inline_asm_elementwise(BF16X2_ASM, "=r,r,r,r,r,r,r", [words, nz | (nz << 16), x0, x1, x2, x3],
                                         dtype=tl.int32, is_pure=True, pack=1)
        acc += part.to(tl.float32, bitcast=True) * s
    else:
        zm = z + 8388608.0
        tile = tl.zeros(acc.shape, tl.float32)
        for j in tl.static_range(8):
            x = tl.load(xk + j, mask=g_ok, other=0.0).to(tl.float32)
            qf = (((words >> (j * 4)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            tile += (qf - zm) * x
        acc += tile * s
    return acc


@triton.jit
def _group_gemv_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, N, K, k_per_split, stride_w, stride_sg,
                       stride_os, GROUP_K: tl.constexpr, STEP_GROUPS: tl.constexpr, BLOCK_N: tl.constexpr,
                       NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, BF16X2: tl.constexpr):
    KP: tl.constexpr = GROUP_K // 8
    STEP: tl.constexpr = GROUP_K * STEP_GROUPS
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n3 = offs_n[None, None, :]
    n_ok3 = offs_n3 < N
    g3 = tl.arange(0, STEP_GROUPS)[:, None, None]
    r3 = tl.arange(0, KP)[None, :, None]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([STEP_GROUPS, KP, BLOCK_N], tl.float32)
    if PREFETCH:   # the next step's words loaded before this step's are summed: registers, no pipeline
        w_next = _load_words(qweight_ptr, k_lo, k_hi, g3, r3, offs_n3, n_ok3, stride_w, GROUP_K)
        for k0 in tl.range(k_lo, k_hi, STEP, num_stages=1):
            words = w_next
            w_next = _load_words(qweight_ptr, k0 + STEP, k_hi, g3, r3, offs_n3, n_ok3, stride_w, GROUP_K)
            acc = _step(acc, words, k0, k_hi, x_ptr, scales_ptr, zeros_ptr, g3, r3, offs_n3, n_ok3, stride_sg,
                        GROUP_K, BF16X2)
    else:
        for k0 in tl.range(k_lo, k_hi, STEP, num_stages=NUM_STAGES):
            words = _load_words(qweight_ptr, k0, k_hi, g3, r3, offs_n3, n_ok3, stride_w, GROUP_K)
            acc = _step(acc, words, k0, k_hi, x_ptr, scales_ptr, zeros_ptr, g3, r3, offs_n3, n_ok3, stride_sg,
                        GROUP_K, BF16X2)
    out = tl.sum(tl.sum(acc, axis=1), axis=0)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + offs_n, out.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def group_gemv(x, qweight, scales, zeros, block_n=64, num_warps=4, num_stages=3, bf16x2=True, step_groups=1,
               prefetch=False, programs_per_sm=4):
    k, n = x.shape[1], scales.shape[1]
    col_tiles = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, GROUP * step_groups)
    split = max(1, min(16, steps, triton.cdiv(programs_per_sm * num_sms(x.device), col_tiles)))
    k_per_split = triton.cdiv(steps, split) * GROUP * step_groups
    split = triton.cdiv(k, k_per_split)
    out = torch.empty(split, n, device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    _group_gemv_kernel[(col_tiles, split)](x, qweight, scales, zeros, out, n, k, k_per_split, qweight.stride(0),
                                           scales.stride(0), out.stride(0), GROUP_K=GROUP, STEP_GROUPS=step_groups,
                                           BLOCK_N=block_n, NUM_STAGES=num_stages, PREFETCH=prefetch, BF16X2=bf16x2,
                                           num_warps=num_warps)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)


# (BLOCK_N, num_warps, num_stages, groups a K step, register prefetch, programs an SM), all bf16x2
TILES = [(64, 4, 3, 1, False, 4), (64, 4, 5, 1, False, 4), (64, 4, 3, 2, False, 4), (64, 4, 3, 1, False, 8),
         (64, 4, 1, 1, True, 4), (64, 4, 1, 2, True, 4), (64, 4, 1, 4, True, 4), (32, 4, 1, 4, True, 4),
         (128, 4, 1, 2, True, 4), (64, 8, 1, 4, True, 4), (64, 4, 1, 2, True, 8), (32, 2, 1, 2, True, 8),
         (128, 8, 1, 2, True, 4), (64, 4, 4, 2, False, 8)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ncu", action="store_true", help="one launch of each variant on Llama's gate_up, for ncu")
    args = p.parse_args()
    dev, dtype = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    if args.ncu:
        k, n = MATRICES["llama3-8b", "gate_up"]
        w = weights(k, n, dev, dtype, gen)
        x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
        for _ in range(3):
            tw.w4a16_linear(x, *w, 4, None, GROUP)
            group_gemv(x, *w[:3], 64, 4, 3, True, 1, False)
            group_gemv(x, *w[:3], 64, 4, 1, True, 2, True)
        torch.cuda.synchronize()
        return
    sums = {}
    print(f"{'model':11s} {'matrix':8s} {'variant':22s} {'us':>7s} {'GB/s':>7s} {'rel err':>8s}")
    for (model, name), (k, n) in MATRICES.items():
        ws = [weights(k, n, dev, dtype, gen) for _ in range(COPIES)]
        x = torch.randn(1, k, device=dev, dtype=dtype, generator=gen)
        ref = (x.float() @ dequantize(*ws[0], 4).float())[0]
        dense = [dequantize(*w, 4).t().contiguous() for w in ws[:COPIES]]
        nbytes = ws[0][0].numel() * 4 + ws[0][1].numel() * 4
        variants = {"gemv": lambda w: tw.w4a16_linear(x, *w, 4, None, GROUP)}
        variants["fp32 64x4w3s"] = lambda w: group_gemv(x, *w[:3], bf16x2=False)
        for t in TILES:
            bn, nw, ns, ig, pf, pps = t
            variants[f"{bn}x{nw}w{ns}s g{ig}{' pf' if pf else ''} p{pps}"] = (
                lambda w, bn=bn, nw=nw, ns=ns, ig=ig, pf=pf, pps=pps: group_gemv(x, *w[:3], bn, nw, ns, True, ig, pf,
                                                                                pps))
        for label, fn in variants.items():
            try:
                err = ((fn(ws[0]).float().flatten() - ref).norm() / ref.norm()).item()
                us = graph_ms(lambda: [fn(w) for w in ws], rep=50) * 1e3 / COPIES
            except Exception as e:
                print(f"{model:11s} {name:8s} {label:22s} failed: {str(e).splitlines()[0][:90]}")
                continue
            sums[label] = sums.get(label, 0.0) + us
            print(f"{model:11s} {name:8s} {label:22s} {us:7.2f} {nbytes / us / 1e3:7.0f} {err:8.1e}", flush=True)
        us = graph_ms(lambda: [torch.nn.functional.linear(x, d) for d in dense], rep=50) * 1e3 / COPIES
        sums["bf16"] = sums.get("bf16", 0.0) + us
        print(f"{model:11s} {name:8s} {'bf16 cuBLAS':22s} {us:7.2f}", flush=True)
        ws = dense = None
    print("\nsum over the eight matrices, us:")
    for label, us in sorted(sums.items(), key=lambda t: t[1]):
        print(f"  {label:22s} {us:8.1f}")


if __name__ == "__main__":
    main()
