"""Micro-benchmark of the fused Triton elementwise ops (pagoda.kernels.triton_ops) against the
torch path (pagoda.kernels.reference, what the layers run on CPU and ran on CUDA before), on the
GPU (made for the H200), in bf16.

Ops, per decoder layer as the model calls them:
  - rms_norm:            the first layer's input norm / the final norm, (tokens, hidden)
  - fused_add_rms_norm:  residual add + norm, twice per layer
  - qk_norm:             Qwen3's per-head q and k norms on (tokens * heads, head_dim) copies of
                         the qkv slices (as llama.py calls them; two calls, timed together)
  - qk_norm_3d_view:     the same, Triton reading (tokens, heads, head_dim) views of the qkv
                         output in place of the copies (what llama.py could pass)
  - silu_and_mul:        (tokens, 2 * intermediate) -> (tokens, intermediate)
at decode (1, 64, 256 tokens) and prefill (8192 tokens) shapes of Qwen3-0.6B and Llama-3-8B.

Columns: GPU time of one call by ``triton.testing.do_bench`` (median; L2 flushed before each
run) for torch, Triton and the torch path under ``torch.compile`` (with the seconds its first
call at each shape spent compiling), the speed-up, Triton's effective bandwidth (bytes that must be read
and written at least once, over its time), and host time per call (wall time of back-to-back
calls: what a launch costs the CPU, which is what eager decode is bound by). Each case is first
checked against the torch path (relative error < 1e-2).

Run from the repository root:  OUT=/some/dir python benchmarks/ops_kernels.py
Prints a table; writes ``$OUT/ops_kernels.json`` when OUT is set. Under a minute on an H200.
"""
import datetime
import json
import math
import os
import time

import torch
from triton.testing import do_bench

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda.kernels import reference
from pagoda.kernels import triton_ops

del common  # (imported for its sys.path entry alone)

MODELS = {  # hidden, q heads, kv heads, head_dim, intermediate, qk norm
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, True),
    "llama3-8b": (4096, 32, 8, 128, 14336, False),
}
TOKENS = [1, 64, 256, 8192]
DTYPE = torch.bfloat16
EPS = 1e-6
HOST_CALLS = 200


def gpu_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def host_us(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - t
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def compiled_reference():
    """The torch path through torch.compile (inductor): the alternative issue 3 asks to measure
    against hand-written Triton. One compiled function per op; each new shape recompiles."""
    import types
    names = ("rms_norm", "fused_add_rms_norm", "silu_and_mul")
    return types.SimpleNamespace(**{n: torch.compile(getattr(reference, n)) for n in names})


def cases(model: str, tokens: int, compiled):
    """{op: (torch fn, triton fn, bytes moved, check fn -> relative error, torch.compile fn)}."""
    hidden, nh, nkv, hd, inter, has_qk_norm = MODELS[model]
    dev, g = "cuda", torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, shift=0.0):
        return (torch.randn(*shape, device=dev, generator=g) + shift).to(DTYPE)

    el = torch.tensor([], dtype=DTYPE).element_size()
    x, residual, w = rnd(tokens, hidden, shift=0.5), rnd(tokens, hidden), rnd(hidden, shift=1.0)
    q_size, kv_size = nh * hd, nkv * hd
    qkv = rnd(tokens, q_size + 2 * kv_size)
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    w_head = rnd(hd, shift=1.0)
    gate_up = rnd(tokens, 2 * inter)

    def qk_norm(ops):
        return (ops.rms_norm(q.reshape(-1, hd), w_head, EPS), ops.rms_norm(k.reshape(-1, hd), w_head, EPS))

    def qk_norm_view(ops):  # the kernel reads the (tokens, heads, head_dim) views: no copies
        return (ops.rms_norm(q.unflatten(-1, (nh, hd)), w_head, EPS),
                ops.rms_norm(k.unflatten(-1, (nkv, hd)), w_head, EPS))

    def check(op, *args):
        out, ref = getattr(triton_ops, op)(*args), getattr(reference, op)(*args)
        pairs = zip(out, ref) if isinstance(out, tuple) else [(out, ref)]
        return max(rel_err(o, r) for o, r in pairs)

    out = {
        "rms_norm": (lambda: reference.rms_norm(x, w, EPS), lambda: triton_ops.rms_norm(x, w, EPS),
                     2 * tokens * hidden * el, lambda: check("rms_norm", x, w, EPS),
                     lambda: compiled.rms_norm(x, w, EPS)),
        "fused_add_rms_norm": (
            lambda: reference.fused_add_rms_norm(x, residual, w, EPS),
            lambda: triton_ops.fused_add_rms_norm(x, residual, w, EPS),
            4 * tokens * hidden * el, lambda: check("fused_add_rms_norm", x, residual, w, EPS),
            lambda: compiled.fused_add_rms_norm(x, residual, w, EPS)),
        "silu_and_mul": (lambda: reference.silu_and_mul(gate_up), lambda: triton_ops.silu_and_mul(gate_up),
                         3 * tokens * inter * el, lambda: check("silu_and_mul", gate_up),
                         lambda: compiled.silu_and_mul(gate_up)),
    }
    if has_qk_norm:
        out["qk_norm"] = (lambda: qk_norm(reference), lambda: qk_norm(triton_ops),
                          2 * tokens * (q_size + kv_size) * el,
                          lambda: max(rel_err(o, r) for o, r in zip(qk_norm(triton_ops), qk_norm(reference))),
                          lambda: qk_norm(compiled))
        out["qk_norm_3d_view"] = (lambda: qk_norm(reference), lambda: qk_norm_view(triton_ops),
                                  2 * tokens * (q_size + kv_size) * el,
                                  lambda: max(rel_err(o.flatten(0, 1), r) for o, r in
                                              zip(qk_norm_view(triton_ops), qk_norm(reference))),
                                  lambda: qk_norm_view(compiled))
    return out


