"""W1 offline throughput (DESIGN.md), and the CPU workload of issue 2.

  python benchmarks/throughput.py --cpu-workload                 # SmolLM2 bf16 on this CPU
  python benchmarks/throughput.py --model-config ../shared/models/qwen3-0.6b.json   # W1, GPU

Random token-id prompts, ignore_eos, one seed. Prints a table and writes JSON (and a plot of
the per-step batch composition) to --out.
"""
import argparse
import itertools
import json
import os
import time

import numpy as np

from common import (DUMMY_QUANT_CONFIGS, Timer, TritonCompiles, add_knob_arg, add_lora_args, apply_knob_args,
                    bar_chart, dummy_model_dir, hf_model, host_profile, lora_setup, measure_ceilings, model_config,
                    on_off, param_counts, weight_bytes)


def random_token_ids(lengths, vocab: int, rng: np.random.Generator) -> list[list[int]]:
    """One prompt of random token ids per length."""
    return [rng.integers(0, vocab, int(n)).tolist() for n in lengths]


def make_requests(n, prompt_range, output_range, vocab, seed):
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, n)
    return random_token_ids(prompt_lens, vocab, rng), output_lens.tolist()


def vocab_for(args) -> int:
    """--model-config's vocabulary size (SmolLM2's without one)."""
    if args.model_config:
        with open(args.model_config) as f:
            return json.load(f)["vocab_size"]
    return 49152


def requests_for(args, n):
    """make_requests over ``vocab_for(args)``, --prompt-len, --output-len and --seed."""
    return make_requests(n, args.prompt_len, args.output_len, vocab_for(args), args.seed)


def run_pagoda(args, prompts, output_lens):
    from pagoda import LLM, SamplingParams
    kwargs = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs,   # None: the engine's defaults
                  max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
                  async_scheduling=args.async_scheduling, enable_prefix_caching=args.prefix_caching,
                  tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                  data_parallel_size=args.data_parallel_size,
                  kv_cache_dtype=args.kv_cache_dtype,
                  disable_hybrid_kv_cache_manager=not args.hybrid_kv_cache)
    if args.max_model_len:
        kwargs["max_model_len"] = args.max_model_len
    if args.block_size:
        kwargs["block_size"] = args.block_size
    if args.kv_cache_gib:
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    model = args.model
    if args.model_config:
        model, kwargs["load_format"] = dummy_model_dir(args.model_config, args.quantization), "dummy"
        kwargs["skip_tokenizer_init"] = True
    lora_kwargs, loras = lora_setup(args, model_config(args.model_config) if args.model_config else None)
    t0 = time.perf_counter()
    llm = LLM(model, **kwargs, **lora_kwargs)
    startup = time.perf_counter() - t0
    params = [SamplingParams(temperature=args.temperature, top_p=args.top_p, ignore_eos=True, max_tokens=int(o),
                             seed=None) for o in output_lens]
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # (with LoRA adapters, the requests take them in turn)
    lora_requests = loras and [loras[i % len(loras)] for i in range(len(inputs))]
    with TritonCompiles() as compiles:
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=not args.no_tqdm, lora_request=lora_requests)
        elapsed = time.perf_counter() - t0
    print(f"Triton kernels compiled or loaded during the timed run: {compiles.summary()}")
    for variant in compiles.variants:
        print(f"  variant: {variant[:400]}")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(p) for p in prompts)
    assert n_out == sum(output_lens), "every request must produce exactly max_tokens tokens"
    engine = llm.llm_engine
    if args.profile:
        profile_run(llm, inputs, params, args.out, model_config(args.model_config, args.quantization) if args.model_config else None)
    return {"engine": "pagoda", "startup_s": startup, "elapsed_s": elapsed,
            "output_tok_s": n_out / elapsed, "total_tok_s": (n_in + n_out) / elapsed,
            "requests": len(prompts), "prompt_tokens": n_in, "output_tokens": n_out,
            "async_scheduling": engine.async_scheduling, "prefix_caching": args.prefix_caching,
            "steps": engine.stats.num_steps,
            "preemptions": engine.stats.num_preemptions, "hybrid_kv_cache": args.hybrid_kv_cache,
            "kv_blocks": engine.stats.num_kv_blocks,     # (summed over data-parallel replicas)
            "max_num_batched_tokens": engine.config.scheduler.max_num_batched_tokens,
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
            "triton_compiles_in_run": len(compiles.kernels), "triton_compile_s_in_run": compiles.seconds}


