"""How full the KV blocks in use are: live tokens / (blocks held x block_size), averaged over the
steps of a workload. The scheduler decides this alone (the model only supplies token ids, and
with ignore_eos their values change nothing), so the W1 schedule is replayed here with a stand-in
model, on the CPU, with the block count the H200 run had.

  python benchmarks/kv_utilization.py --num-blocks 71664        # W1 Qwen3-0.6B on the H200
"""
import argparse
import json

import numpy as np

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda.config import SchedulerConfig
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.request import Request
from pagoda.core.sched_output import ModelRunnerOutput
from pagoda.core.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams

del common  # (imported for its sys.path entry alone)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    p.add_argument("--num-blocks", type=int, default=71664)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    prompt_lens = rng.integers(args.prompt_len[0], args.prompt_len[1] + 1, args.num_requests)
    output_lens = rng.integers(args.output_len[0], args.output_len[1] + 1, args.num_requests)
    kv = KVCacheManager(args.num_blocks, args.block_size)
    sched = Scheduler(SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, 1 << 20), kv)
    for i, (pl, ol) in enumerate(zip(prompt_lens, output_lens)):
        sched.add_request(Request(str(i), [1] * int(pl), SamplingParams(ignore_eos=True, max_tokens=int(ol)),
                                  eos_token_id=None, max_tokens=int(ol)))
    utils, steps = [], 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        held = sum(len(kv.req_to_blocks[r.request_id][0]) for r in sched.running)
        live = sum(r.num_computed_tokens for r in sched.running)
        utils.append((live, held * args.block_size))
        sampled = {rid: 7 for rid in out.num_scheduled_tokens
                   if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens}
        sched.update_from_output(out, ModelRunnerOutput(sampled))
        steps += 1
    live, slots = map(np.array, zip(*utils))
    result = {"steps": steps, "mean_step_utilization": float(np.mean(live / slots)),
              "min_step_utilization": float(np.min(live / slots)),
              "token_weighted_utilization": float(live.sum() / slots.sum()),
              "preemptions": sched.stats.num_preemptions, "num_blocks": args.num_blocks}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
