"""EngineArgs: the keyword arguments of ``LLM(...)`` (vLLM's names), turned into EngineConfig."""
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from pagoda.config import (KV_CACHE_DTYPES, ArchConfig, CacheConfig, EngineConfig, KVCacheGroup, LoRAConfig,
                           ModelConfig, ParallelConfig, PoolerConfig, SchedulerConfig, SpeculativeConfig,
                           classifier_from_tokens, is_classifier, kv_cache_groups, sampling_defaults)
from pagoda.model.hub import default_model_path, resolve_model_path
from pagoda.model.loader import read_arch_config, read_generation_config, read_pooler_config, read_quant_config
from pagoda.quant.base import check_quantization_name, resolve_quantization
from pagoda.reasoning import check_reasoning_parser

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}
_LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _batch_defaults(device: str) -> tuple[int, int]:
    """Default (max_num_batched_tokens, max_num_seqs): vLLM's for offline use, 16,384 and 1,024
    on GPUs of 70 GiB or more other than the A100 (H100, H200), else 8,192 and 256."""
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        if props.total_memory >= 70 * (1 << 30) and "a100" not in props.name.lower():
            return 16384, 1024
    return 8192, 256


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    async_scheduling: bool | None = None       # None: on for CUDA, off on the CPU
    scheduling_policy: str = "fcfs"            # or "priority"
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False          # an FP8 cache's scales from the first step (vLLM's)
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    swap_space: float = 4
    # vLLM's: every layer keeps its whole context, even where some have a sliding window (Gemma
    # 2/3), instead of the sliding layers' KV in groups of their own that give blocks back
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's: no sliding window on any layer, the context capped to the (smallest) window instead,
    # within which attending to the window or the whole context is the same
    disable_sliding_window: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False       # MoE experts whole on the tensor-parallel ranks, not split
    distributed_executor_backend: str | None = None
    data_parallel_backend: str = "mp"          # or "ray": the replicas as Ray actors (LLM only, not the server)
    quantization: str | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    device: str = "auto"
    trust_remote_code: bool = False
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    max_logprobs: int = 20                     # vLLM's: the most logprobs a request may ask for (-1: no limit)
    # "qwen3" / "deepseek_r1": structured outputs hold the answer after the model's </think> (the
    # server's --reasoning-parser also returns the thinking apart)
    reasoning_parser: str | None = None
    disable_log_stats: bool = True
    runner: str = "auto"                       # "generate", or "pooling" for LLM.embed / classify / score (vLLM's)
    task: str | None = None                    # vLLM's older name for it: "generate", "embed", "classify", "score"
    pooler_config: PoolerConfig | dict | None = None   # over the model folder's (sentence-transformers) pooling
    override_pooler_config: PoolerConfig | dict | None = None   # (vLLM's older name)
    # config.json entries to set, or a function of the config (vLLM's; e.g. a causal LM read as a
    # classifier: architectures + classifier_from_token, see config.apply_hf_overrides)
    hf_overrides: dict | Callable | None = None
    # Where requests' default sampling fields come from (vLLM's): "auto" the model's
    # generation_config.json, "vllm" none (SamplingParams' own), or a folder holding one; then
    # override_generation_config's entries over them
    generation_config: str = "auto"
    enable_sleep_mode: bool = False            # vLLM's: LLM.sleep / wake_up (to free the GPU between uses)
    worker_extension_cls: str | None = None    # vLLM's: "module.Class" whose methods each rank's worker gets
    override_generation_config: dict | None = None
    # vLLM's: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n, ...}
    speculative_config: dict | SpeculativeConfig | None = None
    # vLLM's LoRA arguments: requests may then name an adapter (LoRARequest)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def _runner(self, architecture: str) -> str:
        """"generate" or "pooling"; "auto" picks pooling for a classifier (as vLLM does)."""
        tasks = {None: "auto", "auto": "auto", "generate": "generate",
                 "embed": "pooling", "encode": "pooling", "classify": "pooling", "score": "pooling"}
        if self.task not in tasks:
            raise ValueError(f"Unknown task {self.task!r}; choose one of generate, embed, classify, score.")
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"Unknown runner {self.runner!r}; choose 'generate' or 'pooling'.")
        runner = tasks[self.task] if self.runner == "auto" else self.runner
        if is_classifier(architecture):
            if runner == "generate":
                raise ValueError(f"{architecture} is a classifier: it does not generate. Use the pooling runner "
                                 "(runner='pooling', the default for it): LLM.classify / LLM.score.")
            return "pooling"
        return "generate" if runner == "auto" else runner

    def _sampling_defaults(self, path: str) -> dict:
        """The sampling fields requests take by default (ModelConfig.sampling_defaults)."""
        source = self.generation_config
        if source == "auto":
            found = read_generation_config(path)
        elif source == "vllm":
            found = {}
        elif os.path.isfile(os.path.join(source, "generation_config.json")):
            found = read_generation_config(source)
        else:
            raise ValueError(f"generation_config={source!r}: 'auto' (the model's), 'vllm' (no defaults), or a "
                             "folder with a generation_config.json; that folder has none.")
        defaults = sampling_defaults({**found, **(self.override_generation_config or {})})
        if defaults:
            logger.info("Requests' default sampling fields from the generation config: %s", defaults)
        return defaults

    def _pooler(self, path: str) -> PoolerConfig:
        """The model folder's pooling (a sentence-transformers one), else vLLM's default for a
        decoder: the last token's hidden state, normalized; then the user's overrides."""
        chosen = read_pooler_config(path)
        for given in (self.override_pooler_config, self.pooler_config):
            if isinstance(given, PoolerConfig):
                given = {"pooling_type": given.pooling_type, "normalize": given.normalize}
            unknown = set(given or {}) - {"pooling_type", "normalize"}
            if unknown:
                raise ValueError(f"Unknown pooler_config keys {sorted(unknown)}; known: pooling_type, normalize.")
            chosen.update({k: v for k, v in (given or {}).items() if v is not None})
        return PoolerConfig(**chosen)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def resolved_device(self) -> str:
        """"cuda" or "cpu" (``device="auto"``: CUDA where there is a GPU). Creates no CUDA context."""
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    def model_path(self) -> str:
        return resolve_model_path(self.model or default_model_path(), self.revision)

    def arch_config(self, path: str) -> ArchConfig:
        return read_arch_config(path, self.hf_overrides)

    def _classifier_token_ids(self, arch: ArchConfig, path: str) -> tuple[int, ...]:
        """The vocabulary ids of a converted classifier's classifier_from_token, else ()."""
        conversion = classifier_from_tokens(arch)
        if conversion is None:
            return ()
        from pagoda.engine.llm_engine import load_tokenizer    # (it imports this module)
        tokenizer = load_tokenizer(self, path)
        if tokenizer is None:
            raise ValueError("classifier_from_token names tokens: it needs the tokenizer (skip_tokenizer_init=False).")
        ids = [tokenizer.token_to_id(t) for t in conversion[0]]
        unknown = [t for t, i in zip(conversion[0], ids) if i is None]
        if unknown:
            raise ValueError(f"classifier_from_token: {unknown} are not tokens of the model's vocabulary.")
        if max(ids) >= arch.vocab_size:
            raise ValueError(f"classifier_from_token: token ids {ids} are past the LM head's {arch.vocab_size} rows.")
        return tuple(ids)

    def parallel_config(self, device: str, arch, ray_replicas: bool = False) -> ParallelConfig:
        """The parallel layout, checked against the model and the visible GPUs (no CUDA context).
        Only DPEngine (``ray_replicas``) can run the replicas as Ray actors: the server lays out
        its engine cores, processes of this node, from this without it."""
        parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                  self.data_parallel_size, self.distributed_executor_backend,
                                  self.data_parallel_backend, self.enable_expert_parallel)
        parallel.verify(arch, device)
        if parallel.data_parallel_size > 1 and parallel.data_parallel_backend == "ray" and not ray_replicas:
            raise ValueError(f"data_parallel_backend='ray' runs LLM(...)'s replicas as Ray actors; the server's "
                             f"data_parallel_size={parallel.data_parallel_size} replicas are engine core "
                             f"processes of this node: leave data_parallel_backend as 'mp' to serve.")
        return parallel

    def create_engine_config(self) -> EngineConfig:
        device = self.resolved_device()
        check_quantization_name(self.quantization)     # fail on a bad name before loading anything
        path = self.model_path()
        arch = self.arch_config(path)
        parallel = self.parallel_config(device, arch, ray_replicas=True)
        quantization, quant_config = resolve_quantization(self.quantization, read_quant_config(path, arch), path)
        dtype, compute_dtype = _resolve_dtype(self.dtype, arch.torch_dtype, device)
        if self.load_format not in _LOAD_FORMATS:
            raise ValueError(f"Unknown load_format {self.load_format!r}; choose one of {_LOAD_FORMATS}.")
        max_model_len = self.max_model_len or arch.max_context
        if max_model_len > arch.max_context:
            raise ValueError(f"max_model_len={max_model_len} is larger than the model's maximum "
                             f"context ({arch.max_context} tokens).")
        if self.disable_sliding_window:
            arch, max_model_len = _without_sliding_window(arch, max_model_len, self.max_model_len is not None)
        arch = _fix_longrope_factors(arch, max_model_len)
        if self.block_size not in (1, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 1, 8, 16, 32, 64, 128, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        check_kv_cache_dtype(self.kv_cache_dtype, device)
        if self.calculate_kv_scales and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            raise ValueError("calculate_kv_scales computes an FP8 KV cache's scales: it needs kv_cache_dtype='fp8' "
                             f"(or 'fp8_e4m3', 'fp8_e5m2'), not {self.kv_cache_dtype!r}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or at least 0, got {self.max_logprobs}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"Unknown scheduling_policy {self.scheduling_policy!r}; choose 'fcfs' or 'priority'.")
        check_reasoning_parser(self.reasoning_parser)
        default_batched, default_seqs = _batch_defaults(device)
        max_num_seqs = self.max_num_seqs or default_seqs
        max_batched = self.max_num_batched_tokens or default_batched
        if max_batched < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1.")
        chunked = True if self.enable_chunked_prefill is None else self.enable_chunked_prefill
        if not chunked and max_batched < max_model_len:
            raise ValueError(f"With chunked prefill off, max_num_batched_tokens ({max_batched}) must be "
                             f">= max_model_len ({max_model_len}) or long prompts could never run.")
        model = ModelConfig(
            model=self.model or path, path=path, arch=arch, dtype=dtype, compute_dtype=compute_dtype,
            seed=self.seed, load_format=self.load_format,
            quantization=quantization, quant_config=quant_config, tokenizer=self.tokenizer, revision=self.revision,
            generation_config=read_generation_config(path), runner=self._runner(arch.architecture),
            classifier_token_ids=self._classifier_token_ids(arch, path),
            sampling_defaults=self._sampling_defaults(path), reasoning_parser=self.reasoning_parser,
            max_logprobs=self.max_logprobs)
        if model.runner == "pooling":
            model.pooler = self._pooler(path)
        cache = CacheConfig(
            block_size=self.block_size, num_gpu_blocks_override=self.num_gpu_blocks_override,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization, cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
            enable_prefix_caching=True if self.enable_prefix_caching is None else self.enable_prefix_caching)
        speculative = self._speculative(model, parallel, max_model_len)
        cache.groups = self._kv_cache_groups(model.arch, speculative)
        lora = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None
        if lora is not None and model.arch.num_experts:
            raise ValueError(f"LoRA adapters on a mixture of experts ({model.arch.architecture}) are not supported yet.")
        sched = SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_num_seqs,
                                max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                # On the CPU the forward runs as it is called: nothing to overlap.
                                # Drafts follow the last token, which must be on the host.
                                async_scheduling=(device == "cuda" and speculative is None
                                                  if self.async_scheduling is None else self.async_scheduling),
                                policy=self.scheduling_policy,
                                max_concurrent_batches=parallel.pipeline_parallel_size)
        return EngineConfig(model, cache, sched, parallel, device=device, enforce_eager=self.enforce_eager,
                             log_stats=not self.disable_log_stats, enable_sleep_mode=self.enable_sleep_mode,
                             worker_extension_cls=self.worker_extension_cls, speculative=speculative, lora=lora)

    def _kv_cache_groups(self, arch: ArchConfig, spec: SpeculativeConfig | None) -> tuple[KVCacheGroup, ...]:
        """The target's KV cache groups. A draft model keeps its KV in the target's blocks, in one
        group with all the target's layers: its blocks are given back only where both models
        have the same window on every layer."""
        draft = spec and spec.draft_model_config
        if draft is None:
            return kv_cache_groups(arch, hybrid=not self.disable_hybrid_kv_cache_manager)
        groups = kv_cache_groups(arch, hybrid=False)
        if draft.arch.uniform_window != groups[0].window:
            groups = (KVCacheGroup(0, groups[0].layers),)
        return groups

    def _speculative(self, model: ModelConfig, parallel: ParallelConfig, max_model_len: int) -> SpeculativeConfig | None:
        """speculative_config, checked against what it runs with."""
        if not self.speculative_config:
            return None
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if model.runner == "pooling":
            raise ValueError("speculative_config speeds up generation: the pooling runner generates nothing.")
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative_config does not run with pipeline_parallel_size > 1 yet: use tensor "
                             "parallelism, or no drafts.")
        if self.async_scheduling:
            raise ValueError("speculative_config needs async_scheduling off: a step's drafts follow the tokens "
                             "of the step before, which must have reached the host.")
        if spec.uses_draft_model:
            spec.draft_model_config = self._draft_model_config(spec, model, parallel, max_model_len)
        return spec

    def _draft_model_config(self, spec: SpeculativeConfig, target: ModelConfig, parallel: ParallelConfig,
                            max_model_len: int) -> ModelConfig:
        """The draft model's config: its own checkpoint (and quantization), the target's dtype, and
        the target's tensor parallelism (its layers shard as the target's do)."""
        if spec.draft_tensor_parallel_size not in (None, parallel.tensor_parallel_size):
            raise ValueError(f"speculative_config: draft_tensor_parallel_size={spec.draft_tensor_parallel_size} "
                             f"but the draft model shards as the target does, over tensor_parallel_size="
                             f"{parallel.tensor_parallel_size}: leave it out.")
        check_quantization_name(spec.quantization)
        args = replace(self, model=spec.model, revision=None, hf_overrides=None)
        path = args.model_path()
        arch = args.arch_config(path)
        if is_classifier(arch.architecture):
            raise ValueError(f"The draft model {spec.model!r} is a classifier ({arch.architecture}): it must "
                             "generate.")
        if arch.vocab_size > target.arch.vocab_size:
            raise ValueError(f"The draft model {spec.model!r} has {arch.vocab_size} vocabulary entries, the target "
                             f"{target.arch.vocab_size}: the two must share a tokenizer (the draft's vocabulary "
                             "no larger than the target's).")
        if max_model_len > arch.max_context:
            raise ValueError(f"max_model_len={max_model_len} is longer than the draft model's context "
                             f"({arch.max_context} tokens): lower max_model_len or pick another draft model.")
        try:
            parallel.verify(arch, self.resolved_device())
        except ValueError as e:
            raise ValueError(f"The draft model {spec.model!r}: {e}") from None
        quantization, quant_config = resolve_quantization(spec.quantization, read_quant_config(path, arch), path)
        return ModelConfig(model=spec.model, path=path, arch=_fix_longrope_factors(arch, max_model_len),
                           dtype=target.dtype, compute_dtype=target.compute_dtype, seed=target.seed,
                           load_format=self.load_format, quantization=quantization, quant_config=quant_config)


