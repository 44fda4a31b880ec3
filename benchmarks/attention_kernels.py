"""Micro-benchmark of the Triton paged-attention kernels on the GPU (made for the H200).

For each shape it first checks the Triton kernel against the torch reference (fp32 reference
from the same bf16 inputs, relative error < 1e-2), then times with ``triton.testing.do_bench``
(median; it flushes the L2 before every run):
  - triton:    ``paged_attention_triton`` over a paged cache (block size 16, shuffled blocks)
  - reference: ``reference.paged_attention`` (the torch oracle, same paged inputs)
  - sdpa:      ``torch.nn.functional.scaled_dot_product_attention`` over DENSE contiguous K/V
               (no paging; the ceiling a paged kernel is measured against)
Shapes: decode of batch 1/8/64/256 over 512- and 4000-token contexts, and a causal prefill of
8 x 1024 tokens, for Llama-3-8B heads (32 q, 8 kv, head_dim 128) and Qwen3-0.6B heads (16 q,
8 kv, head_dim 128). Decode reports GB/s of KV read (batch * ctx * kv_heads * head_dim * 2 * 2
bytes over the time), prefill TFLOP/s (4 * B * H * D * L(L+1)/2 causal FLOPs over the time).
Then a small tuning sweep (tile shapes, flash-decoding split) unless ``--no-tune``.

Run from the repository root:  OUT=/some/dir python benchmarks/attention_kernels.py
Prints tables; writes ``$OUT/attention_kernels.json`` when OUT is set. About 1-2 min on an H200.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from common import graph_ms
from pagoda.kernels import reference
from pagoda.kernels import triton_attention as ta

MODELS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # q heads, kv heads, head_dim
DECODE_BATCHES = [1, 8, 64, 256]
DECODE_CONTEXTS = [512, 4000]
PREFILL_BATCH, PREFILL_LEN = 8, 1024
BLOCK_SIZE = 16
DEVICE = "cuda"
KV_DTYPE = None   # --kv-fp8: the cases' caches in FP8 (E4M3, scale 1)


def bench(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


class Case:
    """One attention problem: paged inputs for Triton and the reference, dense ones for SDPA.
    All requests have the same context ``ctx``; the last ``q_len`` positions are queries."""

    def __init__(self, batch, q_len, ctx, num_heads, num_kv_heads, head_dim, dtype, gen,
                 block_size=BLOCK_SIZE, heads_outer=False):
        self.batch, self.q_len, self.ctx = batch, q_len, ctx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        blocks_per_seq = triton.cdiv(ctx, block_size)
        num_blocks = batch * blocks_per_seq
        dev = DEVICE
        if heads_outer:  # each (block, KV head) one contiguous run of tokens: seen through a view
            self.kv_cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, device=dev,
                                        dtype=dtype, generator=gen).transpose(2, 3)
        else:
            self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim,
                                        device=dev, dtype=dtype, generator=gen)
        if KV_DTYPE is not None:
            self.kv_cache = reference.quantize_kv_cache(self.kv_cache, KV_DTYPE)
        # Shuffled physical blocks, as in a cache after some churn.
        self.tables = torch.randperm(num_blocks, device=dev, generator=gen).view(
            batch, blocks_per_seq).to(torch.int32)
        self.query = torch.randn(batch * q_len, num_heads, head_dim, device=dev, dtype=dtype,
                                 generator=gen)
        self.seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        self.qsl = (torch.arange(batch + 1, device=dev) * q_len).to(torch.int32)
        self.out = torch.empty_like(self.query)
        self.scale = head_dim ** -0.5

    def triton(self, **kw):
        return ta.paged_attention_triton(self.query, self.kv_cache, self.tables, self.seq_lens,
                                         self.qsl, self.scale, self.ctx, self.q_len, out=self.out,
                                         **kw)

    def reference(self, fp32=False):
        cast = (lambda t: t.float()) if fp32 else (lambda t: t)
        cache = self.kv_cache if self.kv_cache.element_size() == 1 else cast(self.kv_cache)  # (FP8: its own layout)
        return reference.paged_attention(cast(self.query), cache, self.tables,
                                         self.seq_lens, self.qsl, self.scale, self.ctx, self.q_len)

    def make_dense(self):
        """Contiguous (B, H, L, D) tensors for SDPA, gathered once through the block tables."""
        k, v = reference.gather_context(self.kv_cache, self.tables, self.ctx)
        self.k_dense = k.transpose(1, 2).contiguous()
        self.v_dense = v.transpose(1, 2).contiguous()
        self.q_dense = self.query.view(self.batch, self.q_len, self.num_heads,
                                       self.head_dim).transpose(1, 2).contiguous()

    def sdpa(self):
        # Decode: one query at the last position sees everything, no mask needed. Prefill
        # (q_len == ctx): plain causal.
        return F.scaled_dot_product_attention(self.q_dense, self.k_dense, self.v_dense,
                                              is_causal=self.q_len > 1, scale=self.scale,
                                              enable_gqa=True)

    def set_lengths(self, lens):
        """Ragged contexts (each <= ctx, the tables' reach) instead of ctx for every request."""
        self.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    def kv_bytes(self) -> int:
        return (int(self.seq_lens.sum()) * self.num_kv_heads * self.head_dim * 2
                * self.kv_cache.element_size())

    def flops(self) -> float:
        # causal: query j of q_len (at position ctx - q_len + j) sees ctx - q_len + j + 1 keys
        pairs = sum(self.ctx - self.q_len + j + 1 for j in range(self.q_len))
        return 4.0 * self.batch * self.num_heads * self.head_dim * pairs


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (read + write) on 2 GiB, the memory ceiling for decode."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * (2 << 30) / ms / 1e6


def run_case(kind, model, case, rows, log):
    ref = case.reference(fp32=True)
    case.out.fill_(float("nan"))
    err = rel_err(case.triton(), ref)
    ok = not case.out.isnan().any().item() and err < 1e-2
    case.make_dense()
    sdpa_err = rel_err(case.sdpa().transpose(1, 2).reshape(ref.shape), ref)
    del ref
    if kind == "decode":
        work, unit = case.kv_bytes() / 1e9, "GB/s"
        label = f"decode b={case.batch:<3d} ctx={case.ctx:<5d}"
    else:
        work, unit = case.flops() / 1e12, "TFLOP/s"
        label = f"prefill {case.batch}x{case.q_len}"
    timings = {"triton": bench(case.triton), "reference": bench(case.reference),
               "sdpa": bench(case.sdpa)}
    row = dict(kind=kind, model=model, batch=case.batch, q_len=case.q_len, ctx=case.ctx,
               rel_err=err, correct=ok, sdpa_rel_err=sdpa_err, unit=unit,
               num_segments=ta._pick_num_segments(case.batch * case.num_kv_heads, case.q_len,
                                                  case.ctx, case.query.device))
    for impl, ms in timings.items():
        row[f"{impl}_ms"] = ms
        row[f"{impl}_rate"] = work / (ms / 1e3)
    rows.append(row)
    log(f"{model:11s} {label:24s} {row['triton_ms'] * 1e3:9.1f} {row['triton_rate']:9.1f} "
        f"{row['reference_ms'] * 1e3:10.1f} {row['reference_rate']:9.1f} "
        f"{row['sdpa_ms'] * 1e3:9.1f} {row['sdpa_rate']:9.1f}  {unit:7s} {row['num_segments']:3d} "
        f"{err:8.1e} {'ok' if ok else 'FAIL'}")
    del case.k_dense, case.v_dense, case.q_dense


def tune(dtype, gen, log, deadline):
    """Time a few alternatives to the default tiles / split settings (module globals of
    triton_attention, read at each call)."""
    results = []
    default_tiles = dict(ta.TILES)
    default_split = ta.SPLIT_PROGRAMS_PER_SM, ta.SPLIT_MIN_TOKENS
    heads = MODELS["llama3-8b"]

    def trial(name, case, setting, **kw):
        if time.time() > deadline:  # keep the whole run inside its time budget
            log(f"  {name:24s} {setting:46s} skipped (time budget)")
            return
        try:
            ms = bench(lambda: case.triton(**kw))
            rate = (case.kv_bytes() / 1e9 if case.q_len == 1 else case.flops() / 1e12) / (ms / 1e3)
        except Exception as e:  # e.g. out of shared memory for a config
            ms = rate = float("nan")
            log(f"  {name}: {setting}: failed: {type(e).__name__}: {str(e)[:80]}")
        results.append(dict(case=name, setting=setting, ms=ms, rate=rate))
        log(f"  {name:24s} {setting:46s} {ms * 1e3:9.1f} us {rate:9.1f}")

    log("\nTuning (llama3-8b heads; rate in GB/s for decode, TFLOP/s for prefill)")
    try:
        for batch in (1, 8, 64):
            case = Case(batch, 1, 4000, *heads, dtype, gen)
            name = f"decode b={batch} ctx=4000"
            for tile_n, warps, stages in [(64, 4, 3), (32, 4, 3), (128, 4, 2), (64, 4, 4),
                                          (64, 8, 3), (128, 8, 3)]:
                ta.TILES[16] = dict(TILE_N=tile_n, num_warps=warps, num_stages=stages)
                trial(name, case, f"BLOCK_M=16 TILE_N={tile_n} warps={warps} stages={stages}")
            ta.TILES[16] = default_tiles[16]
            if batch <= 8:  # flash-decoding split: off, then a few (programs/SM, min tokens)
                trial(name, case, "no split (num_segments=1)", num_segments=1)
                for per_sm, min_tokens in [(1, 128), (2, 128), (2, 64), (4, 64), (8, 32)]:
                    ta.SPLIT_PROGRAMS_PER_SM, ta.SPLIT_MIN_TOKENS = per_sm, min_tokens
                    segments = ta._pick_num_segments(batch * heads[1], 1, 4000, case.query.device)
                    trial(name, case, f"SPLIT_PROGRAMS_PER_SM={per_sm} SPLIT_MIN_TOKENS="
                          f"{min_tokens} (seg={segments})")
                ta.SPLIT_PROGRAMS_PER_SM, ta.SPLIT_MIN_TOKENS = default_split
            del case
        case = Case(PREFILL_BATCH, PREFILL_LEN, PREFILL_LEN, *heads, dtype, gen)
        name = f"prefill {PREFILL_BATCH}x{PREFILL_LEN}"
        for block_m, tile_n, warps, stages in [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3),
                                               (128, 128, 8, 2), (128, 64, 4, 3), (64, 64, 4, 3),
                                               (64, 128, 4, 2)]:
            ta.TILES = {k: v for k, v in default_tiles.items() if k < block_m}
            ta.TILES[block_m] = dict(TILE_N=tile_n, num_warps=warps, num_stages=stages)
            trial(name, case, f"BLOCK_M={block_m} TILE_N={tile_n} warps={warps} stages={stages}")
    finally:
        ta.TILES = default_tiles
        ta.SPLIT_PROGRAMS_PER_SM, ta.SPLIT_MIN_TOKENS = default_split
    return results