KERNEL_KINDS = [("attention", ("paged_attention", "merge_segments")), ("sampling", ("sample", "softmax", "cumsum",
                 "argmax", "searchsorted", "rand", "topk", "sort")), ("gemm", ("gemm", "gemv", "sm90", "cutlass", "xmma",
                 "splitk", "nvjet", "cublas", "small_m_linear")), ("fused ops", ("rms_norm", "rotary", "silu", "write_kv"))]


def profile_kernels(llm, inputs, params):
    """GPU kernel time by kind (torch.profiler) against the wall time of the same run."""
    from torch.profiler import ProfilerActivity, profile
    llm.reset_prefix_cache()
    with Timer() as t, profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(inputs, params, use_tqdm=False)
    kinds: dict[str, float] = {}
    for e in prof.key_averages():
        if e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(w in name for w in keys)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + e.self_device_time_total / 1e6
    total = sum(kinds.values())
    print(f"profiled run: wall {t.s:.2f} s, GPU kernels {total:.2f} s ({total / t.s:.0%} busy)")
    for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {k:12} {v:7.3f} s  {v / total:6.1%}")
    top = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0),
                 key=lambda e: -e.self_device_time_total)[:24]
    for e in top:
        print(f"    {e.self_device_time_total / 1e6:7.3f} s {e.count:8d}x  {e.key[:90]}")


