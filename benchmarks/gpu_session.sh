#!/usr/bin/env bash
# The H200 runs of one session, in phases that each fit one device call (see BENCHMARKS.md).
#   bash benchmarks/gpu_session.sh kernels   # Triton kernel tests at full shapes + attention micro-benchmark
#   bash benchmarks/gpu_session.sh ops       # fused-op tests + benchmark, step overhead, W2 Qwen3-0.6B
#   bash benchmarks/gpu_session.sh engine    # GPU-vs-CPU greedy, W1 Qwen3-0.6B, W1 + W2 Llama-3-8B
#   bash benchmarks/gpu_session.sh llama     # W1 and W2 for Llama-3-8B
#   bash benchmarks/gpu_session.sh profile   # where one decode step's time goes
#   bash benchmarks/gpu_session.sh prefix    # block-copy kernel tests, W4 prefix reuse (fp32 check + Llama-3-8B)
#   bash benchmarks/gpu_session.sh async     # async scheduling off vs on: sampler, step time, W1, W2
#   bash benchmarks/gpu_session.sh final     # W1 + W2 for both models, GPU idle, host time per step;
#                                            # with BASE=dir (an older checkout), its W1/W2 Qwen3 first
#   bash benchmarks/gpu_session.sh sampler   # sampler kernel tests, decode-tile sweep, W1 Qwen3 (vs BASE) + profile
#   bash benchmarks/gpu_session.sh host      # W1 Qwen3 vs BASE interleaved, W1 profile by batch size, W1 Llama, W2
#   BASE=dir bash benchmarks/gpu_session.sh ab  # tests, then BASE vs this tree interleaved: W1 and W2, both models
#   bash benchmarks/gpu_session.sh split     # tests, split-KV at medium batch, W2 Llama b64 + W1 Qwen3 split A/B
#   bash benchmarks/gpu_session.sh smallbatch  # host time per step at batch 1 and 64, cProfile of W2 Qwen3 batch 1
#   bash benchmarks/gpu_session.sh linear    # small-batch linear kernel: tests, W2 off/on both models, W1 Qwen3, profile
#   bash benchmarks/gpu_session.sh w1profile # where W1's time goes, both models: steps by batch, GPU kernels by kind;
#                                            # attention over ragged contexts against uniform ones
#   bash benchmarks/gpu_session.sh smallm    # the batch-1 linear kernel: tests, in-graph micro, W2 off/on, W1
#   bash benchmarks/gpu_session.sh tail      # kernel tables of decode steps at W1's small-batch tail (long contexts)
#   bash benchmarks/gpu_session.sh pdl       # programmatic dependent launch off/on: tests, W2 both models, W1 Qwen3
#   bash benchmarks/gpu_session.sh medium    # W1 tail shapes: kernel tables (PDL off), split factors in a graph, overlap probe
#   bash benchmarks/gpu_session.sh tiles     # decode tile sweep at medium batch (in a graph); W1 + W2 both models
#   bash benchmarks/gpu_session.sh tlb       # attention time against the KV cache size; W1 Qwen3 twice
#   bash benchmarks/gpu_session.sh probe     # decode attention alone vs after a GEMM; ncu of one launch
#   bash benchmarks/gpu_session.sh next      # decode matmuls: slab kernel on large matrices, its sweep, BLAS libraries
#   BASE=dir bash benchmarks/gpu_session.sh pipeline  # attention tests, kernel micro-benchmarks BASE vs tree, W1/W2 A/B
#   BASE=dir bash benchmarks/gpu_session.sh cand  # attention + linear tests; ragged attention, slab matmuls and
#                                                 # W1/W2 both models, BASE against this tree
#   bash benchmarks/gpu_session.sh closing   # W1 + W2 both models; W1's prefill steps alone, profiled; GPU tests of today's kernels
#   bash benchmarks/gpu_session.sh closing8  # GPU tests (sampling, attention, engine), sampler alone, W1 + W2 both models
#   bash benchmarks/gpu_session.sh profile8  # W1 both models: Triton compiles in the run, profile (steps, kernels)
#   BASE=dir bash benchmarks/gpu_session.sh w1_7 [MODEL [ROUNDS]]  # W1: BASE, tree, tree at 8,192 / 256 (cand7)
#   bash benchmarks/gpu_session.sh gemm9     # GPU tests of the final sampler, the sampler alone, tiled GEMM probe
#                                            # (gemm_probe.py: branch tile-gemm-probe)
#   bash benchmarks/gpu_session.sh host9     # W1's prefill steps: host phases, allocator retries, cProfile; W1 + W2
#   BASE=dir bash benchmarks/gpu_session.sh prewait9  # attention + engine tests; BASE vs tree interleaved:
#                                                 # W2 Llama-3-8B batch 64, W1 both models
#   bash benchmarks/gpu_session.sh final9    # tests; host time per eager launch; W1 + W2 both models
#   bash benchmarks/gpu_session.sh acct11    # the failing error test in full; W1 Qwen3 by batch size; small-batch steps
#   BASE=dir bash benchmarks/gpu_session.sh samp11  # sampler split: tests, kernel BASE vs tree, split-KV, W1 A/B
#   BASE=dir bash benchmarks/gpu_session.sh samp11b  # the same, final: tests, kernel, W1 both models A/B
#   BASE=dir bash benchmarks/gpu_session.sh samp11c  # the sampler's lane-wise best, fast logs: tests, kernel, W1 A/B
#   BASE=dir bash benchmarks/gpu_session.sh mask12  # attention tests; decode tiles on ragged batches and W1
#                                                 # both models, BASE against this tree
#   BASE=dir bash benchmarks/gpu_session.sh w2check12  # W2 both models, BASE against this tree interleaved
#   bash benchmarks/gpu_session.sh split12   # flash-decoding splits on W1's ragged medium batches; W1 Qwen3
#                                            # with medium batches split (knobs) against the defaults
#   bash benchmarks/gpu_session.sh tiles13   # decode tiles at 96 registers (5 programs an SM), two K/V buffers:
#                                            # sweep on ragged batches, W1 Qwen3 two of them against the default
#   bash benchmarks/gpu_session.sh w4a16     # W5: W4A16 kernel tests + micro-benchmark, W2 bf16 / GPTQ / AWQ
#   bash benchmarks/gpu_session.sh w4a16b    # W5: the W4A16 kernel's tile sweep, W2 GPTQ with the best
#   bash benchmarks/gpu_session.sh w5w1      # W5: W4A16 at 64-256 rows; W1 both models bf16 against GPTQ
#   bash benchmarks/gpu_session.sh w5tiles   # W5: W4A16 tiles for 128- and 256-row tiles (sweep); W1 GPTQ with the best
#   bash benchmarks/gpu_session.sh tp2       # (two GPUs) TP, PP, DP tests over NCCL; W2 at tp 1 and 2, W1 at 2
#   bash benchmarks/gpu_session.sh serve16   # W3: the OpenAI server under Poisson arrivals, both models
#   bash benchmarks/gpu_session.sh serve17   # W3 with the asyncio client, both models; the server stack over a stand-in engine
#   bash benchmarks/gpu_session.sh skip18    # W1 with the layers' norms and SiLU-and-mul skipped (fusion's upper bound)
#   bash benchmarks/gpu_session.sh s44b      # batch-1 GPTQ GEMV variants (gemv_probe.py), ncu of each
#   bash benchmarks/gpu_session.sh s47a      # GGUF engine tests on CUDA, 1B GGUF packed vs dequantized, 30B GGUF
#   bash benchmarks/gpu_session.sh s46d      # s46c's GEMV with GGUF's groups a word row: tests, 8B GGUF W2, GGUF tests
#   PREV=dir bash benchmarks/gpu_session.sh s46c  # the session in one call: tests, 30B-A3B GGUF, 8B GGUF PREV/tree
#   BASE=dir bash benchmarks/gpu_session.sh s45a  # the GEMV of s44b merged: tests, W2 GPTQ batch 1 BASE vs tree
#   bash benchmarks/gpu_session.sh s39b      # LongRoPE / partial rotary / windows giving blocks back on the GPU
#   bash benchmarks/gpu_session.sh s40b      # a draft model's step cost: W2 Llama-3-8B with a Llama-3.2-1B-shaped draft
#   bash benchmarks/gpu_session.sh s43b      # GGUF on the GPU: tests, load times, packed vs dequantized (gguf_load.py)
#   bash benchmarks/gpu_session.sh s41d      # the attention kernels' and backend's tests compiled
#   bash benchmarks/gpu_session.sh s41c      # the draft of s40b alone: W2 Llama-3.2-1B-shaped, batch 1
#   bash benchmarks/gpu_session.sh s41a      # KV cache groups (Gemma 2/3) on the GPU: their tests
#   GIBS="1 3" bash benchmarks/gpu_session.sh s41b  # W1 Gemma-3-1B, hybrid KV cache groups on / off (GIBS=0: no cap)
#   bash benchmarks/gpu_session.sh session20 # pooling on CUDA (tests), GPU tests, W1 both models, embedding throughput
#   bash benchmarks/gpu_session.sh s26a      # (then spec25e, warm) W1 both models; the GPU tests
#   bash benchmarks/gpu_session.sh s26c      # (then s26d, warm) W1 / W2 with LoRA adapters; the GPU tests
#   bash benchmarks/gpu_session.sh s28       # the session's one call: MoE / block-FP8 GPU tests, W2 MoE (+ HF),
#                                            # MoE micro-benchmark in graphs, W2 Llama-3-8B fp8 vs fp8-block
#   bash benchmarks/gpu_session.sh moe28a    # MoE: Triton experts' tests, CPU-vs-GPU test, micro-benchmark, tile sweep
#   bash benchmarks/gpu_session.sh moe28b    # MoE: micro-benchmark + sweep in CUDA graphs, W2 Qwen3-30B-A3B (+ HF)
#   bash benchmarks/gpu_session.sh moe28c    # MoE: W1 Qwen3-30B-A3B
#   bash benchmarks/gpu_session.sh free30    # does a dropped engine give its CUDA memory back (free_probe.py); MoE tests
#   bash benchmarks/gpu_session.sh free31    # sleep / dropped-engine tests, the probe, W2 Qwen3-30B-A3B (+ HF)
#   BASE=dir bash benchmarks/gpu_session.sh moe31  # one-launch routing + alignment: tests, layer in graphs, W2 MoE A/B
#   BASE=dir bash benchmarks/gpu_session.sh moe31b # the MoE kernels with PDL: tests, layer, decode sweep, W2 MoE A/B
#   bash benchmarks/gpu_session.sh check31   # issue 3's W1 / W2 on main, both models; the MoE layer with its routing
#   bash benchmarks/gpu_session.sh moe32     # W1 on Qwen3-30B-A3B's shapes, bf16 and GPTQ
#   bash benchmarks/gpu_session.sh int4moe32 # GPTQ / AWQ experts: MoE tests, GPU-vs-CPU, layer, W2 MoE bf16 / gptq / awq
#   BASE=dir bash benchmarks/gpu_session.sh s35a  # GPTQ batches over MAX_M dequantized in Triton: tests, matrices, W1
#   BASE=dir bash benchmarks/gpu_session.sh s35b  # W8A8 quantization in the norms: tests, W1 INT8 / FP8 BASE vs tree
#   bash benchmarks/gpu_session.sh s37a      # the thirty-sixth and -seventh sessions' changes compiled (norms, FP8
#                                            # fused norms, sliding windows, Gemma's kernels), W2 Gemma-3-1B's shapes
#   bash benchmarks/gpu_session.sh s36a      # issue 3's table with HF in the same runs (then s36b, warm: all GPU tests)
#   bash benchmarks/gpu_session.sh s35c      # check31, then the GPU engine tests and the quantized layers' tests
#   bash benchmarks/gpu_session.sh s33a      # the AWQ MoE GPU test with its traceback, then check31
#   bash benchmarks/gpu_session.sh s33b      # MoE GPU tests (five expert kinds), quantized kernel tests, --int4 B vs A operand
#   bash benchmarks/gpu_session.sh s33c      # packed experts: tests, layer packed vs dequantized whole, W2 + W1 with GPTQ
#   bash benchmarks/gpu_session.sh s33d      # INT8 W8A8 on INT8 tensor cores: tests, the eight matrices vs dequantized
#   bash benchmarks/gpu_session.sh fp8b28    # block-wise FP8: GPU tests; W2 both models bf16 / fp8 / fp8-block, MoE fp8-block
#   bash benchmarks/gpu_session.sh s27a      # W1 with the layers' norms alone skipped (folding's upper bound)
#   bash benchmarks/gpu_session.sh s26g      # W1 with KV blocks of 16 and 32 tokens, interleaved
#   bash benchmarks/gpu_session.sh s26e      # (then s26f, warm) the same with the Triton LoRA expand; its GPU tests
#   bash benchmarks/gpu_session.sh spec24a   # (then spec24b, warm) W1 Qwen3; GPU tests, n-gram drafts on SmolLM2,
#                                            # W2 Llama-3-8B batch 1 sync / async / with drafts
#   bash benchmarks/gpu_session.sh spec25a   # (then spec25b, warm) W1 Llama-3-8B; GPU tests, n-gram drafts on
#                                            # SmolLM2 in bf16 and float32
#   bash benchmarks/gpu_session.sh spec25c   # (then spec25d, warm) cProfile of SmolLM2 steps with drafts
#                                            # (or spec25e: the GPU tests alone)
#   bash benchmarks/gpu_session.sh spec25f   # (then spec25g, warm) verification attention split over the context:
#                                            # tests, micro-benchmark; GPU tests, drafts, W2 Llama long prompt
#   bash benchmarks/gpu_session.sh session21 # classifiers + calculate_kv_scales on CUDA (tests), GPU tests, W1 both models
#   bash benchmarks/gpu_session.sh asc21     # W3 with --api-server-count 2 against 1, interleaved (carry the server's wheels)
#   bash benchmarks/gpu_session.sh pdl22     # PDL into cuBLAS GEMMs: which kernels wait (probe), MLP micro
#   BASE=dir bash benchmarks/gpu_session.sh prefill22  # attention tests; prefill tiles BASE vs tree; W1 Qwen3 A/B
#   BASE=dir bash benchmarks/gpu_session.sh prefill22b # 128-token prefill tiles: tests; W1 + W2 both models A/B
#   BASE=dir bash benchmarks/gpu_session.sh final22    # GPU tests (classify, rerankers, token pooling); long-prompt TTFT A/B
#   bash benchmarks/gpu_session.sh serve19   # W3: the engine in its own process against its thread, interleaved
#   BASE=dir bash benchmarks/gpu_session.sh serve19ab  # W3: BASE's server against this tree's, interleaved
#   bash benchmarks/gpu_session.sh serve19dp # two GPUs: data-parallel tests, W3 Llama-3-8B at dp 1 and 2
#   bash benchmarks/gpu_session.sh fp8kv     # the FP8 KV cache: kernel tests, decode tiles, W1 + W2 both models
#                                            # against the bf16 cache, interleaved (TILE=... a decode tile for FP8)
#   bash benchmarks/gpu_session.sh warps19   # decode tiles of 2 and 1 warps, bf16 and FP8 caches
#   bash benchmarks/gpu_session.sh many19    # W1 with the one-warp decode tiles of large batches against without
#   BASE=dir bash benchmarks/gpu_session.sh serve16ab  # W3 Qwen3-0.6B: BASE's server against this tree's
#   bash benchmarks/gpu_session.sh fp8      # W5: FP8 weights (W8A16 kernel, W8A8): tests, crossover; W2 and W1
#   bash benchmarks/gpu_session.sh gap13     # W1 both models profiled: time outside the steps, steps by batch
#   bash benchmarks/gpu_session.sh graphs12  # W1 with CUDA graphs of its 16,384-token prefill steps (knobs)
#   bash benchmarks/gpu_session.sh next11    # GPU error tests; attention timeline (worktree .ab/tl: carry it)
#   BASE=dir bash benchmarks/gpu_session.sh w1ab9  # W1 Qwen3-0.6B, BASE vs tree interleaved, 3 rounds (both warmed up)
#   BASE=dir MID=dir bash benchmarks/gpu_session.sh order  # tests; ragged attention BASE vs tree; W2 batch 1
#                                                 # MID vs tree, both models; W1 both models BASE vs tree
#   BASE=dir bash benchmarks/gpu_session.sh rope10  # tests; rotary folded into the KV write + attention: BASE vs
#                                                 # tree interleaved, W2 + W1 both models; W1 prefill host profile
#   BASE=dir A1=dir bash benchmarks/gpu_session.sh rope10b  # rope10's failing tests in full; W1 Qwen3 BASE / A1 / tree
#   BASE=dir A2=dir bash benchmarks/gpu_session.sh graphs10  # tests; W1 Qwen3 BASE / A2 / tree, W1 Llama A2 / tree
#   A2=dir bash benchmarks/gpu_session.sh final10  # graph tests; W1 prefill step phases A2 vs tree; W2 both models
#   BASE=dir bash benchmarks/gpu_session.sh check10  # BASE (a worktree at f6094ef) vs tree: prefill phases, W2, W1
# BASE and the other trees must be git worktrees (git worktree add --detach .ab/NAME COMMIT).
# Missing wheels (gguf) travel in .whl; results go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-results}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
M=../shared/models; [ -d "$M" ] || M=shared/models; [ -d "$M" ] || M=benchmarks/models
MA=$(realpath "$M")
# A/B helpers: W1 / W2 of one model run from a checkout (BASE or .), results under $OUT/label
# SmolLM2's GGUF (98 MB) comes in two calls, a half each (the carry limit is 64 MiB): the first
# call keeps its half on the warm machine, the next joins them into /tmp/smollm2.gguf.
keep_smollm2_half() { [ -f .gpu_model/smollm2.part00 ] && cp .gpu_model/smollm2.part00 /root/; }
join_smollm2() {
  if [ -f /root/smollm2.part00 ] && [ -f .gpu_model/smollm2.part01 ]; then
    cat /root/smollm2.part00 .gpu_model/smollm2.part01 > /tmp/smollm2.gguf && export SMOLLM2_GGUF=/tmp/smollm2.gguf
  fi
}
w1() {  # tree label model
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/throughput.py --model-config "$MA/$3.json" --no-tqdm \
    --out "$OUT/$2" 2>&1 | grep -E "^pagoda |compiled|variant:|^roofline of this" | sed "s/^/W1 $3 $2: /")
}
warm_w1() {  # trees...: a short W1 Qwen3-0.6B run in each, so that the timed runs find Triton's caches warm
  for tree in "$@"; do
    (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/throughput.py --model-config "$MA/qwen3-0.6b.json" \
      --no-tqdm --num-requests 64 --output-len 20 40 > /dev/null 2>&1)
  done
}
w1_check() {  # this tree's W1 after a warm-up: Qwen3-0.6B, Llama-3-8B, Qwen3-0.6B again
  warm_w1 .
  for m in qwen3-0.6b llama3-8b qwen3-0.6b; do
    python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --out "$OUT/w1" 2>&1 \
      | grep -E "^pagoda |Error" | sed "s/^/W1 $m: /"
  done
}
lora_costs() {  # W1 Qwen3-0.6B with each of $1 random rank-16 adapter counts, Llama-3-8B with $2; W2 Llama-3-8B
  # batch 1 and 64 with 0 and 1 (adapters on every projection; the requests take them in turn)
  for m in qwen3-0.6b llama3-8b; do
    counts=$1; [ $m = llama3-8b ] && counts=$2
    for n in $counts; do
      python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --num-loras $n --out "$OUT/w1" 2>&1 \
        | grep -E "^pagoda |Error" | sed "s/^/W1 $m loras=$n: /"
    done
  done
  for n in 0 1; do
    python3 benchmarks/latency.py --model-config $MA/llama3-8b.json --batch 1 64 --num-loras $n --out "$OUT/w2" 2>&1 \
      | grep -E "^pagoda|Error" | sed "s/^/W2 llama3-8b loras=$n: /"
  done
}
w2() {  # tree label model batches [latency.py args...]
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/latency.py --model-config "$MA/$3.json" --batch $4 \
    --out "$OUT/$2" "${@:5}" 2>&1 | grep -E "^pagoda |Error" | sed "s/^/W2 $3 $2: /")
}
w2_moe() {  # tree: W2 on Qwen3-30B-A3B's shapes at batches 1, 8 and 64, labelled by the tree
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 benchmarks/latency.py --model-config \
    benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 --out "$OUT/w2_moe_$(basename $1)" 2>&1 \
    | grep -E "^pagoda|Error" | sed "s|^|W2 qwen3-30b-a3b $(basename $1): |")
}
trees() {  # pattern benchmark args...: the benchmark in BASE, then in this tree; its lines matching
           # the pattern, labelled by tree
  pattern=$1; shift
  for tree in "$BASE" .; do
    (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/"$@" 2>&1 | grep -E "$pattern" \
      | sed "s|^|$(basename $tree): |")
  done
}
int8_table() {  # the six fastest INT8 paths / tiles at each row count of w4a16.py --w8 --int8's JSON
  python3 - <<'PY'
import json, os, collections
rows = json.load(open(os.path.join(os.environ.get("OUT", "results"), "w8_int8.json")))["rows"]
sums = collections.defaultdict(float)
for r in rows:
    sums[r["rows"], r["path"]] += r["us"]
for m in sorted({r["rows"] for r in rows}):
    paths = sorted({p for (mm, p) in sums if mm == m}, key=lambda p: sums[m, p])
    print(f"{m:6d} rows: " + ", ".join(f"{p} {sums[m, p]:.0f}" for p in paths[:6]) + f" | bf16 {sums[m, 'bf16']:.0f}")
PY
}
run() {  # label benchmark args...: the benchmark's result line, labelled
  label=$1; shift
  python3 benchmarks/$@ 2>&1 | grep "^pagoda " | sed "s/^/$label: /"
}
case "${1:-}" in
  kernels)
    # SmolLM2's GGUF is over one call's 64 MiB: its first half rides with this call.
    keep_smollm2_half
    python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -15 | tee "$OUT/kernel_tests.txt"
    python3 benchmarks/attention_kernels.py 2>&1 | tail -40
    ;;
  ops)
    keep_smollm2_half
    python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -4 | tee "$OUT/kernel_tests.txt"
    python3 benchmarks/ops_kernels.py 2>&1 | tail -30
    python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --num-requests 256 2>&1 | tail -9
    python3 benchmarks/latency.py --model-config $M/qwen3-0.6b.json --batch 1 8 64 --hf 2>&1 | tail -8
    ;;
  engine)
    join_smollm2
    python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.txt"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --hf --no-tqdm 2>&1 | tail -6
    python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 64 --hf 2>&1 | tail -8
    python3 benchmarks/throughput.py --model-config $M/llama3-8b.json --hf --hf-requests 32 --no-tqdm 2>&1 | tail -6
    ;;
  profile)
    python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 1 64 --top 20 2>&1 | tail -46
    python3 benchmarks/profile_step.py --model-config $M/llama3-8b.json --batch 1 64 --top 14 2>&1 | tail -34
    ;;
  prefix)
    python3 -m pytest -q -p no:cacheprovider tests/kernels -k "copy_blocks or write_kv or backend" 2>&1 | tail -4 | tee "$OUT/kernel_tests.txt"
    # float32, so greedy answers with caching on must equal those with it off exactly
    python3 benchmarks/prefix_cache.py --model-config $M/qwen3-0.6b.json --dtype float32 --conversations 16 \
      --system-len 600 --out "$OUT/fp32" 2>&1 | tail -4
    python3 benchmarks/prefix_cache.py --model-config $M/llama3-8b.json 2>&1 | tail -5
    ;;
  llama)
    python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 64 --hf 2>&1 | tail -8
    python3 benchmarks/throughput.py --model-config $M/llama3-8b.json --hf --hf-requests 32 --no-tqdm 2>&1 | tail -6
    ;;
  sampler)
    # The one-kernel sampler's tests, decode-tile sweep at W1 shapes, W1 Qwen3 against BASE (same
    # call), then where W1's time goes (GPU kernels by kind, host hot spots)
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/sampler_tests.txt"
    python3 benchmarks/attention_kernels.py --tune-decode 2>&1 | tail -24
    if [ -n "${BASE:-}" ]; then
      (cd "$BASE" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/throughput.py --model-config "$MA/qwen3-0.6b.json" \
        --no-tqdm --out "$OUT/base" 2>&1 | tail -3)
    fi
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --profile 2>&1 | tail -75
    ;;
  host)
    # After the host-time work: tests, W1 Qwen3 BASE/new interleaved (same call), where W1's
    # time goes, W1 Llama, W2 both models, host time per step
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/host_tests.txt"
    for run in 1 2; do
      if [ -n "${BASE:-}" ]; then
        (cd "$BASE" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/throughput.py --model-config "$MA/qwen3-0.6b.json" \
          --no-tqdm --out "$OUT/base" 2>&1 | tail -1 | sed "s/^/base $run: /")
      fi
      python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm 2>&1 | tail -2 | sed "s/^/new $run: /"
    done
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --profile 2>&1 | grep -B2 -A30 "steps by batch" | head -40
    python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --num-requests 256 2>&1 | tail -9
    python3 benchmarks/latency.py --model-config $M/qwen3-0.6b.json --batch 1 64 2>&1 | tail -4
    python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 64 2>&1 | tail -4
    python3 benchmarks/throughput.py --model-config $M/llama3-8b.json --no-tqdm 2>&1 | tail -2
    ;;
  ab)
    # Kernel + engine tests, then BASE (an older checkout) against this tree, interleaved in one
    # call: W1 Qwen3 twice, W1 Llama, W2 both models
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/kernels/test_triton_ops.py \
      tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/ab_tests.txt"
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    w2 "$BASE" base qwen3-0.6b "1 64"; w2 . new qwen3-0.6b "1 64"
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    ;;
  split)
    # Kernel + engine tests; flash-decoding split at medium batches (micro), then W2 Llama-3-8B
    # batch 64 and W1 Qwen3-0.6B with SPLIT_PROGRAMS_PER_SM at its default and at 8, same call
    python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/split_tests.txt"
    python3 benchmarks/attention_kernels.py --tune-split 2>&1 | tail -8
    for split in default 8; do
      opt=""; [ "$split" = default ] || opt="--knob triton_attention.SPLIT_PROGRAMS_PER_SM=$split"
      run "W2 llama split=$split" latency.py --model-config $M/llama3-8b.json --batch 64 $opt --out "$OUT/s$split"
    done
    for split in default 8; do
      opt=""; [ "$split" = default ] || opt="--knob triton_attention.SPLIT_PROGRAMS_PER_SM=$split"
      run "W1 qwen3 split=$split" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm $opt --out "$OUT/s$split"
    done
    ;;
  smallbatch)
    for n in 1 64; do
      python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --num-requests $n --prompt-len 512 \
        --steps 100 2>&1 | tail -9 | sed "s/^/batch $n: /"
    done
    python3 benchmarks/latency.py --model-config $M/qwen3-0.6b.json --batch 1 --profile 2>&1 | grep -A45 "function calls"
    ;;
  linear)
    # Cold first: step time at batch 1 on a fresh machine (Triton compiles inside the steps?)
    python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --num-requests 1 --prompt-len 512 \
      --steps 100 2>&1 | tail -9 | grep -E "logits|wall"
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_ops.py tests/test_gpu.py 2>&1 | tail -3 \
      | tee "$OUT/linear_tests.txt"
    off="--knob triton_linear.MAX_M=0"
    for rep in 1 2; do
      for opt in "$off" ""; do
        run "W2 qwen3 ${opt:+off}${opt:-on} $rep" latency.py --model-config $M/qwen3-0.6b.json --batch 1 4 8 $opt
      done
    done
    for opt in "$off" ""; do
      run "W2 llama ${opt:+off}${opt:-on}" latency.py --model-config $M/llama3-8b.json --batch 1 $opt
      run "W1 qwen3 ${opt:+off}${opt:-on}" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm $opt
    done
    python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 1 --top 14 2>&1 | tail -16
    ;;
  w1profile)
    python3 benchmarks/attention_kernels.py --ragged 2>&1 | tail -4
    for model in qwen3-0.6b llama3-8b; do
      python3 benchmarks/throughput.py --model-config $M/$model.json --no-tqdm --profile --out "$OUT/$model" 2>&1 \
        | tee "$OUT/${model}_profile.txt" | grep -B3 -A40 "steps by batch" | head -50 | sed "s/^/$model: /"
    done
    ;;
  smallm)
    # The batch-1 linear kernel as shipped: tests, in-graph micro, W2 off/on, W1
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_ops.py tests/test_gpu.py -k "linear or gpu or cuda_graph" \
      2>&1 | tail -2 | tee "$OUT/smallm_tests.txt"
    python3 benchmarks/linear_kernels.py 2>&1 | tail -20
    run "W2 qwen3 cuBLAS" latency.py --model-config $M/qwen3-0.6b.json --batch 1 64 --knob triton_linear.MAX_M=0
    run "W2 qwen3 Triton" latency.py --model-config $M/qwen3-0.6b.json --batch 1 64
    run "W2 llama Triton" latency.py --model-config $M/llama3-8b.json --batch 1 64
    run "W1 qwen3 1" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm
    run "W1 qwen3 2" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm
    ;;
  tail)
    # W1's last steps run 2-3x above their floor (batch 8-63, contexts ~1,500): what runs there
    python3 benchmarks/profile_step.py --model-config $M/llama3-8b.json --batch 16 32 --prompt-len 1536 --steps 32 \
      --top 12 2>&1 | grep -A13 "batch"
    python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 16 32 --prompt-len 1536 --steps 32 \
      --top 12 2>&1 | grep -A13 "batch"
    # Splitting the context in the tail too (split below 2 / 4 programs an SM instead of 1)
    for below in 1 4 1 4; do
      run "W1 llama split<$below" throughput.py --model-config $M/llama3-8b.json --no-tqdm \
        --knob triton_attention.SPLIT_BELOW_PROGRAMS_PER_SM=$below
    done
    ;;
  pdl)
    python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/pdl_tests.txt"
    python3 benchmarks/attention_ir.py 2>&1 | tail -1
    for pdl in 0 1 0 1 L0 L1; do   # Qwen3 twice each, then Llama once each
      model=qwen3-0.6b; [ "${pdl#L}" = "$pdl" ] || model=llama3-8b
      run "W2 $model pdl=${pdl#L}" latency.py --model-config $M/$model.json --batch 1 64 --knob triton_utils.USE_PDL=${pdl#L}
    done
    for pdl in 0 1; do
      run "W1 qwen3 pdl=$pdl" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --knob triton_utils.USE_PDL=$pdl
    done
    ;;
  medium)
    # Decode at small and medium batches with long contexts (W1's tail): kernel tables with PDL
    # off (each kernel's own time), then the split factors timed in a CUDA graph, then the
    # two-stream overlap probe
    nopdl="--knob triton_utils.USE_PDL=0"
    python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 16 32 64 --prompt-len 1536 \
      --steps 32 --top 9 $nopdl 2>&1 | grep -A10 "batch"
    python3 benchmarks/profile_step.py --model-config $M/llama3-8b.json --batch 16 64 --prompt-len 1536 \
      --steps 32 --top 9 $nopdl 2>&1 | grep -A10 "batch"
    python3 benchmarks/attention_kernels.py --tune-split 2>&1 | tail -10
    python3 benchmarks/overlap_probe.py 2>&1 | tail -7
    ;;
  tiles)
    # Decode tiles at medium batches timed in a CUDA graph, then the four headline figures with
    # PDL on (main as merged)
    python3 benchmarks/attention_kernels.py --tune-decode 2>&1 | grep -E "default|TILE_N" | grep -v Error
    w1 . main qwen3-0.6b; w1 . main llama3-8b
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    ;;
  tlb)
    # Does the KV cache's size (90% of the GPU against 20%) change the attention kernel's time
    # at batch 64 (the micro-benchmark's small cache runs 15% faster than the engine)? Then W1
    # Qwen3 warm, twice
    for util in 0.9 0.2 0.9 0.2; do
      python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 64 --prompt-len 1536 --steps 32 \
        --top 1 --knob triton_utils.USE_PDL=0 --gpu-memory-utilization $util 2>&1 | grep -A2 "batch" | sed "s/^/util $util: /"
    done
    w1 . main qwen3-0.6b; w1 . main qwen3-0.6b
    ;;
  probe)
    # The attention kernel alone vs after a compute-bound GEMM (clocks), then ncu's view of one
    # launch (hardware counters: only on Firecracker machines)
    python3 benchmarks/attention_probe.py 2>&1 | tail -4
    uname -r
    # the engine's decode launch (third decode step), then the lone launch
    timeout 200 ncu --clock-control none --nvtx --nvtx-include "probe/" --kernel-name regex:_paged_attention \
      --launch-skip 84 --launch-count 1 --section SpeedOfLight --section LaunchStats --section WarpStateStats \
      python3 benchmarks/attention_probe.py --engine $M/qwen3-0.6b.json 2>&1 \
      | grep -vE "^==PROF==|^\s*$|---" | grep -E "paged|Duration|Throughput|Grid|Registers|Shared|Cycles Per|Freq|rror|No kernels" | head -30
    timeout 240 ncu --clock-control none --kernel-name regex:_paged_attention --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/attention_probe.py --once 2>&1 \
      | grep -vE "^==PROF==|^\s*$|---" | grep -E "paged|Duration|Throughput|Grid|Registers|Shared|Cycles Per|Freq|rror|No kernels" | head -30
    ;;
  next)
    # The decode matmuls: the batch-1 slab kernel's size and warps on every matrix; cuBLAS
    # against cuBLASLt at 16-256 rows
    python3 benchmarks/linear_kernels.py 2>&1 | tail -30
    python3 benchmarks/linear_kernels.py --sweep 2>&1 | tail -11
    python3 benchmarks/linear_kernels.py --blas 2>&1 | tail -22
    ;;
  pipeline)
    # A change to the attention kernel: its tests at full shapes, then BASE against this tree in
    # the micro-benchmark (decode, split, prefill) and end to end (W1 Qwen3 twice, W2 both models)
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/test_gpu.py 2>&1 \
      | tail -3 | tee "$OUT/pipeline_tests.txt"
    trees "^(llama|qwen)" attention_kernels.py --no-tune
    trees "b=" attention_kernels.py --tune-split
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    w2 "$BASE" base qwen3-0.6b "1 64"; w2 . new qwen3-0.6b "1 64"
    ;;
  cand)
    # Changes to both decode kernels (attention grid, slab matmul): their tests at full shapes;
    # ragged-context attention in both trees; the slab kernel on every matrix; then end to end,
    # BASE against this tree: W1 Qwen3 twice, W2 Llama-3-8B, W1 Llama-3-8B
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_ops.py -k "attention or linear" 2>&1 | tail -3 | tee "$OUT/cand_tests.txt"
    trees "Ragged|ctx" attention_kernels.py --ragged
    python3 benchmarks/linear_kernels.py 2>&1 | tail -24
    for rep in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    ;;
  order)
    # The decode attention grid in batch order (longest first) and the slab kernel's weight
    # prefetch before pdl_wait: tests at full shapes; ragged contexts BASE against this tree;
    # W2 batch 1 MID (grid, no prefetch) against this tree; W1 BASE against this tree
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_ops.py -k "attention or linear" 2>&1 | tail -3 | tee "$OUT/order_tests.txt"
    trees "ctx" attention_kernels.py --ragged
    for model in qwen3-0.6b llama3-8b; do w2 "$MID" mid $model 1; w2 . new $model 1; done
    w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    ;;
  closing)
    # The session's figures first, then W1's prefill steps alone (every request stops after one
    # token): their wall against GPU kernel time, and the host's hot spots; then the GPU tests of the
    # attention and batch-1 linear kernels and the engine
    w1 . main qwen3-0.6b; w1 . main llama3-8b
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --output-len 1 1 --profile \
      --out "$OUT/prefill" > "$OUT/prefill_profile.txt" 2>&1
    grep -E "^pagoda |prefill batch|decode  batch|all:|roofline|profiled run|^  [a-z]|^ +[0-9.]+ s " "$OUT/prefill_profile.txt" | head -40
    grep -A28 "Ordered by" "$OUT/prefill_profile.txt" | cut -c1-150
    timeout 270 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/test_gpu.py \
      tests/kernels/test_triton_ops.py::test_small_m_linear{,_k_chunks,_dispatch} 2>&1 | tail -4 \
      | tee "$OUT/closing_tests.txt"
    ;;
  profile8)
    # Where W1's time goes now, both models (after a warm-up run): the plain run with its Triton
    # compiles (none expected since the attention kernel no longer specializes on metadata
    # alignment), then the profiled runs: steps by batch size, GPU time by kernel kind, top kernels
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    for model in qwen3-0.6b llama3-8b; do
      python3 benchmarks/throughput.py --model-config $M/$model.json --no-tqdm --profile --out "$OUT/$model" \
        > "$OUT/profile_$model.txt" 2>&1
      grep -E "^pagoda |compiled|variant:|prefill batch|decode  batch|all:|roofline|profiled run|^  [a-z]|^ +[0-9.]+ s " \
        "$OUT/profile_$model.txt" | cut -c1-160
    done
    ;;
  gemm9)
    # The sampler kernel as merged last session (not yet run on a GPU), then the tiled GEMM
    # against cuBLAS over a tile sweep
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_sampler.py \
      tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/gemm9_tests.txt"
    python3 benchmarks/sampler_bench.py --batch 256 1 2>&1 | grep -E "^ +[0-9]+ " | tee "$OUT/sampler.txt"
    [ -f benchmarks/gemm_probe.py ] && timeout 300 python3 benchmarks/gemm_probe.py 2>&1 \
      | tee "$OUT/gemm_probe.txt"   # (on branch tile-gemm-probe only)
    ;;
  host9)
    # Is W1's prefill host-bound (41 ms a step, the host never waiting)? Phases of the prefill
    # steps at W1's mean prompt length, then with cProfile; then the figures with main's code
    for m in qwen3-0.6b llama3-8b; do
      python3 benchmarks/step_overhead.py --model-config $M/$m.json --prefill --num-requests 256 --prompt-len 562 \
        2>&1 | grep -v Warning | tail -11 | sed "s/^/$m: /"
    done
    python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --prefill --num-requests 256 \
      --prompt-len 562 --cprofile 2>&1 | grep -v Warning | tail -45 > "$OUT/prefill_cprofile.txt"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    w1 . main qwen3-0.6b; w1 . main qwen3-0.6b; w1 . main llama3-8b
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    ;;
  prewait9)
    # The attention kernel's tiles of the old context before its PDL wait: tests, then BASE
    # against this tree, interleaved
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/test_gpu.py \
      2>&1 | tail -3 | tee "$OUT/prewait9_tests.txt"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    for run in 1 2; do w2 "$BASE" base llama3-8b 64; w2 . new llama3-8b 64; done
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    ;;
  final9)
    # Tests of the kernels changed today, host time per eager launch (W1's prefill steps are host-bound),
    # then the figures: W1 both models (after a warm-up), W2 both models
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/test_gpu.py \
      2>&1 | tail -3 | tee "$OUT/final9_tests.txt"
    python3 benchmarks/host_launch.py 2>&1 | tail -10 | tee "$OUT/host_launch.txt"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    w1 . main qwen3-0.6b; w1 . main qwen3-0.6b; w1 . main llama3-8b
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"; w2 . main llama3-8b 64
    run "W1 qwen3-0.6b blas=cublaslt" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --knob blas=cublaslt \
      --out "$OUT/lt"
    run "W1 llama3-8b blas=cublaslt" throughput.py --model-config $M/llama3-8b.json --no-tqdm --knob blas=cublaslt \
      --out "$OUT/lt"
    ;;
  w1ab9)
    # Does the attention's pre-wait cost W1 Qwen3-0.6B anything? BASE against this tree on one
    # machine, each tree's Triton cache warmed first
    warm_w1 "$BASE" .
    for run in 1 2 3; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    ;;
  rope10)
    # The rotary embedding (and Qwen3's q/k norms) folded into the KV-write and attention kernels:
    # GPU tests, then BASE against this tree interleaved; then where a W1 prefill step's host time goes
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_ops.py tests/kernels/test_triton_backend.py tests/test_gpu.py \
      2>&1 | tail -4 | tee "$OUT/rope10_tests.txt"
    warm_w1 "$BASE" .
    for run in 1 2; do w2 "$BASE" base qwen3-0.6b "1 64"; w2 . new qwen3-0.6b "1 64"; done
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    python3 benchmarks/step_overhead.py --model-config $M/qwen3-0.6b.json --prefill --num-requests 256 \
      --prompt-len 562 --cprofile 2>&1 | grep -v Warning | tail -60 > "$OUT/prefill_cprofile.txt"
    ;;
  rope10b)
    # The two tests that failed in rope10, in full, and in BASE; W1 Qwen3-0.6B BASE / A1 (the fold
    # with the queries' positions loaded) / this tree (positions from the context), interleaved
    for tree in . "$BASE"; do
      (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider \
        tests/test_gpu.py tests/kernels/test_triton_backend.py -k "one_kernel_sampler_filters or matches_torch" \
        2>&1 | grep -v Warning | tail -25 | sed "s|^|$(basename $tree): |")
    done
    warm_w1 "$BASE" "$A1" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 "$A1" a1 qwen3-0.6b; w1 . new qwen3-0.6b; done
    ;;
  graphs10)
    # CUDA graphs of mixed steps, on top of the rope fold (A2): GPU tests; then W1 Qwen3-0.6B
    # BASE / A2 / this tree interleaved, W1 Llama-3-8B A2 / this tree
    timeout 280 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_backend.py tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/graphs10_tests.txt"
    warm_w1 "$BASE" "$A2" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 "$A2" a2 qwen3-0.6b; w1 . new qwen3-0.6b; done
    w1 "$A2" a2 llama3-8b; w1 . new llama3-8b
    ;;
  final10)
    # The graph tests fixed for the GPU, a W1 prefill step's phases in A2 (eager prefill steps)
    # against this tree (mixed-step graphs), W2 both models
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_backend.py tests/test_gpu.py \
      -k "graph_forward or cuda_graphs_match" 2>&1 | tail -4 | tee "$OUT/final10_tests.txt"
    for tree in "$A2" .; do
      (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/step_overhead.py --model-config $MA/qwen3-0.6b.json \
        --prefill --num-requests 256 --prompt-len 562 --out "$OUT/$(basename $tree)" 2>&1 | grep -v Warning \
        | tail -9 | sed "s|^|$(basename $tree): |")
    done
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    ;;
  check10)
    # The A/B the ninth session could not run: BASE = the eighth session's main, a git worktree
    # (git worktree add --detach .ab/f609 f6094ef; a plain copy does not follow checkouts), against
    # this tree: prefill step phases, W2 both models, W1 Qwen3-0.6B twice, interleaved
    for tree in "$BASE" .; do
      (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/step_overhead.py --model-config $MA/qwen3-0.6b.json \
        --prefill --num-requests 256 --prompt-len 562 --out "$OUT/$(basename $tree)" 2>&1 | grep -v Warning \
        | tail -12 | sed "s|^|$(basename $tree): |")
    done
    w2 "$BASE" base qwen3-0.6b "1 64"; w2 . new qwen3-0.6b "1 64"
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    warm_w1 "$BASE" .    # a fresh machine's first W1 runs 5-10% slow
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    ;;
  mask12)
    # The decode attention's old-context tiles unmasked, the new token's tile apart, 128 registers:
    # attention tests at full shapes; decode tiles on W1's ragged batches (this tree's harness in
    # both trees); W1 Qwen3-0.6B twice and Llama-3-8B once, BASE against this tree interleaved
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_backend.py 2>&1 | tail -3 | tee "$OUT/mask12_tests.txt"
    cp benchmarks/attention_kernels.py "$BASE/benchmarks/attention_kernels.py"
    trees "b=|TILE|case" attention_kernels.py --decode-tiles
    (cd "$BASE" && git checkout -q benchmarks/attention_kernels.py)
    warm_w1 "$BASE" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    ;;
  w2check12)
    # W2 after the attention's unmasked tiles: Qwen3-0.6B batch 1, Llama-3-8B batches 1 and 64,
    # BASE against this tree interleaved
    for run in 1 2; do
      w2 "$BASE" base qwen3-0.6b 1; w2 . new qwen3-0.6b 1
    done
    w2 "$BASE" base llama3-8b "1 64"; w2 . new llama3-8b "1 64"
    ;;
  tiles13)
    # Decode tiles at 96 registers (5 programs an SM) with two K/V buffers of 32 or 16 tokens:
    # the sweep on W1's ragged batches, then W1 Qwen3-0.6B with two of them against the default,
    # interleaved
    python3 benchmarks/attention_kernels.py --decode-tiles 2>&1 | grep -E "b=|Decode|case"
    T32='--knob triton_attention.TILES={16:{"TILE_N":32,"num_stages":5,"maxnreg":96}}'
    T16='--knob triton_attention.TILES={16:{"TILE_N":16,"num_stages":6,"maxnreg":96}}'
    warm_w1 .
    for r in 1 2; do
      run "W1 qwen3 default" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/a"
      run "W1 qwen3 tiles 32x2 96 regs" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/b" "$T32"
      run "W1 qwen3 tiles 16x2 96 regs" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/c" "$T16"
    done
    ;;
  w4a16)
    # W5 on the GPU: the W4A16 kernel's tests, the GPTQ / AWQ / 8-bit tests, the kernel on the
    # decode matrices against bf16 and the dequantize path, W2 bf16 / GPTQ / AWQ
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py tests/test_quant_int4.py \
      tests/test_quant_w8.py 2>&1 | tail -4 | tee "$OUT/quant_tests.txt"
    python3 benchmarks/w4a16.py 2>&1 | tail -32
    for m in qwen3-0.6b llama3-8b; do
      [ -n "${NO_BF16:-}" ] || run "W2 $m bf16" latency.py --model-config $MA/$m.json --batch 1 8 64 --out "$OUT/bf16"
      run "W2 $m gptq" latency.py --model-config $MA/$m.json --batch 1 8 64 --quantization gptq --out "$OUT/gptq"
    done
    run "W2 qwen3-0.6b awq" latency.py --model-config $MA/qwen3-0.6b.json --batch 1 8 64 --quantization awq --out "$OUT/awq"
    ;;
  w4a16b)
    # The W4A16 kernel, second round (words unpacked in registers, no int-to-float conversion,
    # the weight as the dot's A): GPU tests, the online-FP8 test's failure in full, the tile
    # sweep, W2 GPTQ both models with the sweep's best tiles
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py 2>&1 | tail -3
    python3 -m pytest -q -x -p no:cacheprovider tests/test_quant_w8.py -k online_fp8 2>&1 | grep -E "^E |Error" | head -24
    python3 benchmarks/w4a16.py --sweep --out "$OUT" 2>&1 | grep sweep
    for m in qwen3-0.6b llama3-8b; do
      run "W2 $m gptq" latency.py --model-config $MA/$m.json --batch 1 8 64 --quantization gptq --out "$OUT/gptq" \
        $(cat "$OUT/w4a16_best_knobs.txt")
    done
    ;;
  w5w1)
    # W5's W1: the W4A16 kernel on W1's decode batches (up to 256 rows, row tiles of 64), then W1
    # with GPTQ / AWQ 4-bit weights against bf16, both models, in one run
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py 2>&1 | tail -2
    python3 benchmarks/w4a16.py --rows 64 128 256 --out "$OUT" 2>&1 | grep "^all eight"
    for m in qwen3-0.6b llama3-8b; do
      for q in bf16 gptq; do
        qa=""; [ $q = bf16 ] || qa="--quantization $q"
        python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm $qa --out "$OUT/$m-$q" 2>&1 \
          | grep -E "^pagoda |^roofline of this" | sed "s/^/W1 $m $q: /"
      done
    done
    python3 benchmarks/throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --quantization awq \
      --out "$OUT/qwen3-awq" 2>&1 | grep -E "^pagoda |^roofline of this" | sed "s/^/W1 qwen3-0.6b awq: /"
    ;;
  w5tiles)
    # The W4A16 kernel's own tiles for 128- and 256-row batches (W1's decode steps): tests, the
    # sweep, the eight matrices and W1 GPTQ both models with the sweep's best
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py 2>&1 | tail -2
    python3 benchmarks/w4a16.py --sweep --rows 128 256 --out "$OUT" 2>&1 | grep sweep
    cat "$OUT/w4a16_best_knobs.txt"; echo
    for m in qwen3-0.6b llama3-8b; do
      python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --quantization gptq --out "$OUT/$m-gptq" \
        $(cat "$OUT/w4a16_best_knobs.txt") 2>&1 | grep -E "^pagoda |^roofline of this" | sed "s/^/W1 $m gptq: /"
    done
    ;;
  tp2)
    # Tensor parallelism on two GPUs of one host: the tests (NCCL), then W2 Llama-3-8B at tp 1
    # and 2, W1 both models at tp 2 (unless NO_W1)
    # Each file's two-GPU test on its own, its log live; a test still running after STACKS_AFTER
    # seconds prints the stacks of this process (faulthandler) and of the spawned ranks (USR1).
    nvidia-smi topo -m 2>&1 | head -3
    for t in tensor pipeline data; do
      ( sleep "${STACKS_AFTER:-150}"; pkill -USR1 -f "multiprocessing.spawn impor[t]" ) & watch=$!
      timeout "${TEST_LIMIT:-240}" python3 -m pytest -q -s -p no:cacheprovider -o log_cli=true \
        --log-cli-level=INFO -o faulthandler_timeout="${STACKS_AFTER:-150}" "tests/test_${t}_parallel.py" -k gpus 2>&1 \
        | grep -v "^$" | tail -40
      kill $watch 2>/dev/null
    done
    for tp in 1 2; do
      run "W2 llama3-8b tp$tp" latency.py --model-config $MA/llama3-8b.json --batch 1 64 -tp $tp --out "$OUT/tp$tp"
    done
    [ -n "${NO_W1:-}" ] || for m in llama3-8b qwen3-0.6b; do
      python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm -tp 2 --out "$OUT/tp2" 2>&1 \
        | grep -E "^pagoda |^roofline of this|Error|error" | sed "s/^/W1 $m tp2: /"
    done
    ;;
  serve16)
    # W3: the OpenAI server under Poisson arrivals, both models (fastapi, uvicorn, pydantic ride in .whl)
    python3 benchmarks/serve.py --model-config $MA/qwen3-0.6b.json --num-prompts 256 --request-rates 16 64 inf \
      --out "$OUT/w3" 2>&1 | grep -E -A5 "rate  done|Error|error" | sed "s/^/W3 qwen3-0.6b: /"
    python3 benchmarks/serve.py --model-config $MA/llama3-8b.json --num-prompts 256 --request-rates 8 32 inf \
      --out "$OUT/w3" 2>&1 | grep -E -A5 "rate  done|Error|error" | sed "s/^/W3 llama3-8b: /"
    ;;
  serve17)
    # W3 with the asyncio client: both models at W1's lengths, then the server stack alone over a
    # stand-in engine of Qwen3-0.6B's step time (this host's CPU, no GPU work)
    for m in qwen3-0.6b llama3-8b; do
      python3 benchmarks/serve.py --model-config $MA/$m.json --num-prompts 256 --request-rates 16 64 inf \
        --out "$OUT/w3" 2>&1 | grep -E -A4 "rate  done|Error|error" | sed "s/^/W3 $m: /"
    done
    python3 benchmarks/serve.py --fake-step-ms 6 --num-prompts 256 --request-rates inf --out "$OUT/w3" 2>&1 \
      | grep -E -A2 "rate  done|Error|error" | sed "s/^/W3 fake 6 ms: /"
    ;;
  skip18)
    # The most fusing the layers' norms and SiLU-and-mul into their GEMMs could gain: W1 with those
    # kernels replaced by views (op_skip_probe.py), against the plain tree, interleaved
    warm_w1 .
    for round in 1 2; do
      for v in none norm,silu; do
        python3 benchmarks/op_skip_probe.py $v --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/skip_$v" 2>&1 \
          | grep -E "^pagoda " | sed "s/^/W1 qwen3 skip=$v $round: /"
      done
    done
    for v in none norm,silu; do
      python3 benchmarks/op_skip_probe.py $v --model-config $MA/llama3-8b.json --no-tqdm --out "$OUT/skipl_$v" 2>&1 \
        | grep -E "^pagoda " | sed "s/^/W1 llama skip=$v: /"
    done
    ;;
  fp8kv)
    # The FP8 KV cache (kv_cache_dtype="fp8"): its kernel tests at full shapes, the decode tiles on
    # W1's ragged batches, then W1 and W2 of both models with the bf16 cache and the FP8 one
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/kernels/test_triton_backend.py \
      -k "fp8 or backend_matches" 2>&1 | tail -3
    [ -n "${NO_TILES:-}" ] || python3 benchmarks/attention_kernels.py --decode-tiles --kv-fp8 2>&1 \
      | grep -E "b=|Decode|case|Error" | sed "s/^/fp8 tiles: /"
    [ -z "${BF16_TILES:-}" ] || python3 benchmarks/attention_kernels.py --decode-tiles 2>&1 \
      | grep -E "b=|Decode|case|Error" | sed "s/^/bf16 tiles: /"
    [ -n "${NO_W1:-}" ] || warm_w1 .
    [ -n "${NO_W1:-}" ] || for m in ${MODELS:-qwen3-0.6b llama3-8b}; do
      for round in $(seq ${ROUNDS:-1}); do
        for kv in auto fp8; do
          python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --kv-cache-dtype $kv \
            --out "$OUT/w1_$kv" ${KNOBS:-} 2>&1 | grep -E "^pagoda |^roofline of this|Error" | sed "s/^/W1 $m kv=$kv $round: /"
        done
      done
    done
    [ -n "${NO_W2:-}" ] || for m in ${MODELS:-qwen3-0.6b llama3-8b}; do
      for kv in auto fp8; do
        python3 benchmarks/latency.py --model-config $MA/$m.json --batch 1 64 --kv-cache-dtype $kv \
          --out "$OUT/w2_$kv" ${KNOBS:-} 2>&1 | grep -E "^pagoda |Error" | sed "s/^/W2 $m kv=$kv: /"
      done
    done
    ;;
  warps19)
    # Decode tiles of fewer warps (2 and 1: fewer cross-warp reductions a tile, more programs an SM),
    # bf16 and FP8 caches, on W1's ragged batches
    T="64,4,3,128;64,2,3,128;64,2,4,128;32,2,3,128;32,2,4,128;128,2,3,128;64,1,3,0;32,1,3,0"
    for kv in "" --kv-fp8; do
      python3 benchmarks/attention_kernels.py --decode-tiles $kv --tiles "$T" 2>&1 \
        | grep -E "b=|Decode|case|Error" | sed "s/^/tiles $kv: /"
    done
    ;;
  many19)
    # W1 with the one-warp tiles of many-program decode launches (MANY_DECODES) against without
    # them (MANY_DECODES_PER_SM=10**9), interleaved: Qwen3-0.6B with the bf16 and the FP8 cache,
    # Llama-3-8B with the bf16 cache
    warm_w1 .
    for run in "qwen3-0.6b auto" "qwen3-0.6b fp8" "llama3-8b auto"; do
      set -- $run
      for many in default 1000000000; do
        knob=""; [ $many = default ] || knob="--knob triton_attention.MANY_DECODES_PER_SM=$many"
        python3 benchmarks/throughput.py --model-config $MA/$1.json --no-tqdm --kv-cache-dtype $2 $knob \
          --out "$OUT/w1_$many" 2>&1 | grep -E "^pagoda |Error" | sed "s/^/W1 $1 kv=$2 many=$many: /"
      done
    done
    ;;
  session20)
    # The twentieth session's changes on one GPU: the pooling runner on CUDA (tiny Llama against HF),
    # the GPU tests; W1 both models (a check after the batch queue and the pooling in the scheduler and
    # runner); embedding throughput of Qwen3-0.6B against HF's forward
    python3 -m pytest -q -p no:cacheprovider tests/test_pooling.py -k tiny 2>&1 | tail -2 | sed "s/^/pooling tests: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -2 | sed "s/^/GPU tests: /"
    w1_check
    python3 benchmarks/embed.py --model-config $MA/qwen3-0.6b.json --hf --out "$OUT/embed" 2>&1 | tail -4
    ;;
  session21)
    # The twenty-first session's changes on one GPU: classifiers and cross-encoders on CUDA against
    # HF (test_classify.py, on the default device), calculate_kv_scales (graphs captured after the
    # first step), the pooling and GPU tests; W1 both models (a check after the model's classifier
    # head and the runner's changes)
    python3 -m pytest -q -p no:cacheprovider tests/test_classify.py -k "not parallel_ranks" 2>&1 | tail -2 | sed "s/^/classify tests: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_cache.py -k calculate 2>&1 | tail -2 | sed "s/^/kv scales test: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_pooling.py -k tiny 2>&1 | tail -2 | sed "s/^/pooling tests: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -2 | sed "s/^/GPU tests: /"
    w1_check
    ;;
  prefill22b)
    # The prefill tiles of 128 tokens: the attention tests' prefills at full shapes; W1 and W2 of
    # both models, BASE against this tree interleaved
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k "prefill or mixed" 2>&1 | tail -1 | sed "s/^/attention tests: /"
    warm_w1 "$BASE" .
    for m in qwen3-0.6b llama3-8b; do
      w1 "$BASE" base $m
      w1 . tree $m
      w2 "$BASE" base $m "1 64"
      w2 . tree $m "1 64"
    done
    ;;
  final22)
    # The final tree's GPU tests (classifiers, rerankers by hf_overrides, token-level pooling,
    # the engine); time to first token of a long prompt (7,680 tokens, batch 1), BASE against
    # this tree (prefill attention without masks below the diagonal, 128-token tiles)
    python3 -m pytest -q -p no:cacheprovider tests/test_classify.py -k "not parallel_ranks" 2>&1 | tail -1 | sed "s/^/classify tests: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_pooling.py -k tiny tests/test_gpu.py 2>&1 | tail -1 | sed "s/^/pooling + GPU tests: /"
    for m in qwen3-0.6b llama3-8b; do
      for tree in "$BASE" .; do
        (cd "$tree" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/latency.py --model-config "$MA/$m.json" --batch 1 \
          --prompt-len 7680 --output-len 16 --out "$OUT/long" 2>&1 | grep "^pagoda " | sed "s|^|long prompt $m $(basename $tree): |")
      done
    done
    ;;
  pdl22)
    # Programmatic edges into cuBLAS's GEMMs (pdl_gemm_probe.py): which GEMM kernels wait for their
    # predecessor's writes, what PDL into them would gain on MLP halves. (Call 1: none waits.)
    python3 benchmarks/pdl_gemm_probe.py --out "$OUT/pdl" 2>&1 | grep -v "^$"
    ;;
  prefill22)
    # Prefill attention without masks below the causal diagonal: the attention tests at full
    # shapes; prefill tiles, BASE against this tree; W1 Qwen3-0.6B BASE / tree interleaved
    python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py 2>&1 | tail -2 | sed "s/^/attention tests: /"
    for tree in "$BASE" .; do
      PAGODA_ROOT=$tree python3 benchmarks/attention_kernels.py --prefill 2>&1 | grep -E "^(qwen|llama)|Error" \
        | sed "s|^|$(basename $tree): |"
    done
    warm_w1 "$BASE" .
    for round in 1 2; do
      w1 "$BASE" base qwen3-0.6b
      w1 . tree qwen3-0.6b
    done
    ;;
  asc21)
    # Several API servers (--api-server-count) against one, interleaved: W3 MODELS (default
    # qwen3-0.6b) at rates 64 and inf, ROUNDS (default 2); first the GPU tests of this session
    # that needed the server's wheels or failed in call 1 (fastapi etc. ride in .whl)
    python3 -m pytest -q -p no:cacheprovider tests/test_classify.py -k "not parallel_ranks" 2>&1 | tail -2 | sed "s/^/classify tests: /"
    python3 -m pytest -q -p no:cacheprovider tests/test_fp8_kv_cache.py -k calculate 2>&1 | tail -2 | sed "s/^/kv scales test: /"
    for m in ${MODELS:-qwen3-0.6b}; do
      for round in $(seq ${ROUNDS:-2}); do
        for c in 1 2; do
          python3 benchmarks/serve.py --model-config $MA/$m.json --num-prompts 256 --request-rates 64 inf \
            --server-args "--api-server-count $c" --out "$OUT/w3_asc$c" 2>&1 | grep -E "^ +(64|inf) |Error" \
            | sed "s/^/W3 $m servers=$c round $round: /"
        done
      done
    done
    ;;
  embed20)
    # Embeddings (host-bound 16,384-token prefills on Qwen3-0.6B): the defaults; CUDA graphs of mixed
    # steps up to 16,384 tokens and 320 requests; 32,768-token steps; both
    E="python3 benchmarks/embed.py --model-config $MA/qwen3-0.6b.json --skip-floor --out $OUT/embed"
    G="--knob runner.cuda_graph.MAX_MIXED_CAPTURE=16384 --knob runner.cuda_graph.MAX_MIXED_REQS=320"
    for round in 1 2; do
      $E 2>&1 | grep "^pagoda " | sed "s/^/default $round: /"
      $E $G 2>&1 | grep "^pagoda " | sed "s/^/graphs16k $round: /"
      $E --max-num-batched-tokens 32768 2>&1 | grep "^pagoda " | sed "s/^/steps32k $round: /"
    done
    ;;
  serve19)
    # W3 with the engine in a process of its own (default) against its thread in the server's
    # process (PAGODA_ENGINE_PROCESS=0), interleaved: the stand-in engine (6 ms steps), then
    # MODELS (default qwen3-0.6b) at rates 64 and inf; QUANT=1 first reruns the GPTQ/AWQ tests
    [ -n "${QUANT:-}" ] && python3 -m pytest -q -p no:cacheprovider tests/test_quant_int4.py 2>&1 | tail -3
    for mode in 1 0; do
      PAGODA_ENGINE_PROCESS=$mode python3 benchmarks/serve.py --fake-step-ms 6 --num-prompts 256 --request-rates inf \
        --prompt-len 10 20 --output-len 200 300 --out "$OUT/w3fake" 2>&1 | grep -E "^ +inf |Error" | sed "s/^/W3 fake process=$mode: /"
    done
    for m in ${MODELS:-qwen3-0.6b}; do
      for mode in 1 0; do
        PAGODA_ENGINE_PROCESS=$mode python3 benchmarks/serve.py --model-config $MA/$m.json --num-prompts 256 \
          --request-rates 64 inf --out "$OUT/w3_$mode" 2>&1 | grep -E "^ +(64|inf) |Error" | sed "s/^/W3 $m process=$mode: /"
      done
    done
    ;;
  serve19ab)
    # W3: BASE's server (the engine on a thread of its process) against this tree's (the engine
    # in a process of its own), interleaved: MODELS (default qwen3-0.6b), ROUNDS (default 2)
    for m in ${MODELS:-qwen3-0.6b}; do
      for round in $(seq ${ROUNDS:-2}); do
        for v in base tree; do
          dir=.; [ $v = base ] && dir=$BASE
          (cd $dir && PYTHONPATH=$PWD:/tmp/site python3 $OLDPWD/benchmarks/serve.py --model-config $MA/$m.json \
            --num-prompts 256 --request-rates 64 inf --out "$OUT/w3ab" 2>&1 | grep -E "^ +(64|inf) |Error" \
            | sed "s/^/W3 $m $v $round: /")
        done
      done
    done
    ;;
  serve19dp)
    # Two GPUs: the data-parallel tests (DPEngine and the server's engine cores), then W3
    # Llama-3-8B with one engine core against two data-parallel ones (a GPU each), interleaved
    python3 -m pytest -q -p no:cacheprovider tests/test_data_parallel.py 2>&1 | tail -3
    for round in $(seq ${ROUNDS:-1}); do
      for dp in 1 2; do
        python3 benchmarks/serve.py --model-config $MA/llama3-8b.json --num-prompts 256 --request-rates 64 inf \
          --server-args "-dp $dp" --out "$OUT/w3dp$dp" 2>&1 | grep -E "^ +(64|inf) |Error" | sed "s/^/W3 llama3-8b dp=$dp $round: /"
      done
    done
    ;;
  serve16ab)
    # W3 Qwen3-0.6B, rates 64 and inf: BASE's server, this tree's, and this tree's with a 1 ms
    # GIL switch interval (sitecustomize), interleaved twice
    mkdir -p /tmp/sw && echo "import sys; sys.setswitchinterval(0.001)" > /tmp/sw/sitecustomize.py
    for round in 1 2; do
      for v in base tree sw; do
        dir=.; [ $v = base ] && dir=$BASE; extra=; [ $v = sw ] && extra=/tmp/sw:
        (cd $dir && PYTHONPATH=$extra$PWD:/tmp/site python3 $OLDPWD/benchmarks/serve.py --model-config $MA/qwen3-0.6b.json \
          --num-prompts 256 --request-rates 64 inf --out "$OUT/w3ab" 2>&1 | grep -E "^ +(64|inf) " | sed "s/^/W3 $v $round: /")
      done
    done
    ;;
  fp8)
    # FP8 weights: the slab kernel at one row, the W8A16 kernel for small batches, W8A8
    # (per-token FP8 activations, torch._scaled_mm) above; their tests, the W8A16 / W8A8
    # crossover, W2 Llama-3-8B (W1 both models unless NO_W1)
    python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py tests/kernels/test_triton_ops.py \
      tests/kernels/test_triton_w4a16.py -k "w8 or fp8 or eight_bit or per_token or small_m" 2>&1 | tail -3
    python3 benchmarks/w4a16.py --w8 --rows 2 8 16 32 64 128 256 --out "$OUT" 2>&1 | grep "^w8 "
    run "W2 llama3-8b fp8" latency.py --model-config $MA/llama3-8b.json --batch 1 8 64 --quantization fp8 --out "$OUT/fp8"
    [ -n "${NO_W1:-}" ] || for m in llama3-8b qwen3-0.6b; do
      python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --quantization fp8 --out "$OUT/fp8" 2>&1 \
        | grep -E "^pagoda |^roofline of this|Error" | sed "s/^/W1 $m fp8: /"
    done
    ;;
  gap13)
    # W1 both models profiled: the generate call against the sum of its steps (time outside the
    # steps), steps by batch size, kernels by kind
    for m in qwen3-0.6b llama3-8b; do
      python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --profile --out "$OUT/$m" \
        > "$OUT/profile_$m.txt" 2>&1
      grep -E "^pagoda |batch|all:|roofline|profiled run|^  [a-z]" "$OUT/profile_$m.txt" | cut -c1-170
    done
    ;;
  split12)
    # At 264-527 decode programs (batch 33-65 of 8 KV heads) one wave of unequal programs waits
    # for its longest: split them? Kernel on W1's ragged medium batches, then W1 Qwen3-0.6B with
    # SPLIT_BELOW_PROGRAMS_PER_SM=4, SPLIT_PROGRAMS_PER_SM=4 against the defaults, interleaved
    python3 benchmarks/attention_kernels.py --split-ragged 2>&1 | grep -E "b=|Split"
    S="--knob triton_attention.SPLIT_BELOW_PROGRAMS_PER_SM=4 --knob triton_attention.SPLIT_PROGRAMS_PER_SM=4"
    warm_w1 .
    for r in 1 2; do
      run "W1 qwen3 default" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/a"
      run "W1 qwen3 split below 4 per SM" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/b" $S
    done
    ;;
  acct11)
    # The tenth session's failing GPU error test in full; where W1 Qwen3-0.6B's time goes now,
    # by batch size (after a warm-up); decode steps at W1's small-batch tail, by kernel
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "weights_too_large" --tb=long 2>&1 \
      | tail -60 > "$OUT/acct11_test.txt"; tail -3 "$OUT/acct11_test.txt"
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --profile --out "$OUT/w1" \
      > "$OUT/profile_w1.txt" 2>&1
    grep -E "^pagoda |compiled|prefill batch|decode  batch|all:|roofline|profiled run|^  [a-z]|^ +[0-9.]+ s " \
      "$OUT/profile_w1.txt" | cut -c1-160
    python3 benchmarks/profile_step.py --model-config $M/qwen3-0.6b.json --batch 8 24 48 --prompt-len 1536 \
      --steps 32 --top 14 --out "$OUT/step" 2>&1 | grep -v Warn | tail -48
    ;;
  samp11)
    # The sampler without filters split over programs: GPU tests; the kernel alone, BASE (one
    # program a row) against this tree at 2-16 programs an SM; flash-decoding splits at W1's
    # medium batches; W1 Qwen3-0.6B, BASE against this tree interleaved (both warmed up)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_sampler.py \
      tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/samp11_tests.txt"
    (cd "$BASE" && PYTHONPATH=$PWD:/tmp/site python3 benchmarks/sampler_bench.py --batch 256 128 64 16 1 \
      --out "$OUT/base" 2>&1 | grep "temperature, one kernel" | sed "s/^/base: /")
    for k in 8 4 16 2; do
      python3 benchmarks/sampler_bench.py --only "temperature, one" --batch 256 128 64 16 1 --out "$OUT/k$k" \
        --knob triton_sampling.GUMBEL_PROGRAMS_PER_SM=$k 2>&1 | grep "temperature, one kernel" | sed "s/^/new $k per SM: /"
    done
    python3 benchmarks/attention_kernels.py --tune-split 2>&1 | grep -A14 "Split-KV"
    warm_w1 "$BASE" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    ;;
  samp11b)
    # The sampler's split counts as run-time arguments (one compiled variant) and flash-decoding
    # from two programs an SM down: GPU tests; the kernel alone; W1 both models, BASE against
    # this tree (Qwen3-0.6B twice, interleaved; both trees warmed up)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_gpu.py \
      --tb=short 2>&1 | grep -E "^E |passed|failed" | tail -12 | tee "$OUT/samp11b_tests.txt"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py -k "split or segment" \
      2>&1 | tail -2
    python3 benchmarks/sampler_bench.py --only "temperature, one" --batch 256 128 64 16 1 --out "$OUT/new" 2>&1 \
      | grep "temperature, one kernel"
    warm_w1 "$BASE" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    w1 "$BASE" base llama3-8b; w1 . new llama3-8b
    ;;
  samp11c)
    # The sampler's lanes keeping their own best and base-2 hardware logarithms: GPU tests;
    # the kernel alone (4 and 8 programs an SM); W1 Qwen3-0.6B, BASE against this tree
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_sampler.py \
      --tb=short 2>&1 | grep -E "^E |passed|failed" | tail -12 | tee "$OUT/samp11c_tests.txt"
    for k in 4 8; do
      python3 benchmarks/sampler_bench.py --only "temperature, one" --batch 256 128 64 16 1 --out "$OUT/k$k" \
        --knob triton_sampling.GUMBEL_PROGRAMS_PER_SM=$k 2>&1 | grep "temperature, one kernel" | sed "s/^/$k per SM: /"
    done
    warm_w1 "$BASE" .
    for run in 1 2; do w1 "$BASE" base qwen3-0.6b; w1 . new qwen3-0.6b; done
    ;;
  graphs12)
    # W1's prefill steps (16,384 tokens: 256 decodes beside some 30 prompt chunks) in CUDA
    # graphs, with room for 320 requests instead of the 1,024 that made them slower (ninth
    # session): W1 Qwen3-0.6B, main's limits against the raised ones, interleaved (eleventh
    # session's call 8 ran that W1 pair: no change); then the prefill steps alone, both ways
    G="--knob runner.cuda_graph.MAX_MIXED_CAPTURE=16384 --knob runner.cuda_graph.MAX_MIXED_REQS=320"
    # (a side question for the GEMMs' fixed cost: does this cuBLAS know programmatic dependent launch?)
    for lib in $(python3 -c "import glob, site; print(' '.join(f for d in site.getsitepackages() for f in glob.glob(d + '/nvidia/**/libcublasLt.so*', recursive=True)))"); do
      echo "$lib: $(strings "$lib" | grep -i -E 'pdl|programmatic|griddep' | sort -u | head -8 | tr '\n' ' ')"
    done
    warm_w1 .
    for run in 1 2; do
      run "W1 qwen3 main limits" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/a"
      run "W1 qwen3 graphs to 16384" throughput.py --model-config $MA/qwen3-0.6b.json --no-tqdm --out "$OUT/b" $G
    done
    python3 benchmarks/step_overhead.py --model-config $MA/qwen3-0.6b.json --prefill --num-requests 256 --prompt-len 562 2>&1 | tail -14
    python3 benchmarks/step_overhead.py --model-config $MA/qwen3-0.6b.json --prefill --num-requests 256 --prompt-len 562 $G 2>&1 | tail -14
    ;;
  next11)
    # For the eleventh session's first call: the tenth session's GPU-only error tests, then the
    # attention timeline probe from a worktree of branch attention-timeline (carry .ab/tl)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "clear_error" 2>&1 | tail -3 \
      | tee "$OUT/next11_tests.txt"
    [ -d .ab/tl ] && (cd .ab/tl && PYTHONPATH=$PWD:/tmp/site OUT=$OUT python3 benchmarks/attention_timeline.py 2>&1 \
      | grep -v Warn | tail -18)
    ;;
  s26a)
    # Twenty-sixth session, call 1: SmolLM2's first half rides along; W1 both models after a
    # warm-up (the twenty-fifth session's last commit was verified on CPU only)
    keep_smollm2_half
    warm_w1 .
    w1 . main qwen3-0.6b
    w1 . main llama3-8b
    w1 . main qwen3-0.6b
    ;;
  s26e)
    # Call 5: SmolLM2's first half rides along; the LoRA kernel's tests at full shapes; LoRA's
    # cost with its second matmul in one Triton kernel
    keep_smollm2_half
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_lora.py 2>&1 | tail -2
    warm_w1 .
    lora_costs "0 1" "0 1"
    ;;
  s26f)
    # Call 6 (warm): the GPU tests of LoRA (CPU against GPU, graphs) and the attention's
    join_smollm2
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "lora or float32" 2>&1 | tail -3
    ;;
  s28)
    # The twenty-eighth session's one call (its device time went on refused starts)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py tests/test_gpu.py \
      tests/kernels/test_triton_w4a16.py tests/test_quant_w8.py -k "moe or mixture or block" 2>&1 | tail -4 \
      | tee "$OUT/tests.txt"
    timeout 180 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --hf --out "$OUT/w2_moe" 2>&1 | tail -7
    timeout 60 python3 benchmarks/moe_kernels.py 2>&1 | tail -7
    timeout 60 python3 benchmarks/latency.py --model-config $MA/llama3-8b.json --batch 1 64 --quantization fp8-block \
      --out "$OUT/w2_fp8b" 2>&1 | grep -E "^pagoda|Error" | sed "s/^/W2 llama3-8b fp8-block: /"
    ;;
  moe28a)
    # The mixture of experts' first GPU run (built in the twenty-seventh session without a GPU): its
    # kernel's tests at full shapes and in a CUDA graph, the engine's CPU-vs-GPU test, the
    # micro-benchmark against the torch reference and its tile sweep (Qwen3-30B-A3B's layer)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -4 \
      | tee "$OUT/moe_kernel_tests.txt"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k mixture 2>&1 | tail -15 \
      | tee "$OUT/moe_gpu_test.txt"
    timeout 120 python3 benchmarks/moe_kernels.py 2>&1 | tail -8
    timeout 300 python3 benchmarks/moe_kernels.py --sweep 2>&1 | tail -8
    ;;
  moe28b)
    # The kernel's tests again (expert parallelism's expert_map), the micro-benchmark and the tile
    # sweep timed in CUDA graphs (eager calls of a few tokens wait on the host); W2 on Qwen3-30B-A3B's shapes
    # (dummy weights), HF transformers at batch 1 beside it
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -2
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k mixture 2>&1 | tail -2
    timeout 120 python3 benchmarks/moe_kernels.py 2>&1 | tail -8
    timeout 230 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --hf --out "$OUT/w2_moe" 2>&1 | tail -8
    timeout 240 python3 benchmarks/moe_kernels.py --sweep 2>&1 | tail -8
    ;;
  moe30)
    # W2 on Qwen3-30B-A3B's shapes with HF transformers beside it (the engine now freed before HF
    # loads); the MoE layer's tiles at decode batches, narrow and deep ones, in CUDA graphs
    timeout 250 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --hf --out "$OUT/w2_moe" 2>&1 | grep -E "^pagoda|^hf|start-up|Error" | sed "s/^/W2 qwen3-30b-a3b: /"
    timeout 230 python3 benchmarks/moe_kernels.py --sweep 1 8 64 256 2>&1 | tail -6
    ;;
  free30)
    # Is a deleted engine's memory given back on CUDA (latency.py's HF baseline OOMed beside one)?
    # And the MoE kernel's tests compiled with the new decode tiles
    for m in --eager --graphs; do timeout 120 python3 benchmarks/free_probe.py $MA/llama3-8b.json $m 2>&1 | grep -E "^free_probe|Error"; done
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -3
    ;;
  free31)
    # After the fix (no parameter <-> layer cycles under gc.freeze): sleep mode's and the dropped
    # engine's tests on the GPU, the probe, then W2 on Qwen3-30B-A3B's shapes with HF beside it
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_sleep_mode.py 2>&1 | tail -3
    timeout 120 python3 benchmarks/free_probe.py $MA/llama3-8b.json 2>&1 | grep -E "^free_probe|Error"
    timeout 300 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --hf --out "$OUT/w2_moe" 2>&1 | grep -E "^pagoda|^hf|start-up|Error" | sed "s/^/W2 qwen3-30b-a3b: /"
    ;;
  moe31)
    # Routing (select_experts) and the pairs' alignment (moe_align) in one launch each at decode
    # batches: their tests compiled, the layer in graphs, W2 on Qwen3-30B-A3B's shapes, BASE then tree
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -3
    timeout 150 python3 benchmarks/moe_kernels.py 2>&1 | tail -8
    for tree in "$BASE" .; do w2_moe "$tree"; done
    ;;
  moe31b)
    # The MoE kernels with programmatic dependent launch: tests, the layer in graphs, the decode
    # tile sweep (16-column tiles, K steps of 256, 2 warps), W2 on Qwen3-30B-A3B, BASE then tree
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -3
    timeout 100 python3 benchmarks/moe_kernels.py 2>&1 | tail -7
    timeout 150 python3 benchmarks/moe_kernels.py --sweep 1 8 64 2>&1 | tail -4
    for tree in "$BASE" .; do w2_moe "$tree"; done
    ;;
  check31)
    # Issue 3's table on main as it stands (the next session's first call): W1 both models after a
    # warm-up, W2 both models; then the MoE layer with its routing in graphs
    w1_check
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    timeout 100 python3 benchmarks/moe_kernels.py 2>&1 | tail -7
    ;;
  s33a)
    # The AWQ mixture-of-experts GPU test with its traceback, then check31
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "mixture and awq" --tb=short 2>&1 | tail -25
    bash "$0" check31
    ;;
  s33b)
    # The MoE engine tests against the CPU (bf16, block FP8, INT8, GPTQ, AWQ) with tracebacks (the
    # session's call also ran a probe not kept: each quantized layer against its reference on the
    # GPU), the quantized MoE kernel tests compiled, the INT4 layer with the weight tile as the
    # dot's B operand, then its A (since then the default, so "" and --transposed now run alike)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k mixture --tb=short 2>&1 | tail -30
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py -k "int4 or 8bit" 2>&1 | tail -3
    for t in "" --transposed; do timeout 100 python3 benchmarks/moe_kernels.py --int4 $t 2>&1 | tail -7 | sed "s/^/int4$t: /"; done
    ;;
  s33c)
    # Packed experts' 64-column decode tiles and their whole dequantization for large batches:
    # kernel and engine tests, the layer (packed kernel against dequantized), W2 and W1 with GPTQ
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py -k "int4 or 8bit or dequantize" 2>&1 | tail -2
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "mixture and (gptq or awq)" 2>&1 | tail -2
    timeout 120 python3 benchmarks/moe_kernels.py --int4 2>&1 | tail -8
    timeout 150 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --quantization gptq --out "$OUT/w2_moe_gptq" 2>&1 | grep -E "^pagoda|Error" | sed "s/^/W2 qwen3-30b-a3b gptq: /"
    timeout 150 python3 benchmarks/throughput.py --model-config benchmarks/models/qwen3-30b-a3b.json --no-tqdm \
      --quantization gptq --out "$OUT/w1_moe_gptq" 2>&1 | grep -E "^pagoda |^roofline|Error" | sed "s/^/W1 qwen3-30b-a3b gptq: /"
    ;;
  s33d)
    # INT8 weights on INT8 tensor cores above the W8A16 kernel's rows: tests, then the eight
    # matrices against the weight dequantized for cuBLAS (and bf16)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_ops.py -k per_token 2>&1 | tail -1
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py -k "int8_linear or matmul_paths" 2>&1 | tail -1
    timeout 150 python3 benchmarks/w4a16.py --w8 --int8 --rows 300 2048 16384 2>&1 | tail -3
    ;;
  s34a)
    # The INT8 W8A8 Triton kernel: its tests and the INT8 layer's, then the eight matrices against
    # the dequantized weight, cuBLAS's INT8 matmul and bf16, every INT8_SWEEP tile beside them
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_int8_mm.py 2>&1 | tail -2
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py -k "int8_linear or matmul_paths" 2>&1 | tail -1
    timeout 280 python3 benchmarks/w4a16.py --w8 --int8 --sweep --rows 257 512 1024 2048 4096 16384 2>&1 \
      | grep -v "^  tile"
    int8_table
    ;;
  s34b)
    # INT8 W8A8 at decode batches (against the W8A16 kernel), then W2 Llama-3-8B with INT8 W8A8
    # weights against bf16
    timeout 250 python3 benchmarks/w4a16.py --w8 --int8 --sweep --rows ${ROWS:-2 8 16 32 64 128 256} 2>&1 | grep -v "^  tile"
    int8_table
    [ -n "${NO_W2:-}" ] || for q in none w8a8; do
      run "W2 llama3-8b $q" latency.py --model-config $MA/llama3-8b.json --batch 1 8 64 \
        $([ $q = none ] || echo --quantization $q) --out "$OUT/w2_$q"
    done
    ;;
  s34c)
    # INT8 W8A8 from two rows: the tests, W2 Llama-3-8B and W1 both models against bf16, interleaved
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_int8_mm.py 2>&1 | tail -1
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py -k "int8 or matmul_paths" 2>&1 | tail -1
    for q in none w8a8; do
      run "W2 llama3-8b $q" latency.py --model-config $MA/llama3-8b.json --batch 1 8 64 \
        $([ $q = none ] || echo --quantization $q) --out "$OUT/w2_$q"
    done
    for m in llama3-8b qwen3-0.6b; do
      for q in none w8a8; do
        timeout 200 python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm \
          $([ $q = none ] || echo --quantization $q) --out "$OUT/w1_$q" 2>&1 \
          | grep -E "^pagoda |^roofline of this|Error|preempt" | sed "s/^/W1 $m $q: /"
      done
    done
    ;;
  s35a)
    # Batches over triton_w4a16.MAX_M rows: the weight dequantized in one Triton pass, then cuBLAS
    # (was: torch ops). Kernel tests; the eight matrices, kernel against dequantize + cuBLAS by
    # rows; W1 with GPTQ weights, BASE (the torch dequantization) then this tree at two MAX_M
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py tests/test_quant_int4.py \
      tests/kernels/test_triton_moe.py 2>&1 | tail -1
    timeout 200 python3 benchmarks/w4a16.py --rows 64 96 128 192 256 512 2048 16384 2>&1 | grep -E "^all eight"
    warm_w1 .
    for m in llama3-8b qwen3-0.6b; do
      (cd "$BASE" && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 benchmarks/throughput.py --model-config $MA/$m.json \
        --no-tqdm --quantization gptq --out "$OUT/w1_base" 2>&1 | grep -E "^pagoda |Error|compiled" | sed "s/^/W1 $m gptq base: /")
      for mm in ${MAX_MS:-256 128}; do
        timeout 100 python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --quantization gptq \
          --knob triton_w4a16.MAX_M=$mm --out "$OUT/w1_$mm" 2>&1 | grep -E "^pagoda |Error|compiled" \
          | sed "s/^/W1 $m gptq MAX_M=$mm: /"
      done
    done
    ;;
  s35b)
    # W8A8 with the activation quantization in the RMSNorm / SiLU-and-mul kernels: their tests
    # and the 8-bit ones compiled; W1 with INT8 (compressed-tensors) and FP8 (online) weights,
    # BASE (a quantization launch before each matmul) against this tree, interleaved
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_ops.py tests/test_quant_w8.py \
      tests/kernels/test_triton_int8_mm.py 2>&1 | tail -1
    warm_w1 . "$BASE"
    for m in qwen3-0.6b llama3-8b; do
      for q in w8a8 fp8; do
        for tree in "$BASE" .; do
          (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 benchmarks/throughput.py --model-config \
            $MA/$m.json --no-tqdm --quantization $q --out "$OUT/w1_$(basename $tree)" 2>&1 \
            | grep -E "^pagoda |Error" | sed "s|^|W1 $m $q $(basename $tree): |")
        done
      done
    done
    ;;
  s39b)
    # The thirty-ninth session's features on the GPU: LongRoPE / partial rotary and windows that
    # give blocks back, GPU path against the CPU path; the kernel and backend tests of both
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "sliding_windows" 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_backend.py 2>&1 | tail -2
    ;;
  s41a)
    # KV cache groups on the GPU: the sliding-window models against the CPU path (Gemma 3's window
    # on one layer of two: two groups), then the 7-layer Gemma 3 of four groups on the default device
    timeout 250 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "sliding_windows" 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_architectures.py \
      -k "hybrid_kv_cache_groups and not sharded" 2>&1 | tail -15
    ;;
  s41b)
    # Gemma-3-1B (dummy weights) W1 with the KV cache held to 1 GiB, then 3 GiB: its 4 full and 22
    # sliding layers in KV cache groups (hybrid) against every layer keeping its whole context
    # (GIBS=0: the memory the GPU gives)
    for gib in ${GIBS:-1 3}; do
      for h in on off; do
        kv=(); [ "$gib" != 0 ] && kv=(--kv-cache-gib $gib)
        timeout 170 python3 benchmarks/throughput.py --model-config benchmarks/models/gemma3-1b.json --no-tqdm \
          "${kv[@]}" --hybrid-kv-cache $h --out "$OUT/w1g" 2>&1 \
          | grep -E "^pagoda |Error|^\{" | sed -E 's/.*"preemptions": ([0-9]+).*"kv_blocks": ([0-9]+).*/preemptions \1, kv blocks \2/' \
          | sed "s/^/W1 gemma3-1b kv=${gib}GiB hybrid=$h: /"
      done
    done
    ;;
  s44b)
    # One row against 4-bit GPTQ weights: GEMV variants (gemv_probe.py), then ncu of one launch each
    timeout 300 python3 benchmarks/gemv_probe.py 2>&1 | tee "$OUT/gemv_probe.txt"
    if command -v ncu >/dev/null; then
      timeout 200 ncu --kernel-name regex:gemv --launch-skip 3 --launch-count 3 --section MemoryWorkloadAnalysis \
        --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy \
        python3 benchmarks/gemv_probe.py --ncu > "$OUT/ncu.txt" 2>&1; tail -5 "$OUT/ncu.txt"
    else echo "no ncu"; fi
    ;;
  s47a)
    # What the forty-sixth session could not run: the GGUF engine tests on CUDA (packed experts,
    # lazy loading; their compiling outlasted 110 s); Llama-3.2-1B's GGUF packed against
    # dequantized (is packed still slower at 1B?) and Qwen3-30B-A3B's with the word-row GEMV, W2
    # at batches 1, 8 and 64
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_gguf.py \
      -k "packed or replaced" 2>&1 | grep -E "^FAILED|^E  |passed|failed" | cut -c1-300 | head -12 | sed "s/^/gguf: /"
    OUT=$OUT/1b timeout 150 python3 benchmarks/gguf_load.py --model-config benchmarks/models/llama3.2-1b.json \
      --no-numpy --batch 1 8 64 2>&1 | tail -3
    timeout 200 python3 benchmarks/gguf_load.py --model-config benchmarks/models/qwen3-30b-a3b.json --packed-only \
      --batch 1 8 64 2>&1 | tail -1
    ;;
  s46d)
    # s46c's GEMV again with GGUF's groups a word row each (steps of 128, not 16 / 32): its tests,
    # the GGUF experts' and lazy loading's tests, Llama-3-8B's shapes as a GGUF file packed (W2 b=1)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_triton_w4a16.py \
      -k "gemv or float_zero or bf16x2 or layer" 2>&1 | grep -E "^FAILED|^E  |passed|failed" | cut -c1-300 \
      | head -8 | sed "s/^/w4a16: /"
    OUT=$OUT/8b timeout 100 python3 benchmarks/gguf_load.py --model-config benchmarks/models/llama3-8b.json \
      --packed-only 2>&1 | tail -1
    timeout 110 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_gguf.py \
      -k "experts_equal or replaced" 2>&1 | grep -E "^FAILED|^E  |passed|failed" | cut -c1-300 | head -8 \
      | sed "s/^/gguf: /"
    ;;
  s46c)
    # The session's changes in one call: the GEMV's, MoE kernels' and GGUF tests compiled;
    # Llama-3-8B's shapes as a GGUF file packed, PREV (float zeros in float32) vs tree (bf16x2);
    # a Qwen3-30B-A3B-shaped GGUF packed (load, memory, W2 b=1)
    timeout 80 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_triton_w4a16.py \
      -k "gemv or float_zero or bf16x2 or layer" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-300 | sed "s/^/w4a16: /"
    timeout 80 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_triton_moe.py \
      -k "int4 or dequantize" 2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-300 | sed "s/^/moe: /"
    timeout 100 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_gguf.py -k "packed or replaced" \
      2>&1 | grep -E "^FAILED|passed|failed" | cut -c1-300 | sed "s/^/gguf: /"
    for tree in ${PREV:-} .; do
      (cd $tree && OUT=$OUT/8b_$(basename $tree) timeout 110 python3 benchmarks/gguf_load.py --model-config \
        benchmarks/models/llama3-8b.json --packed-only 2>&1 | tail -1 | sed "s|^|$(basename $tree): |")
    done
    timeout 200 python3 benchmarks/gguf_load.py --model-config benchmarks/models/qwen3-30b-a3b.json --packed-only \
      2>&1 | tail -3
    ;;
  s45a)
    # The GEMV kernel merged: its tests compiled (and the attention's mixed / split ones); W2
    # Llama-3-8B batch 1 GPTQ, BASE (the previous GEMV) against this tree, and bf16; the eight
    # matrices at one row, BASE and tree (MORE=1: the GEMV's settings swept)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/kernels/test_triton_w4a16.py \
      > "$OUT/tests.txt" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/tests.txt" | cut -c1-300 | head -20
    [ "${QUICK:-}" ] || timeout 250 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      -k "mixed or split" 2>&1 | tail -1 | sed "s/^/attention (split decode merge): /"
    for m in llama3-8b ${QUICK:-qwen3-0.6b}; do   # (QUICK=" ": Llama-3-8B's GPTQ alone)
      w2 "$BASE" gptq_base $m 1 --quantization gptq; w2 . gptq_tree $m 1 --quantization gptq
      [ "${QUICK:-}" ] || w2 . bf16 $m 1
    done
    [ "${QUICK:-}" ] || trees "^all eight" w4a16.py --rows 1
    [ "${MORE:-}" ] && timeout 120 python3 benchmarks/w4a16.py --rows 1 --gemv-sweep 2>&1 | grep -E "^GEMV"
    ;;
  s43b)
    # GGUF on the GPU: the W4A16 kernels with float zero points; files as llama.cpp writes them
    # against their safetensors folders, packed (quantization="gguf") against dequantized (the
    # engine on CUDA, float32), the block types against gguf-py; load times, memory and W2 decode
    # of Q4_K_M-like files, dequantized / packed (8B without gguf-py's one-core baseline)
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py -k float_zero 2>&1 | tail -1
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gguf.py \
      -k "llama_like or torch_dequantize or packed or decompose" 2>&1 | tail -2
    timeout 100 python3 benchmarks/gguf_load.py --model-config benchmarks/models/llama3.2-1b.json 2>&1 | tail -8
    OUT=$OUT/8b timeout 200 python3 benchmarks/gguf_load.py --model-config benchmarks/models/llama3-8b.json \
      --no-numpy 2>&1 | tail -8
    ;;
  s41d)
    # The attention kernels' and backend's tests compiled (after the balanced launch's removal and
    # the KV cache groups' metadata)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py 2>&1 | tail -2
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_backend.py 2>&1 | tail -2
    ;;
  s41c)
    # The draft of s40b on its own: W2 Llama-3.2-1B-shaped at batch 1, async and sync scheduling
    for a in on off; do
      timeout 170 python3 benchmarks/latency.py --model-config benchmarks/models/llama3.2-1b.json --batch 1 \
        --output-len 128 --async-scheduling $a 2>&1 | grep -E "^pagoda |Error" | sed "s/^/W2 llama3.2-1b async=$a: /"
    done
    ;;
  s40b)
    # A draft model's cost (random weights: every draft rejected, a token a step): W2 Llama-3-8B at
    # batch 1 with a Llama-3.2-1B-shaped draft, k=4 and k=2, beside the same engine without drafts
    for spec in none '{"num_speculative_tokens": 4}' '{"num_speculative_tokens": 2}'; do
      extra=(); [ "$spec" != none ] && extra=(--draft-model-config benchmarks/models/llama3.2-1b.json --speculative-config "$spec")
      timeout 170 python3 benchmarks/latency.py --model-config $MA/llama3-8b.json --batch 1 --output-len 128 \
        --async-scheduling off "${extra[@]}" 2>&1 | grep -E "^pagoda |drafts:|Error" | sed "s/^/W2 llama3-8b sync draft=$spec: /"
    done
    ;;
  s37a)
    # The thirty-sixth and thirty-seventh sessions' changes compiled: the norm kernels (output dtype
    # a constexpr, Gemma's offset; PTX compared equal for sm_90 on the CPU), GELU-and-mul, the
    # fused-norm engine test with FP8 (bf16 on CUDA), the quantized tests, the sliding windows (on
    # some layers too), Gemma 2's score cap, head_dim 256, the Gemma models against the CPU path
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_ops.py 2>&1 | tail -1
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py tests/test_architectures.py 2>&1 | tail -1
    # the sliding window compiled (window 1,000 over 4,000-token contexts; WINDOW=0's PTX is unchanged)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py tests/kernels/test_triton_backend.py \
      -k "sliding or matches_torch or softcap or head_dim_256" 2>&1 | tail -1
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "sliding or mixture" 2>&1 | tail -3
    # Gemma-3-1B's shapes (head_dim 256, one KV head, windows on five layers of six, a 262k vocabulary)
    timeout 150 python3 benchmarks/latency.py --model-config benchmarks/models/gemma3-1b.json --batch 1 64 \
      --out "$OUT/w2" 2>&1 | grep -E "^pagoda|start-up|floor|Error" | sed "s/^/W2 gemma3-1b: /"
    ;;
  s36a)
    # Issue 3's table with its HF baselines in the same runs (W2 then W1, both models); SmolLM2's
    # first half kept for s36b
    keep_smollm2_half
    for m in qwen3-0.6b llama3-8b; do
      timeout 200 python3 benchmarks/latency.py --model-config $MA/$m.json --batch 1 64 --hf --out "$OUT/w2" 2>&1 \
        | grep -E "^pagoda|^hf|start-up|floor|Error" | sed "s/^/W2 $m: /"
    done
    warm_w1 .
    timeout 150 python3 benchmarks/throughput.py --model-config $MA/qwen3-0.6b.json --hf --no-tqdm --out "$OUT/w1" 2>&1 \
      | grep -E "^pagoda|^hf|^roofline|Error" | sed "s/^/W1 qwen3-0.6b: /"
    timeout 200 python3 benchmarks/throughput.py --model-config $MA/llama3-8b.json --hf --hf-requests 32 --no-tqdm \
      --out "$OUT/w1" 2>&1 | grep -E "^pagoda|^hf|^roofline|Error" | sed "s/^/W1 llama3-8b: /"
    ;;
  s36b)
    # (warm, after s36a) The GPU engine tests with SmolLM2 joined, then every kernel test compiled and the
    # quantized layers' tests
    join_smollm2
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/test_quant_w8.py tests/test_quant_int4.py \
      2>&1 | tail -4
    ;;
  s35c)
    # Issue 3's table on this tree (check31), then the GPU engine tests of the paths changed:
    # GPU vs CPU greedy, graphs vs eager, the quantized layers' and the W8A8 norm's tests
    bash "$0" check31
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "float32_matches or graphs_match or async" \
      2>&1 | tail -1
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_quant_w8.py tests/test_quant_int4.py 2>&1 | tail -1
    ;;
  s34e)
    # The W4A16 GEMV kernel for one row: kernel tests, the eight matrices (GEMV against the
    # tensor-core kernel, a tile sweep), W2 Llama-3-8B GPTQ with GEMV on and off
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py 2>&1 | tail -1
    timeout 200 python3 benchmarks/w4a16.py --rows 1 2 ${GEMV_SWEEP:+--gemv-sweep} 2>&1 | grep -E "^all eight|^GEMV"
    for g in 1 0; do
      for m in llama3-8b qwen3-0.6b; do
        run "W2 $m gptq GEMV=$g" latency.py --model-config $MA/$m.json --batch 1 \
          --quantization gptq --knob triton_w4a16.GEMV=$g --out "$OUT/w2_gptq_$g"
      done
    done
    ;;
  moe32)
    # W1 on Qwen3-30B-A3B's shapes in bf16 (on an H200 the KV cache holds W1's whole batch) and GPTQ
    for q in none gptq; do
      timeout 280 python3 benchmarks/throughput.py --model-config benchmarks/models/qwen3-30b-a3b.json --no-tqdm \
        $([ $q = none ] || echo --quantization $q) --out "$OUT/w1_moe_$q" 2>&1 \
        | grep -E "^pagoda |^roofline|Error|preempt" | sed "s/^/W1 qwen3-30b-a3b $q: /"
    done
    ;;
  int4moe32)
    # GPTQ / AWQ experts: the MoE kernel tests compiled, the CPU-vs-GPU engine test (bf16, block
    # FP8, GPTQ act-order, AWQ), W2 on Qwen3-30B-A3B's shapes in bf16, GPTQ and AWQ
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_moe.py 2>&1 | tail -3
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k mixture --tb=line 2>&1 | grep -E "^E |^/|passed|failed"
    timeout 100 python3 benchmarks/moe_kernels.py --int4 2>&1 | tail -7
    for q in none gptq awq; do
      timeout 150 python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
        $([ $q = none ] || echo --quantization $q) --out "$OUT/w2_moe_$q" 2>&1 | grep -E "^pagoda|Error" \
        | sed "s/^/W2 qwen3-30b-a3b $q: /"
    done
    ;;
  moe28c)
    # W1 on Qwen3-30B-A3B's shapes
    timeout 250 python3 benchmarks/throughput.py --model-config benchmarks/models/qwen3-30b-a3b.json --no-tqdm \
      --out "$OUT/w1_moe" 2>&1 | grep -E "^pagoda |^roofline|Error|preempt" | sed "s/^/W1 qwen3-30b-a3b: /"
    ;;
  fp8b28)
    # Block-wise FP8 (weight_block_size 128 x 128): its kernel and layer tests on the GPU, then W2
    # of both models in bf16, per-row FP8 and block FP8
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_w4a16.py tests/test_quant_w8.py \
      tests/kernels/test_triton_moe.py -k "block or w8" 2>&1 | tail -3
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k mixture 2>&1 | tail -2
    for m in qwen3-0.6b llama3-8b; do
      for q in none fp8 fp8-block; do
        python3 benchmarks/latency.py --model-config $MA/$m.json --batch 1 8 64 \
          $([ $q = none ] || echo --quantization $q) --out "$OUT/w2_$q" 2>&1 | grep -E "^pagoda|Error" \
          | sed "s/^/W2 $m $q: /"
      done
    done
    python3 benchmarks/latency.py --model-config benchmarks/models/qwen3-30b-a3b.json --batch 1 8 64 \
      --quantization fp8-block --out "$OUT/w2_moe_fp8" 2>&1 | grep -E "^pagoda|Error" | sed "s/^/W2 qwen3-30b-a3b fp8-block: /"
    ;;
  s27a)
    # Call 1: the most folding the layers' RMSNorms into their GEMMs could gain (norms alone skipped,
    # SiLU-and-mul kept), against the plain tree, interleaved
    warm_w1 .
    for m in qwen3-0.6b llama3-8b qwen3-0.6b; do
      for v in none norm; do
        python3 benchmarks/op_skip_probe.py $v --model-config $MA/$m.json --no-tqdm --out "$OUT/skip_$v" 2>&1 \
          | grep -E "^pagoda |Error" | sed "s/^/W1 $m skip=$v: /"
      done
    done
    ;;
  s26g)
    # Call 7: W1 with KV blocks of 16 and of 32 tokens, interleaved (the seed's tuning case)
    warm_w1 .
    for m in qwen3-0.6b llama3-8b qwen3-0.6b; do
      for bs in 16 32; do
        python3 benchmarks/throughput.py --model-config $MA/$m.json --no-tqdm --block-size $bs --out "$OUT/w1" 2>&1 \
          | grep -E "^pagoda |Error" | sed "s/^/W1 $m block $bs: /"
      done
    done
    ;;
  s26c)
    # Call 3: SmolLM2's first half rides along; LoRA's cost (torch's mask + addmm)
    keep_smollm2_half
    warm_w1 .
    lora_costs "0 1 4" "0 1"
    ;;
  s26d)
    # Call 4 (warm): the GPU tests, LoRA's included
    join_smollm2
    timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.txt"
    ;;
  spec24a)
    # Twenty-fourth session, call 1: SmolLM2's first half rides along; W1 Qwen3-0.6B after a warm-up
    keep_smollm2_half
    warm_w1 .
    w1 . main qwen3-0.6b
    ;;
  spec24b)
    # Call 2 (within the warm window): SmolLM2 whole again; the GPU tests (speculative decoding's
    # included); n-gram drafts on SmolLM2 chats, bf16; W2 Llama-3-8B batch 1 sync / async / with
    # drafts (random weights: the cost of a step that checks k drafts, whatever is kept)
    join_smollm2
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
    timeout 240 python3 benchmarks/spec_decode.py --model /tmp/smollm2.gguf --dtype bfloat16 2>&1 | tail -21
    for a in off on; do
      python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 --async-scheduling $a 2>&1 \
        | grep "^pagoda " | sed "s/^/W2 llama3-8b async $a: /"
    done
    for k in 2 4 8; do
      python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 \
        --speculative-config "{\"method\": \"ngram\", \"num_speculative_tokens\": $k}" 2>&1 \
        | grep -E "^pagoda |^drafts" | sed "s/^/W2 llama3-8b ngram k=$k: /"
    done
    ;;
  spec25a)
    # Twenty-fifth session, call 1: SmolLM2's first half rides along; W1 Llama-3-8B after a warm-up
    keep_smollm2_half
    warm_w1 .
    w1 . main llama3-8b
    ;;
  spec25b)
    # Call 2 (within the warm window): the GPU tests; n-gram drafts on SmolLM2 chats in bf16 and
    # in float32 (where verifying k drafts in one forward must not change a greedy token)
    join_smollm2
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4 | tee "$OUT/gpu_tests.txt"
    for dtype in bfloat16 float32; do
      mkdir -p "$OUT/$dtype"
      timeout 200 python3 benchmarks/spec_decode.py --model /tmp/smollm2.gguf --dtype $dtype --out "$OUT/$dtype" 2>&1 \
        | tail -21 | tee "$OUT/$dtype/table.txt"
    done
    ;;
  spec25c)
    # Call 3: SmolLM2's first half only (for spec25d, within the warm window)
    keep_smollm2_half
    ;;
  spec25d)
    # Call 4: where a step with drafts spends its time (cProfile of one chat at k = 0, 2, 8, bf16)
    join_smollm2
    timeout 300 python3 benchmarks/spec_decode.py --model /tmp/smollm2.gguf --dtype bfloat16 --profile --k 0 2 8
    ;;
  spec25e)
    # Call after spec25c (warm): the GPU tests alone, in full
    join_smollm2
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
    ;;
  spec25f)
    # Call 1 of 2: SmolLM2's first half rides along; the attention tests (drafts split over the
    # context, verification graphs' forward) compiled; verification attention, unsplit / split
    keep_smollm2_half
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_attention.py \
      tests/kernels/test_triton_backend.py 2>&1 | tail -3
    timeout 200 python3 benchmarks/attention_kernels.py --spec 2>&1 | tail -12
    ;;
  spec25g)
    # Call 2 (warm): the GPU tests (speculative greedy / seeded / logprobs through the verification
    # graphs); drafts on SmolLM2 (bf16); W2 Llama-3-8B batch 1 over a 7,680-token prompt without
    # drafts and with k=4, its verification attention split (the default) or not
    join_smollm2
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -3 | tee "$OUT/gpu_tests.txt"
    timeout 150 python3 benchmarks/spec_decode.py --model /tmp/smollm2.gguf --dtype bfloat16 --k 0 4 8 2>&1 | tail -16
    NG='{"method": "ngram", "num_speculative_tokens": 4}'
    for run in "none" "ngram" "ngram --knob triton_attention.SPLIT_MAX_QUERY_LEN=1"; do
      set -- $run
      extra=(); [ "$1" = ngram ] && extra=(--speculative-config "$NG" "${@:2}")
      python3 benchmarks/latency.py --model-config $M/llama3-8b.json --batch 1 --prompt-len 7680 --output-len 128 \
        "${extra[@]}" 2>&1 | grep -E "^pagoda |^drafts" | sed "s/^/W2 long $run: /"
    done
    ;;
  closing8)
    # The session's GPU tests (sampling kernel with its filters, attention, the engine), the
    # sampler alone, then the figures: W1 both models (after a warm-up), W2 both models
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_triton_sampling.py tests/test_sampler.py \
      tests/test_gpu.py tests/kernels/test_triton_attention.py 2>&1 | tail -4 | tee "$OUT/closing8_tests.txt"
    for scale in 1 2; do
      python3 benchmarks/sampler_bench.py --batch 256 1 --logit-scale $scale 2>&1 | grep -E "^ +[0-9]+ " \
        | grep -v "temperature [+,]" | sed "s/^/scale $scale: /" | tee -a "$OUT/sampler.txt"
    done
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    w1 . main qwen3-0.6b; w1 . main qwen3-0.6b
    run "W1 qwen3-0.6b top_p 0.9" throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --top-p 0.9
    w1 . main llama3-8b
    w2 . main qwen3-0.6b "1 64"; w2 . main llama3-8b "1 64"
    ;;
  w1_7)
    # W1 after a warm-up run (the first W1 of a fresh machine runs 5-10% slow), for each model
    # ($2, default both) $3 rounds (default 2 for Qwen3-0.6B, 1 for Llama-3-8B): BASE; this tree
    # (vLLM's batch defaults: 16,384 tokens, 1,024 sequences); this tree at the old 8,192 / 256
    python3 benchmarks/throughput.py --model-config $M/qwen3-0.6b.json --no-tqdm --num-requests 64 \
      --output-len 20 40 > /dev/null 2>&1
    for model in ${2:-qwen3-0.6b llama3-8b}; do
      rounds=${3:-$([ $model = qwen3-0.6b ] && echo 2 || echo 1)}
      for rep in $(seq $rounds); do
        w1 "$BASE" base $model; w1 . new $model
        python3 benchmarks/throughput.py --model-config $M/$model.json --no-tqdm --max-num-batched-tokens 8192 \
          --max-num-seqs 256 2>&1 | grep -E "^pagoda |compiled|variant:|^roofline of this" | sed "s|^|W1 $model new 8192/256: |"
      done
    done
    ;;
  *) echo "usage: $0 kernels|ops|engine|llama|profile|prefix|async|final|sampler|host|ab|split|smallbatch|linear|w1profile|smallm|tail|pdl|medium|tiles|tlb|probe|next|pipeline|cand|order|closing|w1_7|profile8|closing8"; exit 2 ;;
esac