PREFILL_TILES = [  # (BLOCK_M, TILE_N, warps, stages); the first is the default
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2),
    (128, 64, 4, 3), (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)]


def tune_prefill(dtype, gen, log):
    """Prefill attention, TFLOP/s: fresh causal prefills (8 x 1,024, 2 x 4,096) against dense
    SDPA on contiguous K/V, and a chunk of 512 queries over a 1,536-token cached prefix, for
    the prefill tiles of PREFILL_TILES (the first is the default)."""
    default_tiles = dict(ta.TILES)
    log("Prefill attention, TFLOP/s (causal FLOPs); BLOCK_M,TILE_N,warps,stages")
    try:
        for model, heads in MODELS.items():
            for batch, q_len, ctx in [(8, 1024, 1024), (2, 4096, 4096), (4, 512, 2048)]:
                case = Case(batch, q_len, ctx, *heads, dtype, gen)
                err = rel_err(case.triton(), case.reference(fp32=True))
                line = f"{model:11s} {batch}x{q_len} ctx {ctx:5d} (err {err:.1e})"
                if q_len == ctx:
                    case.make_dense()
                    line += f" sdpa {case.flops() / 1e12 / (bench(case.sdpa) / 1e3):6.1f} |"
                    del case.k_dense, case.v_dense, case.q_dense
                for block_m, tile_n, warps, stages in PREFILL_TILES:
                    ta.TILES = {k: v for k, v in default_tiles.items() if k < block_m}
                    ta.TILES[block_m] = dict(TILE_N=tile_n, num_warps=warps, num_stages=stages)
                    try:
                        rate = f"{case.flops() / 1e12 / (bench(case.triton) / 1e3):6.1f}"
                    except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                        rate = type(e).__name__[:6]
                    line += f" {block_m},{tile_n},{warps},{stages}: {rate}"
                ta.TILES = dict(default_tiles)
                log(line)
                del case
                torch.cuda.empty_cache()
    finally:
        ta.TILES = default_tiles


