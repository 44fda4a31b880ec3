"""Speculative decoding with n-gram drafts: latency of one request at a time (batch 1, greedy),
and a batch of all of them, with drafts off and at several num_speculative_tokens, on chats whose
answers copy their prompts (code edits, repeated lists) and on one that does not (a poem). Real
weights (the embedded SmolLM2 by default): acceptance depends on what the model writes, so random
weights would measure nothing. Prints a table, writes JSON and a plot.

  python benchmarks/spec_decode.py                      # SmolLM2, k = 0 (off), 2, 4, 8
  python benchmarks/spec_decode.py --model PATH --k 0 4
  python benchmarks/spec_decode.py --profile            # where a step's host time goes, at each k
"""
import argparse
import cProfile
import json
import os
import pstats
import time

from common import add_knob_arg, apply_knob_args, bar_chart

CODE = '''def mean(xs):
    total = 0
    for x in xs:
        total += x
    return total / len(xs)


def variance(xs):
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def stdev(xs):
    return variance(xs) ** 0.5
'''
CHATS = {
    "code edit": "Rename the function `mean` to `average` everywhere in this code and print the whole code:\n\n" + CODE,
    "add docstrings": "Add a one-line docstring to each function and print the whole code:\n\n" + CODE,
    "repeat list": "Repeat this list exactly, one item a line: Monday, Tuesday, Wednesday, Thursday, Friday, "
                   "Saturday, Sunday, January, February, March, April, May, June, July, August.",
    "poem (no copying)": "Write a short poem about the sea.",
}


def run(llm, prompts, params, one_at_a_time: bool):
    """(seconds, output tokens, engine steps) for the prompts, one request at a time or as one batch."""
    s0 = llm.llm_engine.stats
    t0 = time.perf_counter()
    outs = ([llm.generate(p, params, use_tqdm=False)[0] for p in prompts] if one_at_a_time
            else llm.generate(prompts, params, use_tqdm=False))
    seconds = time.perf_counter() - t0
    s1 = llm.llm_engine.stats
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return seconds, tokens, s1.num_steps - s0.num_steps, s1.num_draft_tokens - s0.num_draft_tokens, \
        s1.num_accepted_tokens - s0.num_accepted_tokens, [o.outputs[0].token_ids for o in outs]


def profile(llm, prompt, params, k: int, out: str) -> None:
    """The request alone under cProfile: its steps, and the functions taking the most own time
    (the host's wait for the device shows in the call that copies the tokens back)."""
    steps = llm.llm_engine.stats.num_steps
    prof = cProfile.Profile()
    prof.enable()
    t0 = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    prof.disable()
    steps = llm.llm_engine.stats.num_steps - steps
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"spec_profile_k{k}.txt")
    with open(path, "w") as f:
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
    print(f"k={k}: {steps} steps, {seconds / steps * 1e3:.3f} ms a step (profiled); top functions by own time, us a step:")
    stats = pstats.Stats(prof).stats
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    for (file, line, name), (_, calls, tottime, _, _) in top:
        print(f"  {tottime / steps * 1e6:8.1f}  {calls / steps:6.1f} calls  {os.path.basename(file)}:{line}({name})")
    import torch
    if torch.cuda.is_available():       # the device's side: its kernels, us a step
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
            llm.generate(prompt, params, use_tqdm=False)
            torch.cuda.synchronize()
        kernels = sorted(tp.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in kernels)
        print(f"k={k}: device {total / steps:.1f} us a step; top kernels, us a step:")
        for e in kernels[:10]:
            print(f"  {e.device_time_total / steps:8.1f}  {e.count / steps:6.1f} calls  {e.key[:90]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model path (default: the embedded SmolLM2)")
    p.add_argument("--k", type=int, nargs="+", default=[0, 2, 4, 8], help="num_speculative_tokens (0: off)")
    p.add_argument("--lookup", type=int, nargs=2, default=[2, 4], metavar=("MIN", "MAX"),
                   help="prompt_lookup_min and prompt_lookup_max")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--profile", action="store_true",
                   help="cProfile the first chat at each k instead (functions by own time, to $OUT)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    from pagoda import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows, baseline = [], {}
    for k in args.k:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k,
                                    "prompt_lookup_min": args.lookup[0], "prompt_lookup_max": args.lookup[1]}
        llm = LLM(args.model, dtype=args.dtype, speculative_config=spec)
        tok = llm.get_tokenizer()
        prompts = {name: tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
                   for name, c in CHATS.items()}
        run(llm, list(prompts.values())[:1], SamplingParams(temperature=0, max_tokens=16), True)   # warm-up
        if args.profile:
            profile(llm, next(iter(prompts.values())), params, k, args.out)
            del llm
            continue
        for name, prompt in prompts.items():
            sec, tokens, steps, drafted, kept, ids = run(llm, [prompt], params, True)
            if k == 0:
                baseline[name] = (sec / tokens, ids)
            same = ids == baseline[name][1]
            rows.append(dict(k=k, workload=name, ms_per_token=sec / tokens * 1e3, tokens=tokens, steps=steps,
                             tokens_per_step=tokens / steps, acceptance=kept / drafted if drafted else None,
                             speedup=baseline[name][0] / (sec / tokens), same_tokens=same))
        sec, tokens, steps, drafted, kept, ids = run(llm, list(prompts.values()), params, False)
        if k == 0:
            baseline["batch"] = (sec / tokens, ids)
        rows.append(dict(k=k, workload=f"all {len(prompts)} at once", ms_per_token=sec / tokens * 1e3, tokens=tokens,
                         steps=steps, tokens_per_step=tokens / steps, acceptance=kept / drafted if drafted else None,
                         speedup=baseline["batch"][0] / (sec / tokens), same_tokens=ids == baseline["batch"][1]))
        del llm
    if args.profile:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump({"model": args.model or "SmolLM2-135M-Instruct", "lookup": args.lookup, "rows": rows}, f, indent=1)
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    bar_chart(os.path.join(args.out, "spec_decode.png"), "n-gram speculative decoding, greedy",
              "speed-up over no drafts", workloads,
              {f"k={k}": [next(r["speedup"] for r in rows if r["k"] == k and r["workload"] == w) for w in workloads]
               for k in args.k if k})
    print(f"{'workload':22s} {'k':>2s} {'ms/token':>9s} {'tok/step':>8s} {'accepted':>8s} {'speed-up':>8s} same")
    for r in rows:
        acc = f"{100 * r['acceptance']:7.1f}%" if r["acceptance"] is not None else "       -"
        print(f"{r['workload']:22s} {r['k']:2d} {r['ms_per_token']:9.3f} {r['tokens_per_step']:8.2f} {acc} "
              f"{r['speedup']:7.2f}x {'yes' if r['same_tokens'] else 'NO'}")


if __name__ == "__main__":
    main()
