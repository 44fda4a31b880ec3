"""Shared benchmark helpers: dummy-model folders, the device's measured ceilings, HF baselines.

Importing it puts the checkout to benchmark first on sys.path: $PAGODA_ROOT if set, else this
one, so that this tree's scripts can time another worktree in an A/B run
(`PAGODA_ROOT=.ab/base python benchmarks/throughput.py ...`)."""
import json
import os
import sys
import tempfile
import time

# First on the path, ahead of the editable install and the current directory: a script must not
# time one tree's pagoda while its A/B label names another. Every script imports this module
# before pagoda (or tests) for that reason.
PAGODA_ROOT = os.path.abspath(os.environ.get("PAGODA_ROOT")
                              or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if not os.path.isdir(os.path.join(PAGODA_ROOT, "pagoda")):
    # (a mistyped PAGODA_ROOT would otherwise fall through to the installed pagoda, unnoticed)
    raise SystemExit(f"PAGODA_ROOT={PAGODA_ROOT} holds no pagoda/ package")
sys.path.insert(0, PAGODA_ROOT)


# W5: the quantization_config a dummy model's config.json gets for ``--quantization`` (4-bit
# weights in groups of 128, as the checkpoints people download mostly are)
DUMMY_QUANT_CONFIGS = {
    "gptq": dict(quant_method="gptq", bits=4, group_size=128, desc_act=False, checkpoint_format="gptq_v2"),
    "awq": dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm"),
    # vLLM's FP8 checkpoints: E4M3 weights, a float32 scale per tensor (per row once loaded)
    "fp8": dict(quant_method="fp8", activation_scheme="dynamic"),
    # DeepSeek's and Qwen3's FP8 releases: a scale per 128 x 128 block of weights
    "fp8-block": dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128]),
    # llm-compressor's INT8 W8A8 (compressed-tensors): a scale per output channel, activations
    # quantized per token at run time
    "w8a8": dict(quant_method="compressed-tensors", format="int-quantized", ignore=["lm_head"], config_groups={
        "group_0": dict(targets=["Linear"],
                        weights=dict(num_bits=8, type="int", symmetric=True, strategy="channel", dynamic=False),
                        input_activations=dict(num_bits=8, type="int", symmetric=True, strategy="token",
                                               dynamic=True))}),
}


def model_config(config_path: str, quantization: str | None = None) -> dict:
    """A benchmark model's config.json, with ``quantization``'s ``DUMMY_QUANT_CONFIGS`` entry as
    its quantization_config (what the dummy model loads, and what the floors count)."""
    with open(config_path) as f:
        cfg = json.load(f)
    if quantization:
        cfg["quantization_config"] = DUMMY_QUANT_CONFIGS[quantization]
    return cfg


def dummy_model_dir(config_path: str, quantization: str | None = None) -> str:
    """A folder holding just the config (``model_config``), for load_format="dummy"."""
    folder = tempfile.mkdtemp(prefix="pagoda-dummy-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model_config(config_path, quantization), f)
    return folder


def add_lora_args(parser) -> None:
    parser.add_argument("--num-loras", type=int, default=0,
                        help="spread the requests over this many random LoRA adapters (enable_lora, max_loras)")
    parser.add_argument("--lora-rank", type=int, default=16, help="their rank, on all seven projections")


def lora_setup(args, cfg: dict) -> tuple[dict, list | None]:
    """The engine arguments and LoRARequests of ``--num-loras`` random adapters (none: ``{}``, None)."""
    if not args.num_loras:
        return {}, None
    if cfg is None:
        raise SystemExit("--num-loras needs --model-config (the adapters' shapes)")
    from pagoda.lora.request import LoRARequest
    from tests.lora_utils import write_adapter
    folder = tempfile.mkdtemp(prefix="pagoda-lora-")
    loras = [LoRARequest(f"lora{i}", i + 1, write_adapter(os.path.join(folder, f"lora{i}"), cfg, r=args.lora_rank,
                                                          seed=i, scale=0.01))
             for i in range(args.num_loras)]
    return dict(enable_lora=True, max_loras=args.num_loras, max_lora_rank=args.lora_rank), loras


def add_word_tokenizer(folder: str) -> None:
    """A tokenizer.json for a dummy model's folder, for runs that need text (the server): one
    word per token id of the config's vocabulary. The prompts are token ids anyway; this only
    turns sampled ids into text as a real tokenizer of that size would."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    with open(os.path.join(folder, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # (joins the words with spaces)
    tok.save(os.path.join(folder, "tokenizer.json"))


def bar_chart(path: str, title: str, ylabel: str, groups: list[str], series: dict[str, list]) -> bool:
    """Grouped bars (one group per entry of ``groups``, one bar per series; None leaves a gap)
    saved as a PNG at ``path``. Skipped, returning False, where matplotlib is not installed
    (it is no dependency of pagoda)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(groups) * max(1, len(series)) / 2, 3.5))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, v in enumerate(values) if v is not None]
        bars = ax.bar(xs, [v for v in values if v is not None], width, label=name)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


