"""Probe: does `del llm; gc.collect()` give an engine's CUDA memory back? If not, what holds it.
    python3 benchmarks/free_probe.py benchmarks/models/llama3-8b.json [--eager]
"""
import gc
import sys

import torch

import common
from pagoda import LLM, SamplingParams


def gib(n):
    return f"{n / 2**30:.1f} GiB"


def main():
    llm = LLM(common.dummy_model_dir(sys.argv[1]), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=2048, enforce_eager="--eager" in sys.argv)
    llm.generate([{"prompt_token_ids": [1] * 100}] * 4, SamplingParams(max_tokens=20), use_tqdm=False)
    print("free_probe: eager" if "--eager" in sys.argv else "free_probe: CUDA graphs")
    print("free_probe: in use with the engine", gib(torch.cuda.memory_allocated()))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    print("free_probe: after del + gc", gib(torch.cuda.memory_allocated()), "reserved", gib(torch.cuda.memory_reserved()))
    big = sorted((o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda), key=lambda t: -t.untyped_storage().nbytes())[:3]
    for t in big:
        print("free_probe: live", tuple(t.shape), t.dtype, gib(t.untyped_storage().nbytes()))
        for r in gc.get_referrers(t)[:6]:
            desc = type(r).__name__
            if isinstance(r, dict):
                owners = [type(o).__name__ for o in gc.get_referrers(r)[:4]]
                desc += f" keys={list(r)[:5]} owned by {owners}"
            print("free_probe:    held by", desc[:300])


if __name__ == "__main__":
    main()