def main():
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, torch {torch.__version__}, {DTYPE}; times per call", flush=True)
    header = (f"{'model':<11} {'tokens':>6} {'op':<19} {'torch us':>9} {'triton us':>9} {'speedup':>7} "
              f"{'triton GB/s':>11} {'host us torch':>13} {'host us triton':>14} {'rel err':>8} "
              f"{'compile us':>10} {'host us comp':>12} {'compile s':>9}")
    print(header)
    print("-" * len(header))
    rows, t0 = [], time.time()
    compiled = compiled_reference()
    for model in MODELS:
        for tokens in TOKENS:
            for op, (torch_fn, triton_fn, nbytes, check, compiled_fn) in cases(model, tokens, compiled).items():
                err = check()
                assert err < 1e-2, f"{model} {tokens} {op}: relative error {err:.2e}"
                t_torch, t_triton = gpu_ms(torch_fn) * 1e3, gpu_ms(triton_fn) * 1e3
                h_torch, h_triton = host_us(torch_fn), host_us(triton_fn)
                tc = time.perf_counter()
                compiled_fn()                       # the first call of a new shape compiles
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - tc
                t_comp, h_comp = gpu_ms(compiled_fn) * 1e3, host_us(compiled_fn)
                row = dict(model=model, tokens=tokens, op=op, torch_us=t_torch, triton_us=t_triton,
                           speedup=t_torch / t_triton, triton_gbps=nbytes / (t_triton * 1e-6) / 1e9,
                           host_us_torch=h_torch, host_us_triton=h_triton, rel_err=err,
                           compiled_us=t_comp, host_us_compiled=h_comp, compile_s=compile_s)
                rows.append(row)
                print(f"{model:<11} {tokens:>6} {op:<19} {t_torch:>9.1f} {t_triton:>9.1f} "
                      f"{row['speedup']:>6.1f}x {row['triton_gbps']:>11.0f} {h_torch:>13.1f} "
                      f"{h_triton:>14.1f} {err:>8.1e} {t_comp:>10.1f} {h_comp:>12.1f} {compile_s:>9.2f}", flush=True)
    ratio = math.exp(sum(math.log(r["compiled_us"] / r["triton_us"]) for r in rows) / len(rows))
    print(f"torch.compile against Triton: GPU time {ratio:.2f}x Triton's (geometric mean over {len(rows)} "
          f"cases), {sum(r['compile_s'] for r in rows):.1f} s compiling, host time per call "
          f"{sum(r['host_us_compiled'] for r in rows) / len(rows):.1f} us against "
          f"{sum(r['host_us_triton'] for r in rows) / len(rows):.1f} us")
    print(f"({time.time() - t0:.0f} s)")
    if os.environ.get("OUT"):
        path = os.path.join(os.environ["OUT"], "ops_kernels.json")
        with open(path, "w") as f:
            json.dump(dict(device=props.name, torch=torch.__version__, dtype=str(DTYPE),
                           date=datetime.date.today().isoformat(), rows=rows), f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
