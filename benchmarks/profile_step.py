"""Where a decode step's time goes on the GPU: wall time per step against the GPU kernel time
per step (torch.profiler, CUDA graphs included), and the largest kernels.

  python benchmarks/profile_step.py --model-config benchmarks/models/qwen3-0.6b.json --batch 1 256
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, add_knob_arg, apply_knob_args, dummy_model_dir, on_off  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--top", type=int, default=6, help="how many kernels to list, largest first")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", type=on_off, default=None, help="on / off (default: on for CUDA)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    from torch.profiler import ProfilerActivity, profile

    from pagoda import LLM, SamplingParams
    llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", dtype="bfloat16", max_model_len=args.prompt_len + args.steps + 64,
              skip_tokenizer_init=True, enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling)
    name = os.path.splitext(os.path.basename(args.model_config))[0]
    name += "_async" if llm.llm_engine.async_scheduling else "_sync"
    rows = []
    for b in args.batch:
        inputs = [{"prompt_token_ids": [i + 1] * args.prompt_len} for i in range(b)]
        long = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def run(params):
            llm.reset_prefix_cache()     # every run prefills its prompts (no cached-prompt variant)
            llm.generate(inputs, params, use_tqdm=False)
        run(long)
        run(one)                         # warm-up: both kinds of run, compiles included
        with Timer() as t1:
            run(one)
        with Timer() as tn:
            run(long)
        wall = (tn.s - t1.s) / args.steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(long)
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        total_us = sum(e.self_device_time_total for e in events)
        # The profiled run also holds the prefill step: take it out with a max_tokens=1 run.
        with profile(activities=[ProfilerActivity.CUDA]) as prof1:
            run(one)
        prefill_us = sum(e.self_device_time_total for e in prof1.key_averages() if e.self_device_time_total > 0)
        gpu = (total_us - prefill_us) / args.steps / 1e3
        top = sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]
        steps = args.steps + 1
        rows.append({"batch": b, "wall_ms_per_step": wall, "gpu_kernel_ms_per_step": gpu,
                     "gpu_idle_fraction": max(0.0, 1 - gpu / wall), "kernels_per_step": sum(
                         e.count for e in events) / steps,
                     "top_kernels": [(e.key[:70], e.self_device_time_total / steps / 1e3, e.count / steps,
                                      e.self_device_time_total / e.count) for e in top]})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile_{name}.json"), "w") as f:
        json.dump(rows, f, indent=2)
    for r in rows:
        print(f"{name} batch {r['batch']}: wall {r['wall_ms_per_step']:.2f} ms/step, GPU kernels "
              f"{r['gpu_kernel_ms_per_step']:.2f} ms/step, GPU idle {r['gpu_idle_fraction']:.0%}, "
              f"{r['kernels_per_step']:.0f} kernels/step")
        print(f"    {'ms/step':>7s} {'calls':>6s} {'us/call':>7s}  kernel")
        for k, ms, calls, us in r["top_kernels"]:
            print(f"    {ms:7.3f} {calls:6.1f} {us:7.1f}  {k}")


if __name__ == "__main__":
    main()