def tune_split(dtype, gen, log):
    """Flash-decoding at small and medium batches: does splitting the context (more, shorter
    programs) beat one program per (request, KV head)? Timed in a CUDA graph."""
    results = []
    log("\nSplit-KV at medium batch (GB/s of KV read)")
    for model, batch, ctx in [("llama3-8b", 16, 1536), ("llama3-8b", 64, 640), ("llama3-8b", 128, 1024),
                              ("llama3-8b", 256, 1024), ("qwen3-0.6b", 8, 1536), ("qwen3-0.6b", 16, 1536),
                              ("qwen3-0.6b", 24, 1536), ("qwen3-0.6b", 32, 1536), ("qwen3-0.6b", 40, 1536), ("qwen3-0.6b", 64, 1024), ("qwen3-0.6b", 128, 1536),
                              ("qwen3-0.6b", 256, 256), ("llama3-8b", 256, 256)]:
        case = Case(batch, 1, ctx, *MODELS[model], dtype, gen)
        line = f"  {model:10s} b={batch:<3d} ctx={ctx:<5d} (default {ta._pick_num_segments(batch * MODELS[model][1], 1, ctx, case.query.device)}):"
        for seg in (1, 2, 4, 8, 16):
            ms = graph_ms(lambda: case.triton(num_segments=seg), 25, 100)
            rate = case.kv_bytes() / 1e9 / (ms / 1e3)
            results.append(dict(model=model, batch=batch, ctx=ctx, segments=seg, ms=ms, rate=rate))
            line += f"  seg {seg}: {ms * 1e3:6.1f} us {rate:5.0f}"
        case.make_dense()
        ms = graph_ms(case.sdpa, 25, 100)
        line += f"  dense SDPA: {ms * 1e3:6.1f} us {case.kv_bytes() / 1e9 / (ms / 1e3):5.0f}"
        log(line)
        del case
        torch.cuda.empty_cache()
    return results


