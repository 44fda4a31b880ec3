"""W5's quality half: perplexity of SmolLM2-135M-Instruct on real text, unquantized against its
GPTQ and AWQ checkpoints (4-bit in groups of 128 (GPTQ; AWQ needs whole groups of its 576
inputs: 64), and of 32; 8-bit), and against FP8 KV caches (E4M3, E5M2; scales 1.0), all run by
pagoda on the CPU.

The checkpoints are written by the tests' round-to-nearest quantizer (``tests/quant_utils.py``,
packed as AutoGPTQ and AutoAWQ pack) from the embedded GGUF's weights (themselves Q4_1,
dequantized by HF transformers to float32), so the figures are what the formats and this loader
cost on top of the model as shipped, with the plainest quantizer: GPTQ's and AWQ's own
algorithms lose less. The text is Python's own LICENSE file (English prose, on every Python
install); each window of ``--window`` tokens is scored after the first token, as a prompt
(``prompt_logprobs``).

  python3 benchmarks/quality.py [--window 512] [--max-tokens 4096]
"""
import argparse
import json
import math
import os
import sys
import sysconfig
import tempfile
import time

from safetensors.torch import save_file

import common  # before pagoda: puts the checkout to benchmark (PAGODA_ROOT) on sys.path
from pagoda import LLM, SamplingParams
from pagoda.model.hub import default_model_path
from tests.quant_utils import quantize_folder

del common  # (imported for its sys.path entry alone)


def license_text() -> str:
    for folder in (sysconfig.get_paths()["stdlib"], sys.base_prefix):
        path = os.path.join(folder, "LICENSE.txt")
        if os.path.isfile(path):
            with open(path) as f:
                return f.read()
    raise FileNotFoundError("Python's LICENSE.txt was not found beside the standard library")


def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    nll, n = 0.0, 0
    for w, out in zip(windows, outs):
        for pos in range(1, len(w)):
            nll -= out.prompt_logprobs[pos][w[pos]].logprob
            n += 1
    return math.exp(nll / n)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--kv-only", action="store_true", help="only the FP8 KV caches, not the checkpoints")
    p.add_argument("--out", default=os.environ.get("OUT", "results"))
    args = p.parse_args()
    import transformers
    gguf = default_model_path()
    small = dict(skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=2048)
    base = LLM(gguf, dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=2048)
    ids = base.get_tokenizer().encode(license_text())[:args.max_tokens]
    windows = [ids[i:i + args.window] for i in range(0, len(ids) - 1, args.window)]
    rows = [("GGUF Q4_1 as shipped, float32", perplexity(base, windows))]
    del base
    for kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):
        llm = LLM(gguf, dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=2048, kv_cache_dtype=kv_cache_dtype)
        rows.append((f"the same, KV cache {kv_cache_dtype}", perplexity(llm, windows)))
        del llm
    if args.kv_only:
        return report(args, ids, rows)
    work = tempfile.mkdtemp(prefix="pagoda-quality-")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    folder = os.path.join(work, "hf")
    os.makedirs(folder)
    # (save_pretrained refuses a model loaded from GGUF: its weights and config written directly)
    config = {k: v for k, v in hf.config.to_dict().items() if k != "quantization_config"}
    config["architectures"] = [type(hf).__name__]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    weights = {k: v.contiguous() for k, v in hf.state_dict().items()
               if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    save_file(weights, os.path.join(folder, "model.safetensors"))
    del hf, weights
    for label, method, kw in [("GPTQ 4-bit, groups of 128 (v1, symmetric)", "gptq", dict(group=128)),
                              ("GPTQ 4-bit, groups of 32 (v1, symmetric)", "gptq", dict(group=32)),
                              ("GPTQ 8-bit, groups of 128 (v2)", "gptq", dict(group=128, bits=8, v2=True)),
                              ("AWQ 4-bit, groups of 64", "awq", dict(group=64)),
                              ("AWQ 4-bit, groups of 32", "awq", dict(group=32))]:
        t0 = time.perf_counter()
        path = quantize_folder(folder, os.path.join(work, f"{method}-{len(rows)}"), method, **kw)
        llm = LLM(path, **small)
        rows.append((label, perplexity(llm, windows)))
        del llm
        print(f"  {label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    report(args, ids, rows)


def report(args, ids, rows):
    ref = rows[0][1]
    print(f"SmolLM2-135M-Instruct, perplexity on Python's LICENSE.txt ({len(ids)} tokens, windows of {args.window})")
    print(f"{'weights':44s} {'perplexity':>10s} {'vs shipped':>10s}")
    for label, ppl in rows:
        print(f"{label:44s} {ppl:10.3f} {ppl / ref - 1:+10.1%}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "quality_smollm2.json"), "w") as f:
        json.dump({"tokens": len(ids), "window": args.window, "rows": [{"weights": lab, "perplexity": ppl}
                                                                       for lab, ppl in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
