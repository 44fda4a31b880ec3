"""GGUF load time: a Llama-shaped (or Qwen3-MoE-shaped: the config has experts) file of random
Q4_K_M-like blocks (Q6_K for the LM head, the embedding, attn_v and ffn_down(_exps); Q4_K for the
other matrices; F32 norms and routers), dequantized by gguf-py's
numpy (one core: the baseline), by pagoda's torch ops on the CPU (every core) and on the GPU; on
a GPU also loaded whole by ``LLM``, dequantized and kept packed (``quantization="gguf"``): time to
its first token, its layers' memory, W2's decode ms a token. Random blocks dequantize to noise:
the model's tokens mean nothing, the times are a real file's.

  python benchmarks/gguf_load.py --model-config benchmarks/models/llama3.2-1b.json
  python benchmarks/gguf_load.py --model-config benchmarks/models/qwen3-30b-a3b.json --packed-only --batch 1 8 64
"""
import argparse
import json
import os
import tempfile
import time

import common  # noqa: F401  (puts this checkout first on sys.path)
import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from pagoda import LLM, SamplingParams
from pagoda.model.gguf_file import GGUFModel
from tests.quant_utils import random_gguf_blocks


def write_file(cfg: dict, path: str, seed: int = 0) -> int:
    """The config's model as llama.cpp names it (a Llama, or a Qwen3-MoE where the config has
    experts: their stacks Q4_K, Q6_K for ffn_down_exps; the router F32); returns its parameter
    count."""
    rng = np.random.default_rng(seed)
    hidden, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    experts = cfg.get("num_experts", 0)
    w = gguf.GGUFWriter(path, "qwen3moe" if experts else "llama")
    for key, value in [("block_count", layers), ("context_length", 8192), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("head_count", heads), ("head_count_kv", kv),
                       ("layer_norm_rms_eps", cfg["rms_norm_eps"]), ("rope_freq_base", cfg["rope_theta"]),
                       ("vocab_size", cfg["vocab_size"])]:
        getattr(w, f"add_{key}")(value)
    w.add_key_length(head_dim)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    matrices = {"token_embd.weight": ((cfg["vocab_size"], hidden), QT.Q6_K)}
    if not cfg.get("tie_word_embeddings"):
        matrices["output.weight"] = ((cfg["vocab_size"], hidden), QT.Q6_K)
    moe_inter = cfg.get("moe_intermediate_size")
    mlp = [("ffn_gate_exps", (experts, moe_inter, hidden), QT.Q4_K),
           ("ffn_up_exps", (experts, moe_inter, hidden), QT.Q4_K),
           ("ffn_down_exps", (experts, hidden, moe_inter), QT.Q6_K)] if experts else \
          [("ffn_gate", (inter, hidden), QT.Q4_K), ("ffn_up", (inter, hidden), QT.Q4_K),
           ("ffn_down", (hidden, inter), QT.Q6_K)]
    for i in range(layers):
        for name, shape, qtype in [("attn_q", (heads * head_dim, hidden), QT.Q4_K),
                                   ("attn_k", (kv * head_dim, hidden), QT.Q4_K),
                                   ("attn_v", (kv * head_dim, hidden), QT.Q6_K),
                                   ("attn_output", (hidden, heads * head_dim), QT.Q4_K)] + mlp:
            matrices[f"blk.{i}.{name}.weight"] = (shape, qtype)
    params = 0
    for name, (shape, qtype) in matrices.items():
        blocks = random_gguf_blocks(rng, qtype, int(np.prod(shape[:-1])), shape[-1], scale=0.002)
        w.add_tensor(name, blocks.reshape(*shape[:-1], -1), raw_dtype=qtype)
        params += int(np.prod(shape))
    floats = {f"blk.{i}.{n}.weight": np.ones(hidden, np.float32) for i in range(layers)
              for n in ("attn_norm", "ffn_norm")} | {"output_norm.weight": np.ones(hidden, np.float32)}
    if experts:     # (Qwen3's q / k norms; the routers)
        floats |= {f"blk.{i}.{n}.weight": np.ones(head_dim, np.float32) for i in range(layers)
                   for n in ("attn_q_norm", "attn_k_norm")}
        floats |= {f"blk.{i}.ffn_gate_inp.weight": rng.standard_normal((experts, hidden), np.float32) * 0.02
                   for i in range(layers)}
    for name, t in floats.items():
        w.add_tensor(name, t)
        params += t.size
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return params


def numpy_seconds(path: str) -> float:
    """gguf-py's reader and numpy dequantization over every tensor (its own reading, not pagoda's)."""
    start = time.perf_counter()
    for t in gguf.GGUFReader(path).tensors:
        gguf.quants.dequantize(t.data, t.tensor_type)
    return time.perf_counter() - start


