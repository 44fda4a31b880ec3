"""Pipeline and data parallelism on the CPU with SmolLM2: seconds for one `generate` call of a
small workload, after a warm-up. It imports pagoda from the path as it finds it (no path set
here), so the same script times another checkout: `cd .ab/base && PYTHONPATH=$PWD python3
/path/to/benchmarks/parallel_cpu.py ...`.

  python3 benchmarks/parallel_cpu.py --workload prefill -pp 2
  python3 benchmarks/parallel_cpu.py --workload mixed -dp 2
"""
import argparse
import time

import numpy as np

# (prompts, prompt length range, output length range, max_num_batched_tokens)
WORKLOADS = {"prefill": (16, (400, 400), (8, 8), 512),     # compute-bound chunks of 512 tokens
             "decode": (16, (160, 160), (64, 64), None),     # weight reads a step: bandwidth-bound
             "mixed": (32, (64, 256), (32, 128), None)}      # issue 2's CPU workload's lengths


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="prefill")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    args = p.parse_args()
    import pagoda
    from pagoda import LLM, SamplingParams
    n, prompt_len, output_len, batched = WORKLOADS[args.workload]
    llm = LLM(dtype="float32", max_model_len=512, max_num_batched_tokens=batched,
              pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 49152, int(m)).tolist()}
               for m in rng.integers(prompt_len[0], prompt_len[1] + 1, n)]
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
              for m in rng.integers(output_len[0], output_len[1] + 1, n)]
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{args.workload} pp={args.pipeline_parallel_size} dp={args.data_parallel_size}: {elapsed:.2f} s, "
          f"{tokens / elapsed:.1f} output tok/s ({pagoda.__file__})")


if __name__ == "__main__":
    main()