def profile_steps(llm, inputs, params, cfg=None, ceilings=None):
    """Per engine step: wall time, and how much of it the host spent waiting for the device's
    results, by batch size. Where the wait is near zero the host is the bottleneck (the GPU
    idles between steps); where it is large the GPU is. With the model's config and the
    measured ceilings, also the roofline of the run's own steps (``step_floor_s``)."""
    from pagoda.runner import model_runner as mr
    engine = llm.llm_engine
    waits, steps, seen = [0.0], [], {}
    get_output, step = mr.AsyncRunnerOutput.get_output, engine.step

    def computed() -> int:  # tokens computed so far by every request seen (finished ones too)
        return sum(r.num_computed_tokens for r in seen.values())

    def timed_get_output(self):
        t0 = time.perf_counter()
        try:
            return get_output(self)
        finally:
            waits[0] += time.perf_counter() - t0

    def timed_step():
        sched = engine.scheduler
        batch, waits[0] = len(sched.running), 0.0
        # a step that may compute prompt tokens (requests still waiting or part-prefilled)
        prefill = bool(sched.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        context = sum(r.num_computed_tokens for r in sched.running)  # tokens of KV the step reads
        seen.update((r.request_id, r) for r in itertools.chain(sched.running, sched.waiting))
        before = computed()
        t0 = time.perf_counter()
        out = step()
        wall = time.perf_counter() - t0
        steps.append((batch, wall, waits[0], prefill, context, max(0, computed() - before)))
        return out

    mr.AsyncRunnerOutput.get_output, engine.step = timed_get_output, timed_step
    try:
        llm.reset_prefix_cache()
        with Timer() as run:
            llm.generate(inputs, params, use_tqdm=False)
    finally:
        mr.AsyncRunnerOutput.get_output = get_output
        del engine.step
    caches = engine.executor.runner.kv_caches
    token_kv_bytes = sum(c[:, 0, 0].numel() * c.element_size() for c in caches)
    print("steps by batch size: count, wall ms/step, of which waiting for the device (get_output);\n"
          "steps that may compute prompt tokens apart (batch = running requests before the step);\n"
          "KV GB/s = the KV cache read by the step's attention over its wall time")
    for kind in (True, False):
        label = "prefill" if kind else "decode "
        for lo, hi in [(0, 8), (8, 32), (32, 64), (64, 128), (128, 192), (192, 257)]:
            sel = [(w, g, c) for b, w, g, p, c, _ in steps if lo <= b < hi and p == kind]
            if sel:
                total = sum(w for w, _, _ in sel)
                wall = total / len(sel) * 1e3
                wait = sum(g for _, g, _ in sel) / len(sel) * 1e3
                kv = sum(c for _, _, c in sel) * token_kv_bytes / total / 1e9
                print(f"  {label} batch {lo:3d}-{hi - 1:3d}: {len(sel):5d} steps  wall {wall:6.2f}  wait {wait:6.2f}  "
                      f"host {wall - wait:6.2f}  ({total:6.2f} s, KV {kv:5.0f} GB/s)")
    total = sum(s[1] for s in steps)
    print(f"  all: {len(steps)} steps, {total:.2f} s, waiting {sum(s[2] for s in steps):.2f} s; the generate call "
          f"{run.s:.2f} s, of which {run.s - total:.3f} s outside the steps")
    if cfg and ceilings:
        floor = step_floor(cfg, ceilings, [(b, c, n) for b, _, _, _, c, n in steps], token_kv_bytes)
        print(f"roofline of these steps (each: the weight read or its matmuls, whichever is longer, plus "
              f"its KV read): {floor:.2f} s; the steps took {total:.2f} s ({total / floor:.2f}x)")


def step_floor(cfg: dict, ceilings: dict, steps, token_kv_bytes: int) -> float:
    """Seconds a run's own steps need at the measured ceilings. steps: (requests, context tokens
    read, tokens computed) per step. A step reads the weights once (``weight_bytes``) and runs
    each computed token through the decoder layers and each request's sampled row through the LM head, so it
    takes the longer of the read and the matmuls; then it reads its KV."""
    layers, head = param_counts(cfg)
    flops_s = ceilings["bf16_flops_per_s"]
    return sum(max(weight_bytes(cfg, tokens) / ceilings["copy_bytes_per_s"],
                   (2 * layers * tokens + 2 * head * requests) / flops_s)
               + context * token_kv_bytes / ceilings["copy_bytes_per_s"]
               for requests, context, tokens in steps)


def schedule_floor(args, prompts, output_lens, cfg: dict, ceilings: dict, max_num_batched_tokens: int,
                   max_num_seqs: int) -> dict:
    """The engine's scheduler run alone on the workload (a fake model: every step samples token
    7), no GPU needed: its steps, and their roofline (``step_floor``) at the given ceilings."""
    from pagoda.config import SchedulerConfig
    from pagoda.core.kv_cache_manager import KVCacheManager
    from pagoda.core.request import Request
    from pagoda.core.scheduler import Scheduler
    from pagoda.core.sched_output import ModelRunnerOutput
    from pagoda.sampling_params import SamplingParams
    block_size = 16
    max_len = max(len(p) + o for p, o in zip(prompts, output_lens))
    blocks = sum(-(-(len(p) + o) // block_size) for p, o in zip(prompts, output_lens)) + 1  # never preempts
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_len),
                      KVCacheManager(blocks, block_size, enable_caching=args.prefix_caching))
    for i, (p, o) in enumerate(zip(prompts, output_lens)):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=o, ignore_eos=True), None, max_tokens=o))
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        rows = [sched.requests[rid] for rid in out.num_scheduled_tokens]
        sampled = {r.request_id: 7 for r in rows if r.num_computed_tokens == r.num_tokens}
        steps.append((len(sampled), sum(r.num_computed_tokens for r in rows), out.total_num_scheduled_tokens))
        sched.update_from_output(out, ModelRunnerOutput(sampled))
    floor = step_floor(cfg, ceilings, steps, kv_bytes_per_token(cfg, args.kv_cache_dtype))
    return {"steps": len(steps), "step_floor_s": floor, "output_tok_s_at_floor": sum(output_lens) / floor}


def profile_run(llm, inputs, params, out_dir, cfg=None):
    """The same run twice more: under torch.profiler (GPU kernel time by kind against wall time)
    and under cProfile (the host's hottest functions; cProfile slows the host, so read its
    shares, not its times)."""
    import torch
    ceilings = measure_ceilings() if cfg and torch.cuda.is_available() else None
    profile_steps(llm, inputs, params, cfg, ceilings)
    if torch.cuda.is_available():
        profile_kernels(llm, inputs, params)
    host_profile(llm, inputs, params, path=os.path.join(out_dir, "w1_host.prof"))