def time_spec(dtype, gen, log):
    """Speculative decoding's verification: k + 1 queries a request against its context, one
    program per (request, KV head) against the context split as a decode's is (the engine's
    choice since the twenty-fifth session), in a CUDA graph; a plain decode for reference."""
    log("\nVerification attention, k + 1 queries a request: us per call (unsplit / the engine's split)")
    for model in ("llama3-8b", "qwen3-0.6b"):
        for batch, ctx in [(1, 1024), (1, 8192), (1, 32768), (8, 8192), (32, 2048)]:
            one = Case(batch, 1, ctx, *MODELS[model], dtype, gen)
            line = f"  {model:10s} b={batch:<3d} ctx={ctx:<6d} decode {graph_ms(lambda: one.triton(), 10, 50) * 1e3:7.1f}"
            del one
            for q_len in (3, 5, 9):
                case = Case(batch, q_len, ctx, *MODELS[model], dtype, gen)
                seg = ta._pick_num_segments(batch * MODELS[model][1], q_len, ctx, case.query.device)
                err = rel_err(case.triton(), case.reference(fp32=True))
                assert err < 2e-2, (model, batch, ctx, q_len, err)
                t1 = graph_ms(lambda: case.triton(num_segments=1), 10, 50) * 1e3
                ts = graph_ms(lambda: case.triton(), 10, 50) * 1e3
                line += f"  q={q_len}: {t1:7.1f} / {ts:6.1f} ({seg:2d} seg)"
                del case
            log(line)
            torch.cuda.empty_cache()


def tune_ragged(dtype, gen, log):
    """W1's decode batches mix contexts of 100-2,048 tokens: the kernel on ragged contexts
    (longest first, as the engine orders them, and shuffled) against uniform ones of the same
    mean, in a CUDA graph. GB/s of KV read."""
    log("\nRagged contexts against uniform ones of the same mean (GB/s of KV read)")
    rng = torch.Generator().manual_seed(0)
    for model, batch, lo, hi in [("qwen3-0.6b", 256, 100, 1400), ("qwen3-0.6b", 128, 300, 2048),
                                 ("llama3-8b", 256, 100, 1400)]:
        lens = torch.randint(lo, hi + 1, (batch,), generator=rng)
        mean = int(lens.float().mean())
        uniform = Case(batch, 1, mean, *MODELS[model], dtype, gen)
        rates = [uniform.kv_bytes() / 1e6 / graph_ms(lambda: uniform.triton(), 25, 100)]
        del uniform
        ragged = Case(batch, 1, hi, *MODELS[model], dtype, gen)
        for order in (lens.sort(descending=True).values, lens):
            ragged.set_lengths(order.tolist())
            rates.append(ragged.kv_bytes() / 1e6 / graph_ms(lambda: ragged.triton(), 25, 100))
        log(f"  {model:10s} b={batch:<3d} ctx {lo}-{hi} (mean {mean}): uniform {rates[0]:5.0f}  "
            f"ragged longest first {rates[1]:5.0f}  ragged shuffled {rates[2]:5.0f}")
        del ragged
        torch.cuda.empty_cache()


