"""W2 decode latency (DESIGN.md): batch B of 512-token random prompts, 256 output tokens, dummy
weights. ms per decode step = (time for 256 tokens - time for 1 token) / 255, beside HF
transformers' generate on the same GPU and the bandwidth floor (weights + KV read per step).

  python benchmarks/latency.py --model-config ../shared/models/llama3-8b.json --batch 1 8 64 --hf
"""
import argparse
import json
import os
import time

import numpy as np

from common import (DUMMY_QUANT_CONFIGS, Timer, add_knob_arg, add_lora_args, apply_knob_args, bar_chart,
                    dummy_model_dir, hf_model, host_profile, lora_setup, measure_ceilings, model_config, on_off,
                    weight_bytes)


def prompts_for(batch, length, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).tolist() for _ in range(batch)]


def pagoda_latency(llm, prompts, out_len, loras=None):
    from pagoda import SamplingParams
    inputs = [{"prompt_token_ids": p} for p in prompts]
    loras = loras and [loras[i % len(loras)] for i in range(len(inputs))]     # (LoRA adapters in turn)

    def run(n):
        llm.reset_prefix_cache()              # every run prefills its prompts, as W2 defines
        with Timer() as t:
            llm.generate(inputs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False,
                         lora_request=loras)
        return t.s
    run(4)                                    # warm-up (Triton compiles, allocator)
    t1, tn = run(1), run(out_len)
    return {"ttft_ms": t1 * 1e3, "ms_per_step": (tn - t1) / (out_len - 1) * 1e3}


def hf_latency(model, prompts, out_len):
    import torch
    ids = torch.tensor(prompts, device="cuda")

    def run(n):
        with Timer() as t, torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(ids))
        return t.s
    run(2)
    t1, tn = run(1), run(out_len)
    return {"ttft_ms": t1 * 1e3, "ms_per_step": (tn - t1) / (out_len - 1) * 1e3}