def run_hf(args, prompts, output_lens):
    """HF transformers' continuous batching (generate_batch) on the same GPU: the first
    --hf-requests requests with a fixed number of output tokens (it takes one max_new_tokens)."""
    import torch
    from transformers import GenerationConfig
    model = hf_model(args.model_config)
    n, out_len = args.hf_requests, args.hf_output_len
    gen = GenerationConfig(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=True,
                           temperature=args.temperature, top_p=args.top_p, eos_token_id=-1, pad_token_id=0)
    with Timer() as t:
        res = model.generate_batch(inputs=prompts[:n], generation_config=gen)
    n_out = sum(len(r.generated_tokens) for r in res.values())
    del model
    torch.cuda.empty_cache()
    return {"engine": "hf-generate_batch", "elapsed_s": t.s, "output_tok_s": n_out / t.s,
            "total_tok_s": (n_out + sum(len(p) for p in prompts[:n])) / t.s, "requests": n,
            "output_tokens": n_out}


def compute_floor(cfg: dict, prompts, output_lens, ceilings) -> float:
    """Seconds the matmuls alone need at the measured bf16 rate: every token through the decoder
    layers, every output token through the LM head, plus causal attention scores."""
    layers, head = param_counts(cfg)
    n_in, n_out = sum(len(p) for p in prompts), sum(output_lens)
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = sum(2 * 2 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * hd * ((len(p) + o) ** 2) / 2
               for p, o in zip(prompts, output_lens))
    return (2 * layers * (n_in + n_out) + 2 * head * n_out + attn) / ceilings["bf16_flops_per_s"]


def kv_read_floor(cfg: dict, prompts, output_lens, ceilings, kv_cache_dtype: str) -> float:
    """Seconds the decode steps need just to read every request's KV context once per output
    token, at the measured copy rate: for a small model with long contexts this, not the
    matmuls, is the floor."""
    tokens = sum(o * len(p) + o * (o - 1) / 2 for p, o in zip(prompts, output_lens))
    return tokens * kv_bytes_per_token(cfg, kv_cache_dtype) / ceilings["copy_bytes_per_s"]