def ragged_case(model, batch, lo, hi, dtype, gen, rng) -> tuple["Case", list[int]]:
    """A decode batch of W1-like ragged contexts (uniform in [lo, hi]), longest first as the
    engine orders them, and its lengths."""
    lens = torch.randint(lo, hi + 1, (batch,), generator=rng).sort(descending=True).values.tolist()
    case = Case(batch, 1, hi, *MODELS[model], dtype, gen)
    case.set_lengths(lens)
    return case, lens


# Decode tiles (TILE_N, warps, stages, maxnreg): every combination (--tune-decode), and the
# candidates beside the default on W1's ragged batches (--decode-tiles). In the default (64-token
# tiles, 3 stages) each program has one K/V buffer, so its next tile's copy is issued only after
# the whole tile's softmax and PV dot; with 5 stages the pipeliner gives it two. At 96 registers
# (a few bytes spilled, outside the loop) 5 programs fit an SM instead of 4.
TILE_GRID = [(n, w, s, None) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]
TILE_CANDIDATES = [(64, 4, 3, 128), (32, 4, 5, 96), (32, 4, 6, 96), (16, 4, 6, 96), (16, 4, 8, 96),
                   (32, 4, 3, 96), (32, 4, 5, 128)]
# An FP8 cache's tiles hold half the bytes: longer tiles, or more of them in flight
FP8_TILE_CANDIDATES = [(64, 4, 3, 128), (64, 4, 3, None), (64, 4, 5, 128), (128, 4, 3, 128), (128, 4, 3, None),
                       (128, 8, 3, None)]
# (model, batch, contexts from, to): uniform where from == to
W1_UNIFORM = [("qwen3-0.6b", 32, 1536, 1536), ("qwen3-0.6b", 64, 1536, 1536), ("llama3-8b", 64, 1536, 1536),
              ("qwen3-0.6b", 256, 1024, 1024)]
W1_RAGGED = [("qwen3-0.6b", 256, 100, 1400), ("qwen3-0.6b", 256, 640, 688), ("qwen3-0.6b", 128, 300, 2048),
             ("qwen3-0.6b", 64, 600, 2048), ("qwen3-0.6b", 32, 1000, 2048), ("qwen3-0.6b", 8, 1400, 2048),
             ("qwen3-0.6b", 1, 512, 768), ("llama3-8b", 256, 100, 1400), ("llama3-8b", 1, 512, 768)]


