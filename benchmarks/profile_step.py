"""Where a decode step's time goes on the GPU: wall time per step against the GPU kernel time
per step (torch.profiler, CUDA graphs included), and the largest kernels, prefill excluded.
With programmatic dependent launch on, a kernel's time includes its wait for the one before
(they overlap): pass ``--knob triton_utils.USE_PDL=0`` for a table of each kernel's own time.

  python benchmarks/profile_step.py --model-config benchmarks/models/qwen3-0.6b.json --batch 1 256
"""
import argparse
import json
import os

from common import Timer, add_knob_arg, apply_knob_args, dummy_model_dir, on_off


def kernel_totals(prof) -> dict:
    """GPU time (us) and call count of each kernel in a torch.profiler run."""
    return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--top", type=int, default=6, help="how many kernels to list, largest first")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="sets the KV cache's size (its pages' spread in memory)")
    p.add_argument("--async-scheduling", type=on_off, default=None, help="on / off (default: on for CUDA)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    from torch.profiler import ProfilerActivity, profile

    from pagoda import LLM, SamplingParams
    llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", dtype="bfloat16", max_model_len=args.prompt_len + args.steps + 64,
              skip_tokenizer_init=True, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization,
              # every prompt prefilled in one step: with chunks, the decodes of the requests
              # prefilled first would ride along the later chunks, in the long run only, and the
              # subtraction below would charge their cost to the decode steps
              max_num_batched_tokens=max(8192, max(args.batch) * args.prompt_len), async_scheduling=args.async_scheduling)
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
        # The profiled run also holds the prefill step: take it out, kernel by kernel, with a
        # max_tokens=1 run (with long prompts the prefill would otherwise top the table).
        with profile(activities=[ProfilerActivity.CUDA]) as prof1:
            run(one)
        decode = kernel_totals(prof)
        for key, (us, count) in kernel_totals(prof1).items():
            total_us, total_count = decode.get(key, (0.0, 0))
            decode[key] = (total_us - us, total_count - count)
        decode = {k: v for k, v in decode.items() if v[1] > 0 and v[0] > 0}
        gpu = sum(us for us, _ in decode.values()) / args.steps / 1e3
        top = sorted(decode.items(), key=lambda kv: -kv[1][0])[:args.top]
        rows.append({"batch": b, "wall_ms_per_step": wall, "gpu_kernel_ms_per_step": gpu,
                     "gpu_idle_fraction": max(0.0, 1 - gpu / wall), "kernels_per_step": sum(
                         count for _, count in decode.values()) / args.steps,
                     "top_kernels": [(key[:70], us / args.steps / 1e3, count / args.steps, us / count)
                                     for key, (us, count) in top]})
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