def kv_bytes_per_token(cfg: dict, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token over all layers: bf16, or one byte an element in an FP8 cache."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * (1 if kv_cache_dtype.startswith("fp8") else 2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu-workload", action="store_true",
                   help="issue 2's CPU workload: SmolLM2 bf16, prompts 64-256, outputs 32-128")
    p.add_argument("--model", default=None)
    p.add_argument("--model-config", default=None, help="config.json for dummy weights")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0, help="0.9: the spec's sample")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=sorted(DUMMY_QUANT_CONFIGS), default=None,
                   help="W5: dummy 4-bit weights in this checkpoint format (with --model-config)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: the engine's (1,024 on an H200)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: the engine's (16,384 on an H200, as vLLM's offline default there)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None, help="KV cache block size (default: the engine's, 16)")
    p.add_argument("--kv-cache-gib", type=float, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf", action="store_true", help="also run HF transformers' generate_batch (GPU)")
    p.add_argument("--hf-requests", type=int, default=64)
    p.add_argument("--hf-output-len", type=int, default=256)
    p.add_argument("--no-tqdm", action="store_true")
    p.add_argument("--async-scheduling", type=on_off, default=None, help="on / off (default: on for CUDA)")
    p.add_argument("--prefix-caching", type=on_off, default=True, help="on / off (default: on, as in vLLM)")
    p.add_argument("--hybrid-kv-cache", type=on_off, default=True,
                   help="on / off: layers with and without a sliding window in KV cache groups (Gemma 2/3)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed run, GPU kernel time by kind (torch.profiler) and the host's hot spots (cProfile)")
    p.add_argument("--schedule-floor", type=float, nargs=2, metavar=("TB_S", "TFLOP_S"),
                   help="no run: the roofline of the scheduler's steps for this workload (with --model-config) at "
                        "these ceilings (copy TB/s, bf16 TFLOP/s); CPU only")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    add_lora_args(p)
    args = p.parse_args()
    apply_knob_args(args)
    if args.cpu_workload:
        args.prompt_len, args.output_len = [64, 256], [32, 128]
        args.max_model_len = args.max_model_len or 512
    prompts, output_lens = requests_for(args, args.num_requests)
    if args.schedule_floor:
        cfg = model_config(args.model_config, args.quantization)
        ceilings = {"copy_bytes_per_s": args.schedule_floor[0] * 1e12, "bf16_flops_per_s": args.schedule_floor[1] * 1e12}
        # (without a GPU, the engine's defaults on an H200 unless given)
        print(json.dumps(schedule_floor(args, prompts, output_lens, cfg, ceilings,
                                        args.max_num_batched_tokens or 16384, args.max_num_seqs or 1024)))
        return
    result = run_pagoda(args, prompts, output_lens)
    rows = [result]
    import torch
    if torch.cuda.is_available() and args.model_config:
        cfg = model_config(args.model_config, args.quantization)
        result["ceilings"] = measure_ceilings()
        result["compute_floor_s"] = compute_floor(cfg, prompts, output_lens, result["ceilings"])
        result["kv_read_floor_s"] = kv_read_floor(cfg, prompts, output_lens, result["ceilings"], args.kv_cache_dtype)
        # the roofline of the engine's own schedule at the ceilings just measured
        result["schedule_floor"] = schedule_floor(args, prompts, output_lens, cfg, result["ceilings"],
                                                  result["max_num_batched_tokens"], result["max_num_seqs"])
        if args.hf:
            try:
                result["hf"] = run_hf(args, prompts, output_lens)
                rows.append(result["hf"])
                result["speedup_vs_hf_output_tok_s"] = result["output_tok_s"] / result["hf"]["output_tok_s"]
            except Exception as e:     # a baseline failure must not lose our own figures
                result["hf_error"] = repr(e)
    result["workload"] = {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                          "output_len": args.output_len, "temperature": args.temperature, "top_p": args.top_p,
                          "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
                          "num_loras": args.num_loras, "lora_rank": args.lora_rank, "model": args.model_config or args.model or "SmolLM2-135M"}
    os.makedirs(args.out, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.model_config or args.model or "smollm2"))[0]
    name += f"-{args.quantization}" if args.quantization else ""
    name += f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    # (the floors above are one GPU's; the printed roofline divides by the tensor-parallel size)
    name += f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    name += f"-pp{args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else ""
    name += f"-dp{args.data_parallel_size}" if args.data_parallel_size > 1 else ""
    name += f"-lora{args.num_loras}r{args.lora_rank}" if args.num_loras else ""
    result["tensor_parallel_size"] = args.tensor_parallel_size
    result["pipeline_parallel_size"] = args.pipeline_parallel_size
    result["data_parallel_size"] = args.data_parallel_size
    tag = ("async" if result["async_scheduling"] else "sync") + ("" if args.prefix_caching else "_nocache") \
        + ("" if args.hybrid_kv_cache else "_nohybrid")
    with open(os.path.join(args.out, f"throughput_{name}_{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "hf"}, default=str))
    print(f"{'engine':18} {'requests':>8} {'startup s':>9} {'run s':>8} {'out tok/s':>10} {'total tok/s':>11}")
    for r in rows:
        print(f"{r['engine']:18} {r['requests']:8d} {r.get('startup_s', float('nan')):9.1f} {r['elapsed_s']:8.1f} "
              f"{r['output_tok_s']:10.1f} {r['total_tok_s']:11.1f}")
    series = {r["engine"]: [r["output_tok_s"]] for r in rows}
    if "schedule_floor" in result:
        floor, tp = result["schedule_floor"], args.tensor_parallel_size
        across = f" over {tp} GPUs (one GPU's / {tp}: no all-reduce cost)" if tp > 1 else ""
        print(f"roofline of this schedule{across} {floor['step_floor_s'] / tp:.2f} s "
              f"({floor['output_tok_s_at_floor'] * tp:.0f} output tok/s); "
              f"pagoda at {result['elapsed_s'] * tp / floor['step_floor_s']:.2f}x")
        series["floor"] = [floor["output_tok_s_at_floor"] * tp]
    plot = os.path.join(args.out, f"throughput_{name}_{tag}.png")
    if bar_chart(plot, f"W1 offline throughput, {name}", "output tok/s", [name], series):
        print(f"plot: {plot}")


if __name__ == "__main__":
    main()