def tune_decode_tiles(dtype, gen, log, variants=TILE_CANDIDATES, cases=W1_RAGGED, top=0):
    """Decode tiles on batches of contexts uniform in [from, to], longest first, with the
    engine's split choice, one launch timed in a CUDA graph (GB/s of KV read). With ``top``,
    each case's fastest ``top`` variants and the default; else a column per variant."""
    results = []
    default = dict(ta.TILES[16])
    key = tuple(default.get(k) for k in ("TILE_N", "num_warps", "num_stages", "maxnreg"))
    variants = list(variants) + ([key] if key not in variants else [])
    log("\nDecode tiles (TILE_N, warps, stages, maxnreg), contexts longest first (GB/s of KV read)")
    if not top:
        log(f"{'case':36s} " + " ".join(f"{str(v):>12s}" for v in variants))
    rng = torch.Generator().manual_seed(0)
    try:
        for model, batch, lo, hi in cases:
            case, _ = ragged_case(model, batch, lo, hi, dtype, gen, rng)
            ref = case.reference(fp32=True)
            rates = {}
            for tile_n, warps, stages, maxnreg in variants:
                ta.TILES[16] = dict(TILE_N=tile_n, num_warps=warps, num_stages=stages,
                                    **({"maxnreg": maxnreg} if maxnreg else {}))
                try:
                    assert rel_err(case.triton(), ref) < 2e-2
                    ms = graph_ms(lambda: case.triton(), 25, 100)
                except Exception as e:   # out of resources
                    log(f"  {model} b={batch}: {(tile_n, warps, stages, maxnreg)}: {type(e).__name__}")
                    continue
                rates[(tile_n, warps, stages, maxnreg)] = case.kv_bytes() / 1e6 / ms
                results.append(dict(model=model, batch=batch, contexts=[lo, hi], tile_n=tile_n, warps=warps,
                                    stages=stages, maxnreg=maxnreg, ms=ms, rate=rates[tile_n, warps, stages, maxnreg]))
            label = f"{model:10s} b={batch:<3d} ctx {lo:4d}-{hi:4d}"
            if top:
                best = sorted(rates, key=rates.get, reverse=True)[:top]
                log("\n".join(f"  {label}: {str(v):20s} {rates[v]:6.0f}" for v in best))
                log(f"  {label}: default {str(key):12s} {rates.get(key, float('nan')):6.0f}")
            else:
                log(f"{label}          " + " ".join(f"{rates.get(v, float('nan')):12.0f}" for v in variants))
            del case
            torch.cuda.empty_cache()
    finally:
        ta.TILES[16] = default
    return results


def tune_split_ragged(dtype, gen, log):
    """Flash-decoding on W1's ragged medium batches (contexts as W1's surviving requests have
    them at that batch size, longest first): 1, 2 and 4 segments against the engine's choice
    (``_pick_num_segments`` with max_seq_len = max_model_len, as its CUDA graphs call it). At
    264-527 programs (batch 33-65 of 8 KV heads) the engine does not split, and one wave of
    unequal programs waits for its longest. GB/s of KV read, in a CUDA graph."""
    log("\nSplit-KV on ragged medium batches, longest first (GB/s of KV read)")
    rng = torch.Generator().manual_seed(0)
    for model, batch, lo, hi in [("qwen3-0.6b", 24, 1000, 2048), ("qwen3-0.6b", 32, 1000, 2048),
                                 ("qwen3-0.6b", 48, 900, 2000), ("qwen3-0.6b", 64, 900, 1850),
                                 ("qwen3-0.6b", 96, 750, 1700), ("qwen3-0.6b", 128, 650, 1570),
                                 ("llama3-8b", 48, 900, 2000), ("llama3-8b", 64, 900, 1850)]:
        case, lens = ragged_case(model, batch, lo, hi, dtype, gen, rng)
        auto = ta._pick_num_segments(batch * MODELS[model][1], 1, 40960, case.query.device)
        line = f"  {model:10s} b={batch:<3d} ctx {lo}-{hi} (engine: {auto}):"
        for seg in (1, 2, 4):
            ms = graph_ms(lambda: case.triton(num_segments=seg), 25, 100)
            line += f"  seg {seg}: {ms * 1e3:6.1f} us {case.kv_bytes() / 1e6 / ms:5.0f}"
        log(line)
        del case
        torch.cuda.empty_cache()


def tune_layout(dtype, gen, log):
    """Decode attention with the cache's KV heads outside its tokens (each block and head one
    contiguous run: 4 KB at block size 16, head_dim 128) against the engine's layout (a token's
    KV heads side by side: 256-byte runs 2 KB apart), at block sizes 16 and 32; W1-like batches
    (ragged, longest first) and a uniform one, in a CUDA graph. GB/s of KV read; the read
    ceiling is a torch sum over 4 GiB."""
    x = torch.empty(1 << 31, dtype=torch.bfloat16, device=DEVICE).normal_()
    read = x.numel() * 2 / 1e6 / bench(lambda: x.sum(dtype=torch.float32))
    del x
    log(f"\nKV layouts (GB/s of KV read); read ceiling (torch sum) {read:.0f} GB/s")
    rng = torch.Generator().manual_seed(0)
    for model, batch, lo, hi in [("qwen3-0.6b", 256, 100, 1400), ("qwen3-0.6b", 128, 300, 2048),
                                 ("llama3-8b", 256, 100, 1400), ("qwen3-0.6b", 64, 1024, 1024),
                                 ("llama3-8b", 16, 4000, 4000)]:
        lens = torch.randint(lo, hi + 1, (batch,), generator=rng).sort(descending=True).values.tolist()
        row = []
        for block_size in (16, 32):
            for heads_outer in (False, True):
                case = Case(batch, 1, hi, *MODELS[model], dtype, gen, block_size, heads_outer)
                case.set_lengths(lens)
                ref = case.reference(fp32=True)
                err = rel_err(case.triton(), ref)
                assert err < 2e-2, (model, block_size, heads_outer, err)
                row.append(case.kv_bytes() / 1e6 / graph_ms(lambda: case.triton(), 25, 100))
                del case, ref
                torch.cuda.empty_cache()
        log(f"  {model:10s} b={batch:<3d} ctx {lo}-{hi}: bs16 tokens-outer {row[0]:5.0f} heads-outer "
            f"{row[1]:5.0f} | bs32 tokens-outer {row[2]:5.0f} heads-outer {row[3]:5.0f}")


