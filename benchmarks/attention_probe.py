"""Why the decode attention kernel runs slower inside the engine than alone (Qwen3-0.6B heads,
batch 64, 1,536-token contexts: 126 us a layer in the engine's step, 108 us alone in a graph).

  python3 benchmarks/attention_probe.py          # alone vs right after a compute-bound GEMM
  python3 benchmarks/attention_probe.py --once   # one warm launch, for ncu
  python3 benchmarks/attention_probe.py --engine CONFIG   # the same shapes in the engine, for ncu
                                                          # (decode steps inside the NVTX range "probe")

The first form times, each in a CUDA graph: the attention alone; a large bf16 GEMM alone (it
draws the chip's power and lowers its clocks); the GEMM then the attention. The attention's
time after the GEMM is the difference. SM clocks are read after each (nvidia-smi through torch).
"""
import argparse

import torch

from attention_kernels import MODELS, Case
from common import graph_ms
from pagoda.kernels import triton_attention as ta

LAYERS = 24


def sm_clock() -> str:
    try:
        return f"{torch.cuda.clock_rate()} MHz"
    except Exception as e:  # pynvml missing
        return type(e).__name__


def engine_replay(llm):
    """After a run: the engine's batch-64 decode graph replayed alone (GPU time of one forward),
    then the attention kernel over the engine's own caches and metadata buffers, in a graph."""
    from triton.testing import do_bench
    runner = llm.llm_engine.executor.runner
    graphs = runner.cuda_graphs
    forward = do_bench(graphs.graphs[64].replay, warmup=5, rep=50, return_mode="median")
    print(f"engine decode graph, batch 64: {forward * 1e3:7.1f} us a forward")
    attn0 = runner.model.model.layers[0].self_attn.attn
    q = torch.randn(64, attn0.num_heads, attn0.head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def step():
        for kv in runner.kv_caches:
            ta.paged_attention_triton(q, kv, graphs.block_tables[:64], graphs.seq_lens[:64],
                                      graphs.query_start_loc[:65], attn0.head_dim ** -0.5,
                                      graphs.max_model_len, 1, out=out)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graphs.graphs[64].replay()
        torch.cuda.synchronize()
    for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:3]:
        print(f"  under torch.profiler, 10 replays: {e.key[:40]:40s} {e.self_device_time_total / e.count:7.1f} us "
              f"x {e.count}")
    n = len(runner.kv_caches)
    print(f"attention over the engine's {n} caches: {graph_ms(step, 25, 100) / n * 1e3:7.1f} us a layer "
          f"(seq_lens {graphs.seq_lens[:64].min().item()}-{graphs.seq_lens[:64].max().item()})")


def engine(model_config, replay=False):
    """64 requests of 1,536 prompt tokens in the engine, prefilled in one step; the second run
    (prefix cache reset) inside NVTX range "probe": 28 prefill launches of the attention kernel,
    then 28 a decode step."""
    from common import dummy_model_dir
    from pagoda import LLM, SamplingParams
    llm = LLM(dummy_model_dir(model_config), load_format="dummy", dtype="bfloat16", max_model_len=1632,
              skip_tokenizer_init=True, max_num_batched_tokens=131072, gpu_memory_utilization=0.5)
    inputs = [{"prompt_token_ids": [i + 1] * 1536} for i in range(64)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(inputs, params, use_tqdm=False)
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("probe")
    llm.generate(inputs, params, use_tqdm=False)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    if replay:
        engine_replay(llm)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--once", action="store_true")
    p.add_argument("--engine", metavar="MODEL_CONFIG")
    p.add_argument("--replay", action="store_true", help="with --engine: time the engine's graph and caches")
    args = p.parse_args()
    if args.engine:
        return engine(args.engine, args.replay)
    gen = torch.Generator(device="cuda").manual_seed(0)
    case = Case(64, 1, 1536, *MODELS["qwen3-0.6b"], torch.bfloat16, gen)
    attention = lambda: case.triton(num_segments=1)  # noqa: E731
    if args.once:
        for _ in range(3):
            attention()
        torch.cuda.synchronize()
        return
    a = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    gemm = lambda: torch.mm(a, b)  # noqa: E731
    alone = graph_ms(attention, 25, 100)
    print(f"attention alone: {alone * 1e3:7.1f} us  (SM clock after: {sm_clock()})")
    g = graph_ms(gemm, 25, 100)
    print(f"GEMM alone:      {g * 1e3:7.1f} us  (SM clock after: {sm_clock()})")
    both = graph_ms(lambda: (gemm(), attention()), 25, 100)
    print(f"GEMM + attention:{both * 1e3:7.1f} us  -> attention after the GEMM {(both - g) * 1e3:6.1f} us "
          f"(SM clock after: {sm_clock()})")
    print(f"KV bytes {case.kv_bytes() / 1e6:.0f} MB: alone {case.kv_bytes() / alone / 1e6:.0f} GB/s, "
          f"after the GEMM {case.kv_bytes() / (both - g) / 1e6:.0f} GB/s")
    # As in a step: each layer reads its own cache (so the TLB and DRAM pages are cold for it).
    del a, b
    layers = [case.kv_cache] + [torch.empty_like(case.kv_cache).normal_() for _ in range(LAYERS - 1)]
    out = case.out

    def step():
        for kv in layers:
            ta.paged_attention_triton(case.query, kv, case.tables, case.seq_lens, case.qsl, case.scale,
                                      case.ctx, 1, out=out, num_segments=1)
    per_layer = graph_ms(step, 25, 100) / LAYERS
    print(f"{LAYERS} layers' caches in turn: {per_layer * 1e3:7.1f} us a layer, "
          f"{case.kv_bytes() / per_layer / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
