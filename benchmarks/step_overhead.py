"""Where one engine step's wall time goes: scheduling, input preparation, the model forward,
logits + sampling, and the bookkeeping after (scheduler update, detokenization, outputs).
The Python outside the forward should stay O(requests) and far below the forward.

  python benchmarks/step_overhead.py                      # SmolLM2 on this CPU, 256 requests
  python benchmarks/step_overhead.py --model-config benchmarks/models/qwen3-0.6b.json   # GPU
"""
import argparse
import collections
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import dummy_model_dir  # noqa: E402

PHASES = ["schedule", "prepare_inputs", "forward", "logits_and_sample", "update_and_detokenize"]


def timed(totals, name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps to time")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    from pagoda import LLM, SamplingParams
    kw = dict(max_model_len=1024, dtype="bfloat16")
    if args.model_config:
        llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", skip_tokenizer_init=True, **kw)
    else:
        llm = LLM(**kw)       # the embedded SmolLM2, with its tokenizer (detokenization is timed)
    engine = llm.llm_engine
    runner = engine.executor.runner
    for i in range(args.num_requests):
        engine.add_request(None, {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]},
                           SamplingParams(temperature=0.6, max_tokens=10_000, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()                       # prefill everything first; then time pure decode steps
    engine.step()
    totals = collections.defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    runner._prepare_inputs = timed(totals, "prepare_inputs", runner._prepare_inputs)
    runner._forward = timed(totals, "forward", runner._forward)
    import pagoda.runner.model_runner as mr
    orig_sample = mr.sample
    mr.sample = timed(totals, "sample_only", orig_sample)
    engine.scheduler.update_from_output = timed(totals, "update_and_detokenize", engine.scheduler.update_from_output)
    engine.output_processor.process = timed(totals, "update_and_detokenize", engine.output_processor.process)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    mr.sample = orig_sample
    execute = wall - totals["schedule"] / args.steps - totals["update_and_detokenize"] / args.steps
    per_step = {k: v / args.steps * 1e3 for k, v in totals.items()}
    per_step["logits_and_sample"] = execute * 1e3 - per_step["prepare_inputs"] - per_step["forward"]
    per_step["wall"] = wall * 1e3
    outside = per_step["wall"] - per_step["forward"] - per_step["logits_and_sample"]
    result = {"device": str(runner.device), "batch": args.num_requests, "ms_per_step": per_step,
              "python_outside_model_ms": outside}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"step_overhead_{runner.device.type}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"decode step, batch {args.num_requests}, on {runner.device}:")
    for k in PHASES + ["wall"]:
        print(f"  {k:24} {per_step.get(k, 0.0):9.2f} ms")
    print(f"  Python outside the model (schedule + prepare + update/detokenize): {outside:.2f} ms "
          f"({outside / per_step['wall']:.1%} of the step)")


if __name__ == "__main__":
    main()