class TritonCompiles:
    """The Triton kernel variants a with-block compiled, or loaded from Triton's disk cache
    (each costs the process up to seconds), and the seconds spent: a timed run should have none."""

    def __enter__(self):
        self.kernels, self.variants, self.seconds, self._start, self.runtime = [], [], 0.0, None, None
        try:
            import triton
        except ImportError:                         # a CPU machine without triton: nothing to count
            return self
        self.runtime = triton.knobs.runtime
        self.saved = (self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook)

        def before(**kw):
            self._start = time.perf_counter()
            return False                            # (True would skip the compile)

        def after(**kw):
            self.seconds += time.perf_counter() - (self._start or time.perf_counter())
            self.kernels.append(kw["fn"].name)
            # which variant: its constexprs and specialized arguments, to find what a warm-up misses
            consts = {k: v for k, v in kw.get("constants", {}).items() if isinstance(k, str) and k.isupper()}
            self.variants.append(f"{kw['fn'].name} {consts} {kw.get('configs', [''])[0]}")

        self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook = before, after
        return self

    def __exit__(self, *exc):
        if self.runtime is not None:
            self.runtime.jit_cache_hook, self.runtime.jit_post_compile_hook = self.saved

    def summary(self) -> str:
        names = sorted(set(self.kernels), key=self.kernels.index)
        return f"{len(self.kernels)} ({self.seconds:.1f} s: {', '.join(names) or 'none'})"


def add_knob_arg(parser) -> None:
    parser.add_argument("--knob", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="override a kernel module's tuning constant before the engine captures its "
                             "graphs, e.g. triton_attention.SPLIT_PROGRAMS_PER_SM=8 or "
                             "triton_linear.MAX_M=0, or outside the kernels by path, e.g. "
                             "runner.cuda_graph.MAX_MIXED_REQS=320, a dict's entries as a literal, e.g. "
                             "triton_attention.TILES='{16: {\"TILE_N\": 32, \"num_stages\": 5}}' "
                             "(repeatable): A/B runs of one constant; "
                             "blas=cublaslt picks torch's BLAS library for the GEMMs")


def apply_knob_args(args) -> None:
    import ast
    import importlib
    for knob in args.knob:
        target, value = knob.split("=", 1)
        if target == "blas":
            import torch
            torch.backends.cuda.preferred_blas_library(value)
            continue
        module_name, name = target.rsplit(".", 1)
        # a kernel module by its name (triton_attention), any other by its path (runner.cuda_graph)
        module = importlib.import_module(f"pagoda.{module_name}" if "." in module_name
                                         else f"pagoda.kernels.{module_name}")
        assert hasattr(module, name), f"{module.__name__} has no {name}"
        current = getattr(module, name)
        if isinstance(current, dict):   # entries merged in, each entry's own dict too
            for key, entry in ast.literal_eval(value).items():
                current[key] = {**current[key], **entry} if isinstance(entry, dict) else entry
        else:   # a literal ("0", "8", "0.5", "False") as the current value's type; else the string
            try:
                parsed = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                parsed = value
            setattr(module, name, type(current)(parsed))


