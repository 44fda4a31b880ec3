"""The sampler alone on the GPU: device time (do_bench median) and host time to issue one call,
for W1's batch shape (256 x Qwen3's 151,936 vocabulary) and batch 1, against another version
of sampler.py (--old, e.g. main's) when given. The LM head's matmul is timed beside it. The
one-kernel path (the "one kernel" rows: seeds set, as the runner does) comes from the checkout
benchmarked (this tree, or $PAGODA_ROOT: common.py): compare kernels by running the script on
two checkouts (an --old sampler.py that predates the kernel's filters skips its filtered rows).

The logits are a random LM head's (N(0, 1.6^2) a row): flat for an LM, top-p 0.9 keeps some
35,000 tokens at T 0.8, which the kernel must search for over the whole row. --logit-scale 2
gives a few hundred, as a model's next-token distribution, which the kernel finds among the
column maxima (kernels/triton_sampling.py).

  python3 benchmarks/sampler_bench.py --old ../pagoda/runner/sampler.py
  python3 benchmarks/sampler_bench.py --logit-scale 2 --batch 256 64 1
  python3 benchmarks/sampler_bench.py --knob triton_sampling.SEARCH_BLOCK=512   # tuning a constant
  python3 benchmarks/sampler_bench.py --only "temperature, one" --batch 256 64 16 1   # W1's path
"""
import argparse
import importlib.util
import inspect
import json
import os

from common import PAGODA_ROOT, add_knob_arg, apply_knob_args, host_seconds

CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.6),
    "temperature, one kernel": dict(temperature=0.6, kernel=True),   # the engine's path (seeds set)
    "top_p 0.9": dict(temperature=0.8, top_p=0.9),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_k 50 + top_p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p 0.9, one kernel": dict(temperature=0.8, top_p=0.9, kernel=True),
    "top_k 50, one kernel": dict(temperature=0.8, top_k=50, kernel=True),
    "top_k 50 + top_p 0.9, one kernel": dict(temperature=0.8, top_k=50, top_p=0.9, kernel=True),
    "min_p 0.05, one kernel": dict(temperature=0.8, min_p=0.05, kernel=True),
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
    top_k, top_p, min_p = cfg.get("top_k"), cfg.get("top_p"), cfg.get("min_p")
    if cfg.get("kernel") and filtered(cfg):     # the runner then passes all three
        top_k, top_p, min_p = top_k or 0, top_p or 1.0, min_p or 0.0
    gens = {i: torch.Generator(device=dev).manual_seed(i) for i in range(min(cfg.get("seeded", 0), b))}
    full = lambda v: None if v is None else torch.full((b,), v, device=dev)
    md = mod.SamplingMetadata(temperature=full(t), all_greedy=t == 0, top_k=full(top_k), top_p=full(top_p),
                              min_p=full(min_p), generators=gens)
    if cfg.get("kernel"):
        md.seeds = torch.randint(0, 2**62, (b,), device=dev)
    if hasattr(md, "max_top_k"):
        md.max_top_k = top_k or 0
        md.max_num_logprobs = cfg.get("logprobs")
    else:
        md.max_num_logprobs = cfg.get("logprobs", 0)
    return md


def filtered(cfg):
    return any(k in cfg for k in ("top_k", "top_p", "min_p"))


def time_call(fn, reps=30):
    import triton.testing
    device_ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
    return device_ms, host_seconds(fn, reps) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--old", default=None, help="another sampler.py to compare with")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, nargs="+", default=[256, 1])
    p.add_argument("--logit-scale", type=float, default=1.0, help="scales the logits (2: an LM's peaked rows)")
    p.add_argument("--only", default="", help="the configs whose name holds this text")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    import torch
    from pagoda.kernels import triton_sampling
    print(f"kernel: SEARCH_BLOCK {triton_sampling.SEARCH_BLOCK}, COPY_BLOCK {triton_sampling.COPY_BLOCK}, "
          f"GUMBEL_PROGRAMS_PER_SM {getattr(triton_sampling, 'GUMBEL_PROGRAMS_PER_SM', '-')}, "
          f"logit scale {args.logit_scale:g}")
    versions = {"new": load(os.path.join(PAGODA_ROOT, "pagoda/runner/sampler.py"), "new_sampler")}
    if args.old and os.path.exists(args.old):
        versions["old"] = load(args.old, "old_sampler")
    rows = []
    for b in args.batch:
        hidden = torch.randn(b, args.hidden, device="cuda", dtype=torch.bfloat16)
        head = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16) * 0.05
        logits = (hidden @ head.T) * args.logit_scale
        d, h = time_call(lambda: hidden @ head.T)
        rows.append({"batch": b, "config": "LM head matmul", "version": "-", "device_ms": d, "host_ms": h})
        for name, cfg in CONFIGS.items():
            if args.only not in name:
                continue
            for ver, mod in versions.items():
                if cfg.get("kernel") and filtered(cfg) and "md.top_p" not in inspect.getsource(mod.sample):
                    continue        # a sampler from before the kernel's filters would drop them
                md = metadata(mod, b, cfg)
                d, h = time_call(lambda: mod.sample(logits, md))
                rows.append({"batch": b, "config": name, "version": ver, "device_ms": d, "host_ms": h})
    os.makedirs(args.out, exist_ok=True)
    name = "sampler_bench.json" if args.logit_scale == 1 else f"sampler_bench_scale{args.logit_scale:g}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(rows, f, indent=2)
    print(f"{'batch':>5} {'config':34} {'version':7} {'device ms':>9} {'host ms':>8}")
    for r in rows:
        print(f"{r['batch']:5d} {r['config']:34} {r['version']:7} {r['device_ms']:9.3f} {r['host_ms']:8.3f}")


if __name__ == "__main__":
    main()
