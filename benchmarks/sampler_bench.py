"""The sampler alone on the GPU: device time (do_bench median) and host time to issue one call,
for W1's batch shape (256 x Qwen3's 151,936 vocabulary) and batch 1, against another version
of sampler.py (--old, e.g. main's) when given. The LM head's matmul is timed beside it. The
one-kernel path ("temperature, one kernel") comes from this tree's pagoda/kernels: compare
kernels by running the script in two checkouts.

  python3 benchmarks/sampler_bench.py --old ../pagoda/runner/sampler.py
"""
import argparse
import importlib.util
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.6),
    "temperature, one kernel": dict(temperature=0.6, kernel=True),   # the engine's path (seeds set)
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_k 50 + top_p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "temperature + logprobs 5": dict(temperature=0.6, logprobs=5),
    "temperature, 8 seeded rows": dict(temperature=0.6, seeded=8),
}


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def metadata(mod, b, cfg):
    import torch
    dev = "cuda"
    t = cfg.get("temperature", 1.0)
    top_k, top_p = cfg.get("top_k"), cfg.get("top_p")
    gens = {i: torch.Generator(device=dev).manual_seed(i) for i in range(min(cfg.get("seeded", 0), b))}
    md = mod.SamplingMetadata(
        temperature=torch.full((b,), t, device=dev), all_greedy=t == 0,
        top_k=None if top_k is None else torch.full((b,), top_k, device=dev),
        top_p=None if top_p is None else torch.full((b,), top_p, device=dev),
        min_p=None, generators=gens)
    if cfg.get("kernel"):
        md.seeds = torch.randint(0, 2**62, (b,), device=dev)
    if hasattr(md, "max_top_k"):
        md.max_top_k = top_k or 0
        md.max_num_logprobs = cfg.get("logprobs")
    else:
        md.max_num_logprobs = cfg.get("logprobs", 0)
    return md


def time_call(fn, reps=30):
    import torch
    import triton.testing
    device_ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host_ms = (time.perf_counter() - t0) / reps * 1e3
    torch.cuda.synchronize()
    return device_ms, host_ms


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", default=None, help="another sampler.py to compare with")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, nargs="+", default=[256, 1])
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    import torch
    versions = {"new": load(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         "pagoda/runner/sampler.py"), "new_sampler")}
    if args.old and os.path.exists(args.old):
        versions["old"] = load(args.old, "old_sampler")
    rows = []
    for b in args.batch:
        hidden = torch.randn(b, args.hidden, device="cuda", dtype=torch.bfloat16)
        head = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.05
        logits = hidden @ head.T
        d, h = time_call(lambda: hidden @ head.T)
        rows.append({"batch": b, "config": "LM head matmul", "version": "-", "device_ms": d, "host_ms": h})
        for name, cfg in CONFIGS.items():
            for ver, mod in versions.items():
                md = metadata(mod, b, cfg)
                d, h = time_call(lambda: mod.sample(logits, md))
                rows.append({"batch": b, "config": name, "version": ver, "device_ms": d, "host_ms": h})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sampler_bench.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print(f"{'batch':>5} {'config':28} {'version':7} {'device ms':>9} {'host ms':>8}")
    for r in rows:
        print(f"{r['batch']:5d} {r['config']:28} {r['version']:7} {r['device_ms']:9.3f} {r['host_ms']:8.3f}")


if __name__ == "__main__":
    main()