def time_mixed(dtype, gen, log, nd=256, chunks=15, total=8192):
    """A W1 prefill step: 256 decodes (contexts 100-1,000) beside 15 prompt chunks (8,192 tokens
    in all), attended in one launch against the backend's two (decodes apart), in a CUDA graph."""
    from pagoda.model.layers.attention import AttentionMetadata, TritonAttentionBackend
    log("\nA mixed step, one launch against decodes and prefills apart (ms)")
    rng = torch.Generator().manual_seed(0)
    for model, (num_heads, num_kv_heads, head_dim) in MODELS.items():
        dec = torch.randint(100, 1001, (nd,), generator=rng).sort(descending=True).values.tolist()
        chunk = (total - nd) // chunks
        q_lens = [1] * nd + [chunk] * chunks
        seq_lens = dec + [chunk] * chunks
        blocks = [triton.cdiv(n, BLOCK_SIZE) for n in seq_lens]
        width = max(blocks)
        perm = torch.randperm(sum(blocks), generator=rng)
        tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
        start = 0
        for i, b in enumerate(blocks):
            tables[i, :b] = perm[start:start + b]
            start += b
        kv_cache = torch.randn(2, sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE,
                               dtype=dtype, generator=gen)
        n = sum(q_lens)
        q = torch.randn(n, num_heads, head_dim, device=DEVICE, dtype=dtype, generator=gen)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        seq_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        tables = tables.to(DEVICE)
        scale = head_dim ** -0.5
        out = torch.empty_like(q)
        k = torch.zeros(n, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        slots = torch.full((n,), -1, dtype=torch.long, device=DEVICE)   # (the new K/V: not timed)

        def one_launch():
            ta.write_kv_cache_triton(k, k, kv_cache, slots)
            return ta.paged_attention_triton(q, kv_cache, tables, seq_t, qsl, scale, max(seq_lens), chunk, out=out)

        md = AttentionMetadata(n, nd, slots, qsl, seq_t, tables, chunk, max(seq_lens), max(dec))
        one = graph_ms(one_launch, 10, 50)
        apart = graph_ms(lambda: TritonAttentionBackend.forward(q, k, k, kv_cache, md, scale), 10, 50)
        err = rel_err(TritonAttentionBackend.forward(q, k, k, kv_cache, md, scale), one_launch())
        log(f"  {model:10s} {nd} decodes + {chunks} x {chunk}-token prefills: one launch {one:6.3f}  "
            f"apart {apart:6.3f}  (rel. difference {err:.1e})")
        del kv_cache
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--no-tune", action="store_true", help="skip the tuning sweep")
    parser.add_argument("--tune-decode", action="store_true",
                        help="only sweep the decode tiles at W1 shapes, uniform contexts (every TILE_N x "
                             "warps x stages)")
    parser.add_argument("--tune-split", action="store_true",
                        help="only time the flash-decoding split factors at medium batches")
    parser.add_argument("--ragged", action="store_true",
                        help="only time decode over ragged contexts against uniform ones")
    parser.add_argument("--decode-tiles", action="store_true",
                        help="only time candidate decode tiles (TILE_N, warps, stages, maxnreg) on W1's "
                             "ragged batches")
    parser.add_argument("--split-ragged", action="store_true",
                        help="only time flash-decoding splits on W1's ragged medium batches")
    parser.add_argument("--layout", action="store_true",
                        help="only time decode with the KV heads outside the tokens in each block")
    parser.add_argument("--tiles", default=None, metavar="N,W,S,R;...",
                        help="with --decode-tiles: these candidates (TILE_N, warps, stages, maxnreg or 0)")
    parser.add_argument("--kv-fp8", action="store_true",
                        help="FP8 (E4M3) caches; with --decode-tiles, the FP8 tile candidates")
    parser.add_argument("--mixed", action="store_true",
                        help="only time a mixed step in one launch against decodes and prefills apart")
    parser.add_argument("--spec", action="store_true",
                        help="only time speculative decoding's verification attention (k + 1 queries a request)")
    parser.add_argument("--prefill", action="store_true",
                        help="only time prefill attention (fresh and over a cached prefix) over prefill tiles")
    args = parser.parse_args()
    assert DEVICE != "cuda" or torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    global KV_DTYPE
    KV_DTYPE = torch.float8_e4m3fn if args.kv_fp8 else None
    candidates = FP8_TILE_CANDIDATES if args.kv_fp8 else TILE_CANDIDATES
    if args.tiles:
        candidates = [tuple(int(x) or None for x in t.split(",")) for t in args.tiles.split(";")]
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    start = time.time()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    only = {"tune_split": tune_split, "ragged": tune_ragged, "layout": tune_layout, "mixed": time_mixed,
            "decode_tiles": lambda d, g, lg: tune_decode_tiles(d, g, lg, candidates),
            "split_ragged": tune_split_ragged, "prefill": tune_prefill, "spec": time_spec}
    chosen = [fn for flag, fn in only.items() if getattr(args, flag)]
    if chosen:
        log(f"{props.name}; copy bandwidth {bw:.0f} GB/s")
        for fn in chosen:
            fn(dtype, gen, log)
        return
    if args.tune_decode:
        log(f"{props.name}; copy bandwidth {bw:.0f} GB/s")
        results = tune_decode_tiles(dtype, gen, log, TILE_GRID, W1_UNIFORM, top=5)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "attention_tune_decode.json"), "w") as f:
                json.dump(dict(copy_bandwidth_gbps=bw, results=results), f, indent=1)
        return
    log(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}; {args.dtype}; block size {BLOCK_SIZE}; "
        f"copy bandwidth {bw:.0f} GB/s")
    log(f"{'model':11s} {'shape':24s} {'triton us':>9s} {'rate':>9s} {'ref us':>10s} {'rate':>9s} "
        f"{'sdpa us':>9s} {'rate':>9s}  {'unit':7s} {'seg':>3s} {'rel err':>8s}")
    rows = []
    for model, heads in MODELS.items():
        for ctx in DECODE_CONTEXTS:
            for batch in DECODE_BATCHES:
                run_case("decode", model, Case(batch, 1, ctx, *heads, dtype, gen), rows, log)
                torch.cuda.empty_cache()
        run_case("prefill", model, Case(PREFILL_BATCH, PREFILL_LEN, PREFILL_LEN, *heads, dtype, gen),
                 rows, log)
        torch.cuda.empty_cache()
    decode = [r for r in rows if r["kind"] == "decode"]
    log(f"decode: triton at {max(r['triton_rate'] for r in decode) / bw:.0%} of copy bandwidth "
        f"at best; {sum(r['triton_ms'] < r['sdpa_ms'] for r in decode)}/{len(decode)} shapes "
        f"faster than dense SDPA")
    tuning = [] if args.no_tune else tune(dtype, gen, log, deadline=start + 150)
    failed = [r for r in rows if not r["correct"]]
    log(f"\n{len(rows) - len(failed)}/{len(rows)} shapes correct; {time.time() - start:.0f} s")

    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "attention_kernels.json")
        with open(path, "w") as f:
            json.dump(dict(device=props.name, sms=props.multi_processor_count,
                           torch=torch.__version__, triton=triton.__version__, dtype=args.dtype,
                           block_size=BLOCK_SIZE, copy_bandwidth_gbps=bw,
                           date=datetime.datetime.now().isoformat(timespec="seconds"),
                           command=" ".join(sys.argv), tiles={str(k): v for k, v in ta.TILES.items()},
                           split=dict(programs_per_sm=ta.SPLIT_PROGRAMS_PER_SM,
                                      min_tokens=ta.SPLIT_MIN_TOKENS,
                                      max_segments=ta.SPLIT_MAX_SEGMENTS),
                           results=rows, tuning=tuning, log=lines), f, indent=1, default=str)
        print(f"wrote {path}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
