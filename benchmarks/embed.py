"""Embedding throughput (the pooling runner): N prompts of random token ids, each embedded once
(prefill only), prompt tokens a second. Baselines in the same run on the same GPU: HF
transformers' AutoModel forward over length-sorted padded batches, last-token pooling and
normalization as ours; the compute floor (the layers' matmuls at the measured bf16 rate).

  python3 benchmarks/embed.py --model-config ../shared/models/qwen3-0.6b.json --hf
"""
import argparse
import json
import os
import time

from common import (Timer, add_knob_arg, apply_knob_args, dummy_model_dir, hf_model, measure_ceilings, model_config,
                    param_counts)
from throughput import make_requests, vocab_for


def run_pagoda(args, prompts) -> dict:
    from pagoda import LLM
    t0 = time.perf_counter()
    llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", skip_tokenizer_init=True, runner="pooling",
              dtype=args.dtype, max_model_len=max(len(p) for p in prompts) + 1,
              max_num_batched_tokens=args.max_num_batched_tokens)
    startup = time.perf_counter() - t0
    inputs = [{"prompt_token_ids": p} for p in prompts]
    llm.embed(inputs[:8], use_tqdm=False)                 # (compiles outside the timed run)
    with Timer() as t:
        outs = llm.embed(inputs, use_tqdm=False)
    assert len(outs) == len(prompts) and all(len(o.outputs.embedding) == len(outs[0].outputs.embedding) for o in outs)
    return {"engine": "pagoda", "startup_s": startup, "elapsed_s": t.s,
            "prompt_tok_s": sum(map(len, prompts)) / t.s, "requests": len(prompts)}


def run_hf(args, prompts) -> dict:
    """HF's base model, batches of --hf-batch prompts of similar length padded on the right,
    the last real token's hidden state normalized."""
    import torch
    import torch.nn.functional as F
    model = hf_model(args.model_config, args.dtype).model
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with Timer() as t, torch.no_grad():
        for s in range(0, len(order), args.hf_batch):
            batch = [prompts[i] for i in order[s:s + args.hf_batch]]
            lens = torch.tensor([len(p) for p in batch], device="cuda")
            ids = torch.zeros(len(batch), int(lens.max()), dtype=torch.long, device="cuda")
            for r, p in enumerate(batch):
                ids[r, :len(p)] = torch.tensor(p, device="cuda")
            mask = torch.arange(ids.shape[1], device="cuda")[None, :] < lens[:, None]
            hidden = model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
            F.normalize(hidden[torch.arange(len(batch), device="cuda"), lens - 1].float(), dim=-1).cpu()
    del model
    torch.cuda.empty_cache()
    return {"engine": f"hf-forward-b{args.hf_batch}", "elapsed_s": t.s,
            "prompt_tok_s": sum(map(len, prompts)) / t.s, "requests": len(prompts)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    p.add_argument("--skip-floor", action="store_true", help="no ceilings measured (A/B runs)")
    p.add_argument("--hf", action="store_true")
    p.add_argument("--hf-batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    add_knob_arg(p)
    args = p.parse_args()
    apply_knob_args(args)
    args.output_len = [1, 1]
    prompts, _ = make_requests(args.num_requests, args.prompt_len, args.output_len, vocab_for(args), args.seed)
    rows = [run_pagoda(args, prompts)]
    if args.hf:
        rows.append(run_hf(args, prompts))
    import torch
    ceilings = measure_ceilings() if torch.cuda.is_available() and not args.skip_floor else None
    layers, _ = param_counts(model_config(args.model_config))
    floor = 2 * layers * sum(map(len, prompts)) / ceilings["bf16_flops_per_s"] if ceilings else float("nan")
    result = {"rows": rows, "compute_floor_s": floor, "ceilings": ceilings,
              "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "dtype": args.dtype,
                           "model": args.model_config}}
    os.makedirs(args.out, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.model_config))[0]
    with open(os.path.join(args.out, f"embed_{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'engine':20s} {'requests':>8s} {'run s':>8s} {'prompt tok/s':>13s} {'floor / run':>12s}")
    for r in rows:
        print(f"{r['engine']:20s} {r['requests']:8d} {r['elapsed_s']:8.2f} {r['prompt_tok_s']:13.0f} "
              f"{floor / r['elapsed_s']:12.2f}")


if __name__ == "__main__":
    main()