def pagoda_seconds(path: str, device: str) -> float:
    start = time.perf_counter()
    for _ in GGUFModel(path).iter_weights(device=device):
        pass
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def llm_run(path: str, quantization: str | None, batches: list[int]) -> dict:
    """``LLM(path)`` (bf16; ``quantization="gguf"``: the matrices kept packed): seconds to its
    first token (load, KV cache, kernels, CUDA graphs), its decoder layers' GiB, and ms a decode
    step over 256 tokens after 512-token prompts at each batch size (W2's shape; batch 1's is
    ``ms_per_token``, the others ``ms_per_step_b<B>``)."""
    start = time.perf_counter()
    llm = LLM(path, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=2048, gpu_memory_utilization=0.6,
              quantization=quantization)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    row = {"first_token_s": time.perf_counter() - start}
    layers = llm.apply_model(lambda m: sum(t.numel() * t.element_size() for n, t in m.named_parameters()
                                           if ".layers." in n))[0]
    row["layers_gib"] = layers / (1 << 30)
    params = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    for b in batches:
        # (prompts of their own tokens: no prefix shared, as W2's random ones)
        prompts = [{"prompt_token_ids": [1 + (i * 7919 + j) % 1000 for j in range(512)]} for i in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)   # (warm)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        ms = (time.perf_counter() - t) * 1e3 / max(len(o.outputs[0].token_ids) for o in outs)
        row["ms_per_token" if b == 1 else f"ms_per_step_b{b}"] = ms
    del llm
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-config", action="append", required=True, help="a Llama config.json (repeatable)")
    parser.add_argument("--no-numpy", action="store_true", help="skip gguf-py's one-core baseline (slow for 8B)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="W2's batch sizes (default 1)")
    parser.add_argument("--packed-only", action="store_true",
                        help="only the packed engine (no dequantization timings, no dequantized engine: a 30B model's "
                             "bf16 weights fill an H100)")
    args = parser.parse_args()
    out = os.environ.get("OUT", "results")
    rows = []
    for config_path in args.model_config:
        cfg = common.model_config(config_path)
        name = os.path.basename(config_path).removesuffix(".json")
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, f"{name}-q4_k_m.gguf")
            t = time.perf_counter()
            params = write_file(cfg, path)
            row = dict(model=name, params=params, file_gb=os.path.getsize(path) / 1e9,
                       write_s=time.perf_counter() - t, cpu_threads=torch.get_num_threads())
            row["numpy_s"] = None if args.no_numpy or args.packed_only else numpy_seconds(path)
            row["torch_cpu_s"] = None if args.packed_only else pagoda_seconds(path, "cpu")
            if torch.cuda.is_available():
                if not args.packed_only:
                    pagoda_seconds(path, "cuda")     # (CUDA's context and kernels, once)
                    row["torch_cuda_s"] = pagoda_seconds(path, "cuda")
                for quantization in ("gguf",) if args.packed_only else (None, "gguf"):
                    for key, value in llm_run(path, quantization, args.batch).items():
                        row[f"{quantization or 'dequantized'}_{key}"] = value
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gguf_load.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", rows=rows), f,
                  indent=1)
    kinds = [("numpy_s", "gguf-py numpy (1 core)"), ("torch_cpu_s", "torch, CPU"), ("torch_cuda_s", "torch, GPU")]
    common.bar_chart(os.path.join(out, "gguf_load.png"), "GGUF Q4_K_M-like dequantization", "seconds",
                     [r["model"] for r in rows], {label: [r.get(k) for r in rows] for k, label in kinds})
    print(f"\n{'model':14s} {'params':>7s} {'file GB':>8s} {'numpy s':>8s} {'torch CPU s':>12s} {'torch GPU s':>12s}")
    for r in rows:
        cells = [r.get(k) for k in ("numpy_s", "torch_cpu_s", "torch_cuda_s")]
        print(f"{r['model']:14s} {r['params'] / 1e9:6.2f}B {r['file_gb']:8.2f} "
              + " ".join(f"{c:>{w}.1f}" if c is not None else f"{'-':>{w}s}" for c, w in zip(cells, (8, 12, 12))))
    steps = {b: "ms_per_token" if b == 1 else f"ms_per_step_b{b}" for b in args.batch}
    if any(f"gguf_{key}" in r for r in rows for key in steps.values()):
        print(f"\n{'model, bf16':20s} {'to 1st token s':>15s} {'layers GiB':>11s}"
              + "".join(f"{f'W2 b={b} ms':>13s}" for b in steps))
        for r in rows:
            for kind in [k for k in ("dequantized", "gguf") if f"{k}_first_token_s" in r]:
                print(f"{r['model'] + ' ' + kind:20s} {r[f'{kind}_first_token_s']:15.1f} {r[f'{kind}_layers_gib']:11.2f}"
                      + "".join(f"{r[f'{kind}_{key}']:13.2f}" for key in steps.values()))

if __name__ == "__main__":
    main()