def host_profile(llm, inputs, params, top: int = 25, path: str | None = None) -> None:
    """One more run of ``llm.generate(inputs, params)`` under cProfile, prefix cache reset
    first; prints the host's hottest functions (cProfile slows the host, so read their shares,
    not their times) and, with ``path``, saves the stats there."""
    import cProfile
    import pstats
    llm.reset_prefix_cache()
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(inputs, params, use_tqdm=False)
    pr.disable()
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        pr.dump_stats(path)
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def on_off(value: str) -> bool:
    """argparse type for on/off switches such as --async-scheduling."""
    if value not in ("on", "off"):
        raise ValueError(f"expected on or off, got {value!r}")
    return value == "on"


def graph_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median ms of ``fn`` replayed from one CUDA graph, as the engine's decode steps run (fn
    runs once eagerly first, so Triton compiles outside the capture): no Python launch cost."""
    import torch
    import triton.testing
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")


def host_seconds(fn, calls: int = 200) -> float:
    """Host time per call of ``fn`` (queueing GPU work without waiting for it), after one
    warm-up call; the device is drained before and after."""
    import torch
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return seconds


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and bf16 8192^3 matmul rate, measured now."""
    import torch
    import triton.testing
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=50, rep=200, return_mode="median")
    bw = 2 * x.numel() / (ms * 1e-3)
    del x, y
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    return {"copy_bytes_per_s": bw, "bf16_flops_per_s": 2 * 8192 ** 3 / (ms * 1e-3)}


def param_counts(cfg: dict) -> tuple[int, int]:
    """(parameters of the decoder layers one token runs through, parameters of the LM head). In a
    mixture of experts a token runs through the router and its top_k experts of each MoE layer
    (and a shared expert and its gate, where the model has one)."""
    from pagoda.config import ArchConfig
    arch = ArchConfig.from_hf_dict(cfg)
    h, n = arch.hidden_size, arch.num_hidden_layers
    attention = h * arch.head_dim * (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads)
    shared = 3 * h * arch.shared_expert_intermediate_size + h * bool(arch.shared_expert_intermediate_size)
    mlps = sum(h * arch.num_experts + 3 * h * arch.moe_intermediate_size * arch.num_experts_per_tok + shared
               if arch.is_moe_layer(i) else 3 * h * arch.intermediate_size for i in range(n))
    return n * attention + mlps, h * arch.vocab_size


def weight_bytes(cfg: dict, tokens: int = 1) -> float:
    """Bytes of weights a step of ``tokens`` tokens reads: the decoder layers' (bf16, or as the
    config's ``quantization_config`` packs them: ``bits`` a weight plus a bf16 scale and zero a
    group, or 8-bit weights' byte) and the bf16 LM head (read once per step, tied or not). In a
    mixture of experts, the experts a uniform routing picks for that many tokens, on average."""
    from pagoda.config import ArchConfig
    arch = ArchConfig.from_hf_dict(cfg)
    layers, head = param_counts(cfg)
    if arch.num_experts:
        e, k = arch.num_experts, arch.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** tokens)              # distinct experts of `tokens` draws of k
        expert = 3 * arch.hidden_size * arch.moe_intermediate_size
        layers += sum(arch.is_moe_layer(i) for i in range(arch.num_hidden_layers)) * expert * (touched - k)
    qc = cfg.get("quantization_config")
    eight_bit = qc is not None and (qc["quant_method"] == "fp8" or qc.get("format") == "int-quantized")
    per_weight = 2 if qc is None else 1 if eight_bit else qc["bits"] / 8 + 4 / qc["group_size"]
    return per_weight * layers + 2 * head


def hf_model(config_path: str, dtype="bfloat16"):
    import torch
    import transformers
    cfg = transformers.AutoConfig.from_pretrained(os.path.dirname(os.path.abspath(config_path))
                                                  if os.path.basename(config_path) == "config.json"
                                                  else dummy_model_dir(config_path))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return model.eval()


class Timer:
    def __enter__(self):
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.s = time.perf_counter() - self.t0


def ptxas_usage(kernel) -> str:
    """Registers and spills of the kernel's PTX assembled for sm_90a (``ptxas -v``)."""
    import re
    import subprocess

    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return f"{regs.group(1) if regs else '?'} registers, {spills.group(1) if spills else '?'} bytes spilled"
