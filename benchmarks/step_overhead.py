"""Where one engine step's wall time goes: scheduling, input preparation, the upload of the
step's inputs, the model forward, logits, sampling, the runner's other work (new requests'
state, sampling parameters), waiting for the device, and the bookkeeping after (scheduler
update, detokenization, outputs). A phase that takes long for what it queues is where the host
waits for the device. The host's own time per step (wall minus the wait) must stay far
below the device's; with async scheduling it overlaps the device's work on the next step.

  python benchmarks/step_overhead.py                      # SmolLM2 on this CPU, 256 requests
  python benchmarks/step_overhead.py --model-config benchmarks/models/qwen3-0.6b.json   # GPU
"""
import argparse
import collections
import contextlib
import functools
import json
import os
import time

from common import add_knob_arg, apply_knob_args, dummy_model_dir, on_off

PHASES = ["schedule", "prepare_inputs", "upload", "forward", "logits", "sample", "other_execute",
          "wait_for_device", "update_and_detokenize"]


def timed(totals, name, fn):
    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            totals[name] += time.perf_counter() - t0
    return wrapper


def print_runtime_calls(prof, wall_s: float) -> None:
    """The CUDA runtime / driver calls by host time (a synchronizing call shows up long), and how
    busy the GPU was over the traced steps."""
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events if e.self_device_time_total > 0) / 1e6
    print(f"traced steps: wall {wall_s * 1e3:.1f} ms, GPU kernels {gpu * 1e3:.1f} ms ({gpu / wall_s:.0%} busy)")
    calls = sorted((e for e in events if e.key.startswith(("cuda", "cu")) and e.self_cpu_time_total > 0),
                   key=lambda e: -e.self_cpu_time_total)[:12]
    for e in calls:
        print(f"  {e.key[:40]:40s} {e.count:7d} calls {e.self_cpu_time_total / 1e3:9.2f} ms host "
              f"({e.self_cpu_time_total / max(e.count, 1):.1f} us each)")


def torch_alloc_retries() -> int:
    import torch
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="decode steps to time")
    p.add_argument("--prefill", action="store_true",
                   help="time the prefill steps (every prompt, default batch limits) instead of decode steps")
    p.add_argument("--cprofile", action="store_true", help="also print the host's top functions (cProfile)")
    p.add_argument("--trace", action="store_true",
                   help="also print the CUDA runtime calls' host time (torch.profiler): where the host blocks")
    p.add_argument("--async-scheduling", type=on_off, default=None, help="on / off (default: the engine's)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    from pagoda import LLM, SamplingParams
    from pagoda.runner import model_runner as mr
    from pagoda.sampling_params import RequestOutputKind
    kw = dict(max_model_len=max(1024, args.prompt_len + 64), dtype="bfloat16", async_scheduling=args.async_scheduling)
    if args.model_config:
        llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", skip_tokenizer_init=True, **kw)
    else:
        llm = LLM(**kw)       # the embedded SmolLM2, with its tokenizer (detokenization is timed)
    engine = llm.llm_engine
    runner = engine.executor.runner
    for i in range(args.num_requests):
        engine.add_request(None, {"prompt_token_ids": [(7 * i + j) % 1000 + 10 for j in range(args.prompt_len)]},
                           # FINAL_ONLY as LLM.generate sets it: no RequestOutput until a request ends
                           SamplingParams(temperature=0.6, max_tokens=10_000, ignore_eos=True,
                                          output_kind=RequestOutputKind.FINAL_ONLY))
    def prefilling():
        return any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values())

    if not args.prefill:
        while prefilling():
            engine.step()                   # prefill everything first; then time pure decode steps
        engine.step()
        engine.step()
    totals = collections.defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    runner.execute_model = timed(totals, "execute", runner.execute_model)
    runner.prepare_inputs = timed(totals, "prepare_inputs", runner.prepare_inputs)
    runner._forward = timed(totals, "forward", runner._forward)
    runner._upload = timed(totals, "upload", runner._upload)
    runner.model.compute_logits = timed(totals, "logits", runner.model.compute_logits)
    sample = mr.sample
    mr.sample = timed(totals, "sample", sample)
    get_output = mr.AsyncRunnerOutput.get_output
    mr.AsyncRunnerOutput.get_output = timed(totals, "get_output", get_output)
    runner._record_sampled = timed(totals, "record_sampled", runner._record_sampled)
    engine.scheduler.update_from_output = timed(totals, "update", engine.scheduler.update_from_output)
    engine.output_processor.process = timed(totals, "update", engine.output_processor.process)
    profiler = None
    if args.cprofile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    retries = torch_alloc_retries()
    with contextlib.ExitStack() as stack:
        trace = None
        if args.trace:
            from torch.profiler import ProfilerActivity, profile
            trace = stack.enter_context(profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]))
        t0 = time.perf_counter()
        if args.prefill:
            args.steps = 0
            while prefilling():
                engine.step()
                args.steps += 1
        else:
            for _ in range(args.steps):
                engine.step()
        wall = (time.perf_counter() - t0) / args.steps
    retries = torch_alloc_retries() - retries
    if trace is not None:
        print_runtime_calls(trace, wall * args.steps)
    if profiler is not None:
        import pstats
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    mr.AsyncRunnerOutput.get_output, mr.sample = get_output, sample
    ms = collections.defaultdict(float, {k: v / args.steps * 1e3 for k, v in totals.items()})
    per_step = {
        "schedule": ms["schedule"], "prepare_inputs": ms["prepare_inputs"], "upload": ms["upload"],
        "forward": ms["forward"], "logits": ms["logits"], "sample": ms["sample"],
        "other_execute": ms["execute"] - sum(ms[k] for k in ("prepare_inputs", "upload", "forward", "logits",
                                                             "sample")),
        "wait_for_device": ms["get_output"] - ms["record_sampled"],
        "update_and_detokenize": ms["update"] + ms["record_sampled"],
        "wall": wall * 1e3,
    }
    host = per_step["wall"] - per_step["wait_for_device"]
    result = {"device": str(runner.device), "batch": args.num_requests, "async_scheduling": engine.async_scheduling,
              "ms_per_step": per_step, "host_ms_per_step": host}
    os.makedirs(args.out, exist_ok=True)
    tag = ("prefill_" if args.prefill else "") + ("async" if engine.async_scheduling else "sync")
    with open(os.path.join(args.out, f"step_overhead_{runner.device.type}_{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"CUDA allocator retries (each frees cached memory after a device sync) in the timed steps: {retries}")
    print(f"{'prefill' if args.prefill else 'decode'} step ({args.steps} timed), batch {args.num_requests}, "
          f"on {runner.device}, async scheduling {engine.async_scheduling}:")
    for k in PHASES + ["wall"]:
        print(f"  {k:24} {per_step[k]:9.2f} ms")
    print(f"  host time per step (wall - wait for the device): {host:.2f} ms ({host / per_step['wall']:.1%} of the step)")


if __name__ == "__main__":
    main()