def floor_ms(cfg, batch, context, ceilings, kv_elem_bytes=2) -> float:
    """Bytes one decode step must read (weights once, ``weight_bytes``; each sequence's KV) / copy
    bandwidth. The copy bandwidth counts read + write, so reading alone is credited at that rate."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_bytes = 2 * kv_elem_bytes * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * hd * context * batch
    return (weight_bytes(cfg, batch) + kv_bytes) / ceilings["copy_bytes_per_s"] * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf", action="store_true", help="HF generate baseline at batch 1")
    p.add_argument("--quantization", choices=sorted(DUMMY_QUANT_CONFIGS), default=None,
                   help="W5: dummy 4-bit weights in this checkpoint format")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="GPUs the model is split over (the floor then counts each GPU's share)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8 / fp8_e4m3, fp8_e5m2")
    p.add_argument("--async-scheduling", type=on_off, default=None, help="on / off (default: on for CUDA)")
    p.add_argument("--speculative-config", type=json.loads, default=None, metavar="JSON",
                   help="n-gram drafts, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (ms per step "
                        "is then ms per output token; random weights make the acceptance meaningless, not the cost)")
    p.add_argument("--draft-model-config", default=None,
                   help="a draft model of this config (random weights, the target's vocabulary) for the "
                        "speculative config's drafts, e.g. benchmarks/models/llama3.2-1b.json")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, the host's hot spots at the first batch size (cProfile)")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    add_lora_args(p)
    args = p.parse_args()
    apply_knob_args(args)
    from pagoda import LLM, SamplingParams
    cfg = model_config(args.model_config, args.quantization)
    name = os.path.splitext(os.path.basename(args.model_config))[0] + (f"-{args.quantization}" if args.quantization else "")
    name += f"-tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    name += f"-kv{args.kv_cache_dtype}" if args.kv_cache_dtype != "auto" else ""
    ceilings = measure_ceilings()
    lora_kwargs, loras = lora_setup(args, cfg)
    if args.draft_model_config:     # (random weights: its drafts are rejected, each step costs what it costs)
        args.speculative_config = {"num_speculative_tokens": 4, **(args.speculative_config or {}),
                                   "model": dummy_model_dir(args.draft_model_config)}
    t0 = time.perf_counter()
    llm = LLM(dummy_model_dir(args.model_config, args.quantization), load_format="dummy", dtype="bfloat16",
              max_model_len=args.prompt_len + args.output_len + 16, skip_tokenizer_init=True,
              async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config, **lora_kwargs)
    tag = "async" if llm.llm_engine.async_scheduling else "sync"
    if args.speculative_config:
        name += "-draft" if args.draft_model_config else "-ngram"
    name += f"-lora{args.num_loras}r{args.lora_rank}" if args.num_loras else ""
    llm.generate({"prompt_token_ids": [1] * 8}, SamplingParams(max_tokens=1), use_tqdm=False)
    startup = time.perf_counter() - t0
    rows = []
    for b in args.batch:
        r = pagoda_latency(llm, prompts_for(b, args.prompt_len, cfg["vocab_size"]), args.output_len, loras)
        r.update(engine="pagoda", batch=b,
                 floor_ms=floor_ms(cfg, b, args.prompt_len + args.output_len // 2, ceilings,
                                   1 if args.kv_cache_dtype.startswith("fp8") else 2) / args.tensor_parallel_size)
        rows.append(r)
    if args.speculative_config:
        s = llm.llm_engine.stats
        print(f"drafts: {s.num_draft_tokens} tokens in {s.num_drafts} steps of a request, "
              f"{s.num_accepted_tokens} kept ({100 * s.num_accepted_tokens / max(1, s.num_draft_tokens):.1f}%)")
    if args.profile:
        host_profile(llm, [{"prompt_token_ids": p} for p in prompts_for(args.batch[0], args.prompt_len,
                                                                          cfg["vocab_size"])],
                     SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), top=30)
    del llm
    if args.hf:
        import gc
        import torch
        # (the engine's reference cycles would hold its weights and KV cache until then; on CUDA
        # even this left Qwen3-30B-A3B's in use: benchmarks/free_probe.py, not yet run)
        gc.collect()
        torch.cuda.empty_cache()
        model = hf_model(args.model_config)
        r = hf_latency(model, prompts_for(1, args.prompt_len, cfg["vocab_size"]), args.output_len)
        r.update(engine="hf-generate", batch=1, floor_ms=rows[0]["floor_ms"])
        rows.append(r)
    result = {"model": name, "async_scheduling": tag == "async", "startup_to_first_token_s": startup,
              "ceilings": ceilings, "rows": rows}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"latency_{name}_{tag}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{name} ({tag} scheduling): start-up to first token {startup:.1f} s")
    print(f"{'engine':12} {'batch':>5} {'TTFT ms':>8} {'ms/step':>8} {'floor ms':>8} {'x floor':>7}")
    for r in rows:
        print(f"{r['engine']:12} {r['batch']:5d} {r['ttft_ms']:8.1f} {r['ms_per_step']:8.2f} "
              f"{r['floor_ms']:8.2f} {r['ms_per_step'] / r['floor_ms']:7.2f}")
    batches = [r["batch"] for r in rows if r["engine"] == "pagoda"]
    series = {engine: [next((r["ms_per_step"] for r in rows if r["engine"] == engine and r["batch"] == b), None)
                       for b in batches] for engine in dict.fromkeys(r["engine"] for r in rows)}
    series["floor"] = [r["floor_ms"] for r in rows if r["engine"] == "pagoda"]
    plot = os.path.join(args.out, f"latency_{name}_{tag}.png")
    if bar_chart(plot, f"W2 decode latency, {name}", "ms per step", [f"batch {b}" for b in batches], series):
        print(f"plot: {plot}")


if __name__ == "__main__":
    main()
