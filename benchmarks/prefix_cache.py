"""W4 prefix reuse (DESIGN.md, issue 4): multi-turn chats sharing one long system prompt.

  python benchmarks/prefix_cache.py --model-config ../shared/models/llama3-8b.json   # H200
  python benchmarks/prefix_cache.py --cpu                                            # SmolLM2, scaled down

Each of --conversations chats runs --turns turns. Turn t's prompt is the whole history: the
shared system prompt, then every earlier user turn and the answer the engine generated for
it, then the new user turn. All conversations' turn t run as one batch, turns one after the
other. Random token ids, greedy, ignore_eos. The same workload runs with prefix caching off
(the baseline) and on, in one process; prints a table, writes JSON and a plot to --out.
"""
import argparse
import json
import os
import time

import numpy as np

from common import dummy_model_dir


def make_turns(args, vocab: int):
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab, args.system_len).tolist()
    users = rng.integers(0, vocab, (args.conversations, args.turns, args.user_len)).tolist()
    return system, users


def run(args, model, kwargs, caching: bool, system, users) -> dict:
    from pagoda import LLM, SamplingParams
    llm = LLM(model, enable_prefix_caching=caching, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_len, ignore_eos=True)
    histories = [list(system) for _ in users]
    per_turn, answers = [], []
    t_all = time.perf_counter()
    for t in range(args.turns):
        for h, u in zip(histories, users):
            h += u[t]
        before = llm.get_stats()
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": h} for h in histories], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        after = llm.get_stats()
        for h, o in zip(histories, outs):
            h += o.outputs[0].token_ids
            answers.append(o.outputs[0].token_ids)
        per_turn.append({"turn": t + 1, "seconds": dt,
                         "prompt_tokens": after.num_prompt_tokens - before.num_prompt_tokens,
                         "prefill_computed": after.num_prompt_tokens_computed - before.num_prompt_tokens_computed})
    elapsed = time.perf_counter() - t_all
    s = llm.get_stats()
    del llm
    return {"prefix_caching": caching, "elapsed_s": elapsed, "turns": per_turn, "answers": answers,
            "prompt_tokens": s.num_prompt_tokens, "prefill_computed": s.num_prompt_tokens_computed,
            "generated_tokens": s.num_generation_tokens, "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "preemptions": s.num_preemptions}


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    turns = [t["turn"] for t in results[0]["turns"]]
    for r in results:
        label = "caching on" if r["prefix_caching"] else "caching off"
        a.plot(turns, [t["seconds"] for t in r["turns"]], marker="o", label=label)
        b.plot(turns, [t["prefill_computed"] for t in r["turns"]], marker="o", label=label)
    a.set(xlabel="turn", ylabel="seconds", title="time per turn")
    b.set(xlabel="turn", ylabel="prompt tokens computed", title="prefill work per turn")
    a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="model path (default: SmolLM2)")
    p.add_argument("--model-config", default=None, help="config.json for dummy weights")
    p.add_argument("--cpu", action="store_true", help="SmolLM2 on CPU, scaled down: 8 chats, 400-token system prompt, 25-token turns")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=1500)
    p.add_argument("--user-len", type=int, default=100)
    p.add_argument("--answer-len", type=int, default=100)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    kwargs = dict(dtype=args.dtype, seed=0, max_model_len=4096)
    model, vocab = args.model, 49152
    if args.cpu:
        args.conversations, args.system_len, args.user_len, args.answer_len = 8, 400, 25, 25
        kwargs.update(dtype="auto", max_model_len=1024)
    if args.model_config:
        with open(args.model_config) as f:
            vocab = json.load(f)["vocab_size"]
        model = dummy_model_dir(args.model_config)
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    system, users = make_turns(args, vocab)
    results = [run(args, model, kwargs, caching, system, users) for caching in (False, True)]
    off, on = results
    # Greedy answers with caching on should equal those with it off: exactly in float32; in
    # half precision a different batch shape may flip a near-tie (then the histories differ).
    same = sum(a == b for a, b in zip(off.pop("answers"), on.pop("answers")))
    summary = {"speedup": off["elapsed_s"] / on["elapsed_s"], "answers_equal": same,
               "answers": args.conversations * args.turns,
               "prefill_reduction": 1 - on["prefill_computed"] / off["prefill_computed"],
               "workload": {k: getattr(args, k) for k in ("conversations", "turns", "system_len", "user_len",
                                                          "answer_len", "dtype")},
               "model": args.model_config or args.model or "SmolLM2-135M-Instruct", "runs": results}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
        json.dump(summary, f, indent=2)
    plot(results, os.path.join(args.out, "prefix_cache.png"))
    print(f"{'prefix caching':15} {'time s':>8} {'prompt tok':>11} {'prefill computed':>17} {'hit rate':>9}")
    for r in results:
        print(f"{'on' if r['prefix_caching'] else 'off':15} {r['elapsed_s']:8.2f} {r['prompt_tokens']:11d} "
              f"{r['prefill_computed']:17d} {100 * r['prefix_cache_hit_rate']:8.1f}%")
    print(f"caching on: {summary['speedup']:.2f}x faster, prefill computed reduced by "
          f"{100 * summary['prefill_reduction']:.1f}%; greedy answers equal on/off: {same} of "
          f"{summary['answers']}")


if __name__ == "__main__":
    main()
