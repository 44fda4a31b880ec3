"""Where a decode step's time goes: cProfile of the Python side and torch.profiler's GPU kernel
time, for one batch size.

  python benchmarks/profile_step.py --model-config benchmarks/models/qwen3-0.6b.json --batch 1
"""
import argparse
import cProfile
import io
import os
import pstats
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Timer, dummy_model_dir  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-config", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    import torch
    from pagoda import LLM, SamplingParams
    llm = LLM(dummy_model_dir(args.model_config), load_format="dummy", dtype="bfloat16", max_model_len=1024,
              skip_tokenizer_init=True)
    inputs = [{"prompt_token_ids": [i + 1] * 512} for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    llm.generate(inputs, params, use_tqdm=False)
    prof = cProfile.Profile()
    with Timer() as t:
        prof.enable()
        llm.generate(inputs, params, use_tqdm=False)
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue()[-6000:])
    print(f"wall per step (with cProfile on): {t.s / args.steps * 1e3:.2f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        llm.generate(inputs, params, use_tqdm=False)
    print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
    with Timer() as t:
        llm.generate(inputs, params, use_tqdm=False)
    print(f"wall per step: {t.s / args.steps * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