def check_kv_cache_dtype(kv_cache_dtype: str, device: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"Unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}.")
    if device == "cuda" and kv_cache_dtype in ("fp8", "fp8_e4m3"):
        # (Triton converts to and from E4M3 only on GPUs with FP8 units)
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (E4M3) needs a GPU of compute capability 8.9 or "
                             f"above (Ada, Hopper); this one is {major}.{minor}. Use 'fp8_e5m2' or 'auto'.")


def cpu_has_native_bf16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _without_sliding_window(arch: ArchConfig, max_model_len: int, explicit: bool) -> tuple[ArchConfig, int]:
    """disable_sliding_window (vLLM's): no layer keeps a window, and the context is capped to the
    smallest one, so that every query still sees what it would through its window. A
    max_model_len asked for past it is an error."""
    windows = arch.windows - {0}
    if not windows:   # (vLLM ignores it too for a model without one)
        return arch, max_model_len
    cap = min(windows)
    if explicit and max_model_len > cap:
        raise ValueError(f"max_model_len={max_model_len} is longer than the sliding window ({cap} tokens) that "
                         "disable_sliding_window caps the context to: lower max_model_len, or keep the window.")
    return replace(arch, sliding_window=0), min(max_model_len, cap)


def _fix_longrope_factors(arch: ArchConfig, max_model_len: int) -> ArchConfig:
    """LongRoPE's factors for the engine's life, as vLLM picks them: the long ones where a
    sequence may run past the original context (max_model_len beyond it), else the short ones."""
    s = arch.rope_scaling or {}
    if s.get("rope_type") != "longrope":
        return arch
    long = max_model_len > s["original_max_position_embeddings"]
    if long:
        logger.info("LongRoPE: max_model_len %d is past the original context (%d): the long factors for every "
                    "sequence; set max_model_len=%d for the short ones.", max_model_len,
                    s["original_max_position_embeddings"], s["original_max_position_embeddings"])
    return replace(arch, rope_scaling=dict(s, use_long_rope=long))


def _resolve_dtype(dtype: str | torch.dtype, config_dtype: str | None, device: str):
    """(storage dtype, compute dtype). "auto" is the checkpoint's half type (bf16 when it has
    none) on GPUs, and float32 on CPUs that lack bf16 matrix units, where half math is slow."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16.")
    slow_half = device == "cpu" and not cpu_has_native_bf16()
    if dtype == "auto":
        if slow_half:
            return torch.float32, torch.float32
        chosen = _DTYPES.get(config_dtype or "", torch.bfloat16)
        return (torch.bfloat16, torch.bfloat16) if chosen == torch.float32 else (chosen, chosen)
    chosen = _DTYPES[dtype]
    if slow_half and chosen != torch.float32:
        logger.warning("This CPU has no bf16/fp16 matrix units: weights are rounded to %s but the "
                       "math runs in float32.", dtype)
        return chosen, torch.float32
    return chosen, chosen
