"""The model runner: turns a SchedulerOutput into one flat, unpadded batch, runs the model and
samples. Per-request state lives in preallocated rows (token ids, block table, sampling
parameters), so building a step's inputs is a handful of vectorized numpy gathers: the Python
work per step is O(requests), not O(tokens)."""
import functools
import gc
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import EngineConfig, class_labels, kv_cache_torch_dtype
from pagoda.core.sched_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagoda.distributed.parallel_state import (broadcast, broadcast_output, get_pp_group, get_tp_rank, get_tp_size,
                                               graphs_captured, recv_object, send_object)
from pagoda.model.layers.attention import (AttentionMetadata, TorchAttentionBackend, get_attention_backend,
                                           set_forward_context)
from pagoda.model.loader import get_model
from pagoda.model.pipeline import IntermediateTensors, empty_intermediate, hidden_shapes
from pagoda.pooling_params import PoolingParams
from pagoda.runner.cuda_graph import CUDAGraphRunner
from pagoda.runner.draft_model import DraftModel, DraftStep
from pagoda.runner.kv_cache import bind_kv_caches, kv_bytes_per_block
from pagoda.runner.sampler import SamplerOutput, SamplingMetadata, apply_grammar_bitmasks, logprobs_of, sample
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
GiB = 1 << 30
NO_LOGPROBS = -2
# The flat batch's arrays, as prepare_inputs builds them and the forward reads them.
INPUT_NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")
TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
                np.dtype(np.bool_): torch.bool}
CPU_DEFAULT_KV_CACHE_BYTES = 4 * GiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def keep_freed_memory() -> None:
    """Stop glibc from handing large blocks back to the OS. By default every tensor over a few
    MB is a fresh mmap, and page-faulting it in costs more than the copy that fills it (a
    padded KV gather ran 5x slower). vLLM's CPU backend preloads tcmalloc for the same reason."""
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def _needs_extras(p: SamplingParams) -> bool:
    """Whether a request's every sampling step takes the sampler's per-request extras (its
    min_tokens only until it has them)."""
    return p.needs_penalties or bool(p.logit_bias) or bool(p.allowed_token_ids) or bool(p.bad_words_token_ids)


@dataclass
class CachedRequestState:
    row: int
    num_tokens: int               # prompt + sampled so far (the last may still be on the device)
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    pooling: PoolingParams | None = None      # a pooling request: pooled at its prompt's end, never sampled
    pooled_sum: torch.Tensor | None = None    # MEAN / CLS pooling: what its chunks so far contribute
    pooled_rows: list | None = None           # token-level tasks: its chunks' hidden states so far
    # allowed_token_ids and each bad word's tokens but its last, on the device: copied once
    allowed_ids: torch.Tensor | None = None
    bad_word_prefixes: list | None = None
    lora_id: int = 0                          # its LoRA adapter's lora_int_id, 0 for none


def on_their_way(tensors: list, works: list = ()) -> tuple[list, Callable[[], object]]:
    """Tensors on their way to this host, and what to wait for: with ``works`` (their broadcasts
    from the rank that made them) the tensors as they will arrive; else non-blocking copies
    queued behind the step and an event after them. Once waited for, ``.cpu()`` of each is on
    the host (for the copies, without copying again)."""
    if works:
        return list(tensors), lambda: [w.wait() for w in works]
    host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    if not any(t is not None and t.is_cuda for t in tensors):
        return host, lambda: None
    copied = torch.cuda.Event()
    copied.record()
    return host, copied.synchronize


class AsyncRunnerOutput:
    """A step's results on their way to the host (``on_their_way``): the sampled tokens and
    pooled vectors are copied behind the step, or with pipeline parallelism broadcast from the
    last stage (``arrivals``: the works of the broadcasts), and get_output() waits for them
    alone, so the engine can queue the next step first (async scheduling) and process this one
    while the device runs that."""

    def __init__(self, runner: "ModelRunner", out: ModelRunnerOutput, req_ids: list[str] = (),
                 states: list[CachedRequestState] = (), result: SamplerOutput | None = None,
                 step_id: int = -1, rows: np.ndarray | None = None, arrivals: list = (), pooled=None,
                 drafts: list | None = None, draft_step: DraftStep | None = None):
        self.runner, self.out, self.req_ids, self.states = runner, out, list(req_ids), list(states)
        self.drafts = drafts       # speculative decoding: each sampling request's drafts (or None)
        self.draft_step = draft_step            # a draft model catches up on this step and proposes
        self.pooled = pooled       # (request ids, params, [vectors], their wait) on their way to rank 0
        self.positions = [s.num_tokens - 1 for s in self.states]     # where each sampled token goes
        self.step_id, self.rows = step_id, rows
        self.host = None
        if result is not None:
            fields = (result.token_ids, result.logprobs, result.ranks, result.topk_ids, result.topk_logprobs)
            self.host, self.wait_host = on_their_way(fields, arrivals)

    def get_output(self) -> ModelRunnerOutput:
        if self.pooled is not None:
            ids, params, counts, (vectors,), wait = self.pooled
            wait()
            if self.runner.rank == 0:
                self.runner._deliver_pooled(self.out, ids, params, vectors.cpu().split(counts))
            self.pooled = None
        if self.host is not None:
            self.wait_host()
            self.host = [None if t is None else t.cpu() for t in self.host]
            self.runner._record_sampled(self)
            self.host = None
            if self.draft_step is not None:
                self.out.draft_token_ids = self.runner.drafter.propose(self.runner, self.draft_step)
        return self.out


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        mc, sc = config.model, config.scheduler
        torch.manual_seed(mc.seed)
        self.rng = np.random.default_rng(mc.seed)
        # Sampling in one Triton kernel (runner/sampler.py) for the batches it covers.
        self.one_kernel_sampler = self.device.type == "cuda"
        # With tensor parallelism every rank runs the forward; one rank alone samples (on the
        # gathered full-vocabulary logits) and sends the tokens to the others: rank 0, or with
        # pipeline parallelism the last stage's first rank, which has the logits.
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        self.pp = get_pp_group()
        self.rank, self.driver = self.pp.global_rank, self.pp.last_stage_driver
        self.single_rank = self.tp_size == 1 and self.pp.world_size == 1
        # Pipeline parallelism keeps one batch in flight a stage (the engine's batch queue): a
        # stage sends its activations and goes on with the next batch, and the sampled tokens
        # come back later (``_sample_on_driver``). Its sends, kept until surely done.
        self.batches_in_flight = self.pp.world_size
        self.stage_sends: deque[list] = deque()
        self.model = get_model(mc, self.device)
        spec = config.speculative
        self.drafter = DraftModel(config, self.device) if spec and spec.uses_draft_model else None
        # LoRA: every adapted layer's slots, before any forward (the profiling run, the graphs)
        self.lora = None
        if config.lora is not None:
            from pagoda.lora.manager import LoRAManager
            from pagoda.runner.cuda_graph import max_graph_tokens
            self.lora = LoRAManager(self.model, config.lora, max(sc.max_num_batched_tokens, max_graph_tokens()),
                                    mc.compute_dtype, self.device)
        self.arch = mc.arch
        self.block_size = config.cache.block_size
        self.dtype = mc.compute_dtype
        self.kv_cache_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, mc.compute_dtype)
        self.backend = get_attention_backend(self.device)
        self.max_num_reqs = sc.max_num_seqs
        self.max_model_len = sc.max_model_len
        max_blocks = cdiv(sc.max_model_len, self.block_size)
        # +1: a request that reaches max_model_len still appends its last sampled token.
        self.token_ids = np.zeros((self.max_num_reqs, sc.max_model_len + 1), dtype=np.int32)
        self.kv_cache_groups = config.cache.groups
        # A block table a KV cache group (runner/kv_cache.py), all as long as the row's tokens need.
        self.block_table = np.zeros((len(self.kv_cache_groups), self.max_num_reqs, max_blocks), dtype=np.int32)
        self.num_row_blocks = np.zeros(self.max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(self.max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(self.max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(self.max_num_reqs, dtype=np.int64)
        self.min_p = np.zeros(self.max_num_reqs, dtype=np.float32)
        # Rows whose sampling needs the rare per-request extras (penalties, logit bias,
        # min_tokens); rows with a seed; each row's logprobs count (-1: the whole vocabulary,
        # NO_LOGPROBS: none asked).
        self.special = np.zeros(self.max_num_reqs, dtype=bool)
        self.seeded = np.zeros(self.max_num_reqs, dtype=bool)
        self.num_logprobs = np.full(self.max_num_reqs, NO_LOGPROBS, dtype=np.int64)
        # Async scheduling: a row whose last token is still on the device only has its index in
        # the sampled tokens of step pending_step (always the last step that sampled, whose
        # tokens are last_sampled); -1 when the host knows it.
        self.pending_idx = np.full(self.max_num_reqs, -1, dtype=np.int64)
        self.pending_step = np.full(self.max_num_reqs, -1, dtype=np.int64)
        self.last_sampled: torch.Tensor | None = None
        self.num_sampling_steps = 0
        self.num_prompt_logprob_reqs = 0
        self.num_pooling_reqs = 0
        self.pooler = config.model.pooler
        # calculate_kv_scales: the first step sets each layer's FP8 scales, eagerly; the CUDA
        # graphs, which hold the scales as constants, are captured after it.
        self.kv_scales_pending = config.cache.calculate_kv_scales
        # A classifier's pooled state goes through its head: the classes' logits, not the state.
        self.classifies = config.model.pooling_task == "classify"
        self.pooled_width = len(class_labels(self.arch)) if self.classifies else self.arch.hidden_size
        self.free_rows = list(range(self.max_num_reqs - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.cuda_graphs: CUDAGraphRunner | None = None
        self.asleep: list | None = None     # sleep mode: (weight, its host copy or None, its shape)

    # ------------------------------------------------------------------ KV cache
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block over this rank's layers (its pipeline stage's only; a draft
        model's layers too: they keep their KV in the same blocks)."""
        return sum(kv_bytes_per_block(m, groups, self.block_size, self.kv_cache_dtype)
                   for m, groups in self._models_and_groups())

    def _models(self) -> list[nn.Module]:
        """The target model, and the draft model if there is one."""
        return [m for m, _ in self._models_and_groups()]

    def _models_and_groups(self) -> list[tuple[nn.Module, tuple]]:
        """Each model with its layers' KV cache groups."""
        models = [(self.model, self.kv_cache_groups)]
        if self.drafter is not None:
            models.append((self.drafter.model, self.drafter.kv_cache_groups))
        return models

    def determine_num_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_free_gpu_memory()
        else:
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        # Never more than every sequence at full length could use (+1: the null block).
        need = self.max_num_reqs * cdiv(self.max_model_len, self.block_size) * len(self.kv_cache_groups) + 1
        return min(budget // self.kv_bytes_per_block(), need)

    @torch.inference_mode()
    def _profile_free_gpu_memory(self) -> int:
        """Run the largest step the scheduler can produce (without attention) and return what
        gpu_memory_utilization leaves for the KV cache after the weights and that peak."""
        sc = self.config.scheduler
        n = sc.max_num_batched_tokens
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.max_model_len
        fits = True
        try:
            with set_forward_context(None, self.backend):
                hidden = self.model(ids, pos, self._stand_in_activations(n))
                if self.drafter is not None:
                    self.drafter.model(ids, pos)
            logits = self.model.compute_logits(hidden[:self.max_num_reqs]) if self.pp.is_last_rank else None
            if logits is not None:                       # (the rank that samples)
                logits.float().log_softmax(-1).sort(-1)  # the sampler's biggest temporaries
            del logits, hidden
        except torch.OutOfMemoryError:
            fits = False   # (raised below: the exception's frames hold the step's tensors)
        if not fits:
            torch.cuda.empty_cache()
            raise ValueError(
                f"A {n}-token step (max_num_batched_tokens) does not fit on the GPU beside the weights "
                f"({weights / GiB:.1f} GiB of {torch.cuda.mem_get_info()[1] / GiB:.1f} GiB). Lower "
                "max_num_batched_tokens and max_num_seqs, or use a smaller or quantized model.")
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_allocated()
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - used_by_others
        if budget <= 0:
            raise ValueError(
                f"No GPU memory left for the KV cache: the weights and a {n}-token step peak at "
                f"{peak / GiB:.1f} GiB of {total / GiB:.1f} GiB (gpu_memory_utilization="
                f"{self.config.cache.gpu_memory_utilization}). Raise gpu_memory_utilization, lower "
                "max_num_batched_tokens / max_num_seqs, or use a smaller or quantized model.")
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.block_used = np.zeros(num_blocks, dtype=bool)
        # The torch reference reads a row's table past its blocks (padding): no entry may name a
        # block of an earlier cache (sleep mode), which this one has not zeroed.
        self.block_table.fill(0)
        # (blocks are zeroed as they are handed out where the backend needs it: _zero_new_blocks)
        self.kv_caches = [cache for m, groups in self._models_and_groups()
                          for cache in bind_kv_caches(m, groups, num_blocks, self.block_size, self.kv_cache_dtype,
                                                      self.device)]
        if not self.kv_scales_pending:       # (else once the first step has set the scales)
            self._capture_graphs()
        if self.device.type == "cuda":
            self._compile_kernels()

    # ------------------------------------------------------------------ sleep mode
    def sleep(self, level: int) -> None:
        """vLLM's sleep mode (an idle engine): the KV cache and the CUDA graphs freed, the weights
        moved to the host (level 1) or dropped (level 2: the caller loads new ones after waking
        them), the buffers (the rotary table) moved to the host. A draft model's weights move to
        the host at either level: the caller loads the target's only."""
        for graphs in (self.cuda_graphs, self.drafter and self.drafter.graphs):
            if graphs is not None:
                graphs.release()
        self.cuda_graphs = None
        if self.drafter is not None:
            self.drafter.graphs = None
        for model in self._models():
            for layer in model.model.local_layers:
                layer.self_attn.attn.kv_cache = torch.tensor([])
        self.kv_caches = []
        weights = list(self.model.parameters())
        kept = list(self.model.buffers()) + [t for m in self._models()[1:] for t in (*m.parameters(), *m.buffers())]
        if level == 1:
            kept, weights = weights + kept, []
        self.asleep = [(t, None, t.shape) for t in weights] + [(t, t.data.to("cpu"), t.shape) for t in kept]
        for t, _, _ in self.asleep:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)     # (its memory freed)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: list[str]) -> None:
        """Back from sleep: the weights (``"weights"``: level 1's from the host, level 2's
        allocated, their values the caller's to load), then the KV cache and the graphs
        (``"kv_cache"``, which needs the weights: the graphs are captured again)."""
        if "weights" in tags and self.asleep is not None:
            for t, host, shape in self.asleep:
                t.data = host.to(self.device) if host is not None else torch.empty(shape, dtype=t.dtype,
                                                                                   device=self.device)
            self.asleep = None
        if "kv_cache" in tags and not self.kv_caches:
            if self.asleep is not None:
                raise RuntimeError("The KV cache wakes after the weights (wake_up(['weights']) first): its "
                                   "CUDA graphs are captured over them.")
            self.initialize_kv_cache(len(self.block_used))

    def _capture_graphs(self) -> None:
        """The decode and mixed-step CUDA graphs (on CUDA, unless enforce_eager)."""
        # (Not with pipeline parallelism yet: a graph would hold one stage's layers without the
        # sends and receives around them.)
        if self.device.type == "cuda" and not self.config.enforce_eager and self.pp.world_size == 1:
            t0 = time.perf_counter()
            self.cuda_graphs = self._graphs_of(self.model)
            if self.drafter is not None:       # (the draft's own, for its steps and proposals)
                self.drafter.graphs = self._graphs_of(self.drafter.model)
            g = self.cuda_graphs
            logger.info("Captured CUDA graphs for %d decode batch sizes, %d mixed-step sizes and %d verification "
                        "sizes%s in %.1f s.", len(g.sizes), len(g.mixed_sizes), len(g.spec_sizes),
                        " (and the draft model's)" if self.drafter else "", time.perf_counter() - t0)

    def _graphs_of(self, model: nn.Module) -> CUDAGraphRunner:
        spec = self.config.speculative
        graphs = CUDAGraphRunner(model, self.backend, self.max_num_reqs, self.config.scheduler.max_num_batched_tokens,
                                 self.block_table.shape[2], self.max_model_len, self.device,
                                 spec.num_speculative_tokens if spec else 0, len(self.kv_cache_groups))
        graphs.capture()
        if not self.single_rank:
            graphs_captured(graphs)
        return graphs

    def _compile_kernels(self) -> None:
        """Compile now, not inside the first requests' steps (a second or more each), what the
        profiling run and the decode graphs did not: the one-kernel sampler, and the attention
        kernel's prefill tiles, each through a mixed step (one decode, one prompt) that writes
        no KV and reads only the null block."""
        from pagoda.kernels import triton_attention
        from pagoda.kernels.triton_sampling import sample_triton
        one = torch.ones(1, device=self.device)
        logits = torch.zeros(1, self.arch.vocab_size, dtype=self.dtype, device=self.device)
        sample_triton(logits, one, one.long())
        sample_triton(logits, one, one.long(), one.long(), one * 0.9, one * 0)     # with filters
        for model in self._models():
            attn = model.model.local_layers[0].self_attn.attn
            group = attn.num_heads // attn.num_kv_heads
            for q_len in sorted({max(2, block_m // group) for block_m in triton_attention.TILES}):
                n = 1 + q_len
                int32 = dict(dtype=torch.int32, device=self.device)
                md = AttentionMetadata(
                    n, 1, torch.full((n,), -1, dtype=torch.long, device=self.device),
                    torch.tensor([0, 1, n], **int32), torch.tensor([1, q_len], **int32),
                    torch.zeros(2, cdiv(q_len, self.block_size), **int32), q_len, q_len, 1)
                positions = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(q_len)]).to(self.device)
                with set_forward_context(md, self.backend):
                    model(torch.zeros(n, dtype=torch.long, device=self.device), positions,
                          self._stand_in_activations(n) if model is self.model else None)

    def _stand_in_activations(self, num_tokens: int) -> IntermediateTensors | None:
        """For a pipeline stage's profiling and warm-up runs: zeros for the previous stage's
        activations (None on the first stage)."""
        if self.pp.is_first_rank:
            return None
        return empty_intermediate(num_tokens, self.arch.hidden_size, self.dtype, self.device)

    # ------------------------------------------------------------------ request state
    def _add_request(self, r: NewRequestData) -> None:
        row = self.free_rows.pop()
        n = len(r.token_ids)
        self.token_ids[row, :n] = r.token_ids
        for g, ids in enumerate(r.block_ids):
            self.block_table[g, row, :len(ids)] = ids
        self.num_row_blocks[row] = len(r.block_ids[0])
        p = r.sampling_params
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_p[row], self.top_k[row], self.min_p[row] = p.top_p, p.top_k, p.min_p
        self.special[row] = _needs_extras(p) or p.min_tokens > 0
        self.num_logprobs[row] = NO_LOGPROBS if p.logprobs is None else p.logprobs
        self.seeded[row] = p.seed is not None
        self.pending_idx[row] = self.pending_step[row] = -1
        self.num_prompt_logprob_reqs += p.prompt_logprobs is not None
        gen = None
        if p.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(p.seed)
        self.requests[r.req_id] = CachedRequestState(row, n, r.num_prompt_tokens, p, gen, r.pooling_params)
        if r.lora_request is not None:
            self.lora.add(r.lora_request)
            self.requests[r.req_id].lora_id = r.lora_request.lora_int_id
        self.num_pooling_reqs += r.pooling_params is not None

    def _append_blocks(self, req_id: str, block_ids: tuple[list[int], ...]) -> None:
        row = self.requests[req_id].row
        start = self.num_row_blocks[row]
        for g, ids in enumerate(block_ids):
            self.block_table[g, row, start:start + len(ids)] = ids
        self.num_row_blocks[row] = start + len(block_ids[0])

    def _remove_request(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.num_row_blocks[state.row] = 0
            self.pending_idx[state.row] = self.pending_step[state.row] = -1
            self.num_prompt_logprob_reqs -= state.params.prompt_logprobs is not None
            self.num_pooling_reqs -= state.pooling is not None
            self.free_rows.append(state.row)

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> AsyncRunnerOutput:
        """Queue one step on the device. Nothing here waits for the device (unless prompt
        logprobs are asked for): the sampled tokens stay there for the next step's inputs, and
        reach the host through the returned output's get_output()."""
        for req_id in sched.finished_req_ids:
            self._remove_request(req_id)
        num_computed: dict[str, int] = {}
        new_blocks: list[int] = []
        for r in sched.new_reqs:
            self._add_request(r)
            num_computed[r.req_id] = r.num_computed_tokens
            new_blocks += [b for ids in r.block_ids for b in ids]
        for r in sched.cached_reqs:
            if r.new_block_ids:
                self._append_blocks(r.req_id, r.new_block_ids)
                new_blocks += [b for ids in r.new_block_ids for b in ids]
            num_computed[r.req_id] = r.num_computed_tokens
        self._zero_new_blocks(new_blocks)
        if sched.block_copies:
            src, dst = self._to_device(np.array(sched.block_copies, dtype=np.int64).T.copy())
            self.backend.copy_blocks(self.kv_caches, src, dst)
        if sched.is_empty:
            return AsyncRunnerOutput(self, ModelRunnerOutput({}))

        # Decodes first: the backends treat them as one group. Longest contexts first: the
        # attention kernel's programs start in batch order, so the long ones do not end the step.
        req_ids = list(sched.num_scheduled_tokens)
        q_lens = np.array([sched.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        computed = np.array([num_computed[r] for r in req_ids], dtype=np.int64)
        order = np.lexsort((-(computed + q_lens), q_lens != 1))
        req_ids = [req_ids[i] for i in order]
        q_lens, computed = q_lens[order], computed[order]
        states = [self.requests[r] for r in req_ids]
        rows = np.array([s.row for s in states], dtype=np.int64)
        known = np.array([s.num_tokens for s in states], dtype=np.int64)
        num_drafts = self._write_drafts(sched.spec_token_ids, req_ids, states)
        cu = np.cumsum(q_lens)
        batch = self.prepare_inputs(rows, q_lens, computed)
        arrays = {k: batch[k] for k in INPUT_NAMES}
        if self.lora is not None:     # each token's adapter slot (-1: none)
            arrays["lora_slots"] = np.repeat(self.lora.slots_for([s.lora_id for s in states]), q_lens)
        pending = self._pending_input_ids(rows, computed, cu - q_lens, known)
        if pending is not None:
            arrays["pending_dst"], arrays["pending_src"] = pending
        # Reached their last token (or their last draft): they sample.
        sampling = np.nonzero(computed + q_lens == known + num_drafts)[0]
        if self.num_pooling_reqs:        # (pooling requests reach it too, and are pooled instead)
            sampling = sampling[[states[i].pooling is None for i in sampling]]
        s_states, s_rows = [states[i] for i in sampling], rows[sampling]
        # The logit rows: one a request (its last token), or with drafts one a draft and one after
        # them; ``offsets``: each row's place after its request's last known token.
        logit_reqs, offsets, last_rows = sampling, np.zeros(len(sampling), dtype=np.int64), np.arange(len(sampling))
        l_states, l_rows = s_states, s_rows
        if sched.spec_token_ids:
            per_req = num_drafts[sampling] + 1
            last_rows = np.cumsum(per_req) - 1
            logit_reqs = np.repeat(sampling, per_req)
            offsets = np.arange(len(logit_reqs)) - np.repeat(last_rows + 1 - per_req, per_req)
            l_states, l_rows = [states[i] for i in logit_reqs], rows[logit_reqs]
        if len(sampling):
            arrays["logits_idx"] = cu[logit_reqs] - 1 - num_drafts[logit_reqs] + offsets
            arrays.update(self._sampling_arrays(l_states, l_rows, offsets))
        t = self._upload(arrays)
        calibrating = self.kv_scales_pending
        if calibrating:
            for layer in self.model.model.local_layers:
                layer.self_attn.attn.calibrate_next = True
        if self.lora is not None:
            self.lora.set_token_slots(t["lora_slots"])
        hidden = self._forward(batch, t)
        if self.drafter is not None and not len(sampling):     # (else once the sampled tokens are known)
            self.drafter.run_step(self, batch, t)
        if calibrating:
            self.kv_scales_pending = False
            self._capture_graphs()

        out = ModelRunnerOutput({})
        self._prompt_logprobs(hidden, req_ids, states, rows, computed, q_lens, cu, out)
        pooled = self._pool(hidden, req_ids, states, computed, q_lens, cu, known) if self.num_pooling_reqs else None
        if len(sampling) == 0:
            return AsyncRunnerOutput(self, out, pooled=pooled)
        logits = None if hidden is None else self.model.compute_logits(hidden[t["logits_idx"]])
        if sched.grammar_bitmasks and logits is not None:
            apply_grammar_bitmasks(logits, [req_ids[i] for i in logit_reqs], sched.grammar_bitmasks)
        arrivals = []
        if self.single_rank:
            result = sample(logits, self._sampling_metadata(l_states, l_rows, t))
        else:
            result, arrivals = self._sample_on_driver(logits, l_states, l_rows, t)
        for s in s_states:
            s.num_tokens += 1
        self.num_sampling_steps += 1
        self.pending_idx[s_rows] = last_rows     # (a step with drafts is taken in before the next)
        self.pending_step[s_rows] = self.num_sampling_steps
        self.last_sampled = result.token_ids
        drafts = [sched.spec_token_ids.get(req_ids[i], ()) for i in sampling] if sched.spec_token_ids else None
        draft_step = None
        if self.drafter is not None:
            sampled = np.zeros(len(req_ids), dtype=bool)
            sampled[sampling] = True
            draft_step = DraftStep(req_ids, states, computed.tolist(), q_lens.tolist(), sampled.tolist(),
                                   sched.draft_req_ids)
        return AsyncRunnerOutput(self, out, [req_ids[i] for i in sampling], s_states, result,
                                 self.num_sampling_steps, s_rows, arrivals, pooled, drafts, draft_step)

    def _write_drafts(self, spec_token_ids: dict[str, list[int]], req_ids: list[str],
                      states: list[CachedRequestState]) -> np.ndarray:
        """Speculative decoding: each request's drafts into its row after its known tokens (the
        step's inputs; those kept stay, the others are written over later). Returns the number
        of drafts of each request of the batch."""
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        if not spec_token_ids:
            return num_drafts
        for i, req_id in enumerate(req_ids):
            drafts = spec_token_ids.get(req_id)
            if drafts:
                s = states[i]
                self.token_ids[s.row, s.num_tokens:s.num_tokens + len(drafts)] = drafts
                num_drafts[i] = len(drafts)
        return num_drafts

    def _pool(self, hidden, req_ids, states, computed, q_lens, cu, known):
        """The pooling requests' outputs, from the final hidden states of their tokens in this
        step, on the rank that samples: the last token's once the prompt is computed, or the mean
        (the first token's) gathered over its chunks; for a token-level task (``token_embed``,
        ``token_classify``) every token's, gathered over its chunks. They reach rank 0's host as
        the sampled tokens do, without waiting (a copy behind the step; with pipeline
        parallelism a broadcast from the last stage), as one tensor of their rows (one a request,
        or one a prompt token): (request ids, params, row counts, [rows], what to wait for) is
        returned for get_output, which hands them out."""
        done: list[int] = []
        rows: list[torch.Tensor] = []
        for i, s in enumerate(states):
            if s.pooling is None:
                continue
            ends = computed[i] + q_lens[i] == known[i]
            if ends:
                done.append(i)
            if self.rank != self.driver:        # (the final hidden states' rank pools)
                continue
            kind = "ALL" if s.pooling.is_token_task else self.pooler.pooling_type
            start, end = int(cu[i] - q_lens[i]), int(cu[i])
            if kind == "MEAN":
                part = hidden[start:end].float().sum(0)
                s.pooled_sum = part if s.pooled_sum is None else s.pooled_sum + part
            elif kind == "CLS" and computed[i] == 0:      # (copies: a graph's output is overwritten)
                s.pooled_sum = hidden[start].float().clone()
            elif kind == "ALL":
                s.pooled_rows = (s.pooled_rows or []) + [hidden[start:end].to(torch.float32, copy=True)]
            if not ends:
                continue
            if kind == "LAST":
                rows.append(hidden[end - 1:end].float())
            elif kind == "ALL":
                rows.append(torch.cat(s.pooled_rows))
            else:
                rows.append((s.pooled_sum / int(known[i]) if kind == "MEAN" else s.pooled_sum)[None])
        if not done:
            return None
        ids, params = [req_ids[i] for i in done], [states[i].pooling for i in done]
        counts = [int(known[i]) if states[i].pooling.is_token_task else 1 for i in done]
        if self.pp.world_size == 1 and self.rank != 0:
            return None
        if self.rank == self.driver:
            stacked = torch.cat(rows)
            if self.classifies:
                stacked = self.model.compute_logits(stacked)
        else:
            stacked = torch.empty(sum(counts), self.pooled_width, dtype=torch.float32, device=self.device)
        # To the host behind the step, as the sampled tokens go: the engine queues the next step
        # meanwhile (async scheduling)
        works = [broadcast_output(stacked, src=self.driver)] if self.pp.world_size > 1 else []
        return ids, params, counts, *on_their_way([stacked], works)

    def _deliver_pooled(self, out: ModelRunnerOutput, ids: list[str], params: list, outputs: list) -> None:
        """Each request's output (its rows) into ``out``, after its activation, row by row: an
        embedding cut to its ``dimensions`` and L2-normalized; a classifier's logits as
        probabilities (softmax, or the sigmoid of a single label's: a cross-encoder's score). One
        row a request is returned as a vector."""
        for req_id, p, vec in zip(ids, params, outputs):
            if self.classifies:
                if p.use_activation is not False:
                    vec = vec.sigmoid() if vec.shape[-1] == 1 else vec.softmax(-1)
            else:
                vec = vec[:, :p.dimensions]
                normalize = next(x for x in (p.use_activation, p.normalize, self.pooler.normalize) if x is not None)
                if normalize:
                    vec = F.normalize(vec, dim=-1)
            out.pooler_output[req_id] = vec if p.is_token_task else vec[0]

    def _sample_on_driver(self, logits, states, rows, t) -> tuple[SamplerOutput, list]:
        """The driver's sampled tokens on every rank, which need them as the next step's input
        ids (and record them as the driver does). With tensor parallelism alone the driver is
        rank 0, and the broadcast is waited on here. With pipeline parallelism the last stage's
        driver also sends the logprobs (rank 0, the engine's, wants them), over the output
        group and without waiting: the works are returned for get_output, so the first stage
        runs the next batch meanwhile. Every rank knows the fields' shapes: the batch's sampling
        rows and their logprobs counts."""
        n, pipelined = len(states), self.pp.world_size > 1
        ks = self.num_logprobs[rows]
        if self.rank == self.driver:
            result = sample(logits, self._sampling_metadata(states, rows, t))
            result.token_ids = result.token_ids.to(torch.int64)
            if pipelined and result.logprobs is not None:
                result.logprobs, result.topk_logprobs = result.logprobs.float(), result.topk_logprobs.float()
                result.ranks, result.topk_ids = result.ranks.long(), result.topk_ids.long()
        else:
            empty = functools.partial(torch.empty, device=self.device)
            result = SamplerOutput(empty(n, dtype=torch.int64), None, None, None, None)
            if pipelined and (ks != NO_LOGPROBS).any():
                k = self.arch.vocab_size if (ks == -1).any() else int(ks.max())
                result.logprobs, result.ranks = empty(n, dtype=torch.float32), empty(n, dtype=torch.int64)
                result.topk_ids, result.topk_logprobs = empty(n, k, dtype=torch.int64), empty(n, k, dtype=torch.float32)
        if not pipelined:
            broadcast(result.token_ids, src=self.driver)
            return result, []
        fields = (result.token_ids, result.logprobs, result.ranks, result.topk_ids, result.topk_logprobs)
        return result, [broadcast_output(x, src=self.driver) for x in fields if x is not None and x.numel()]

    def _record_sampled(self, step: AsyncRunnerOutput) -> None:
        """A step's sampled tokens have reached the host: write them into the rows and fill in
        its ModelRunnerOutput."""
        tokens, token_lp, ranks, topk_ids, topk_lp = (None if t is None else t.tolist() for t in step.host)
        out = step.out
        rows = step.rows
        self.pending_idx[rows[self.pending_step[rows] == step.step_id]] = -1
        logprobs = token_lp is not None
        # Each request's logit rows of this step's tokens: one, or with drafts those kept and one more.
        firsts, counts = range(len(step.req_ids)), [1] * len(step.req_ids)
        if step.drafts is not None:
            firsts, counts = self._accept_drafts(step, tokens)
        for j, (req_id, s) in enumerate(zip(step.req_ids, step.states)):
            last = firsts[j] + counts[j] - 1
            out.sampled_token_ids[req_id] = tokens[last]
            # A request preempted or aborted since has left (its row may serve another now).
            if self.requests.get(req_id) is s:
                self.token_ids[s.row, step.positions[j]] = tokens[last]
            k = s.params.logprobs
            if logprobs and k is not None:
                out.logprobs[req_id] = [([tokens[r]] + topk_ids[r][:k], [token_lp[r]] + topk_lp[r][:k], ranks[r])
                                        for r in range(firsts[j], last + 1)]

    def _accept_drafts(self, step: AsyncRunnerOutput, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Speculative decoding's check, for drafts that are single tokens (n-gram lookup):
        each position sampled as without drafts, then the drafts kept while they equal what was
        sampled, and the sample after them kept too. A draft is thus kept with the probability
        the model gives it, and when it is not, the token sampled in its place is distributed as
        the model's distribution without it: the output is distributed as without drafts (and
        greedy output is the same). Returns each request's first logit row and its number of
        tokens this step (the drafts kept, and the token sampled after them); the kept drafts go
        into its row and ``num_accepted_drafts``."""
        firsts, counts, i = [], [], 0
        for j, (req_id, s, drafts) in enumerate(zip(step.req_ids, step.states, step.drafts)):
            sampled = tokens[i:i + len(drafts) + 1]
            kept = 0
            while kept < len(drafts) and sampled[kept] == drafts[kept]:
                kept += 1
            firsts.append(i)
            counts.append(kept + 1)
            i += len(drafts) + 1
            if not kept:
                continue
            step.out.num_accepted_drafts[req_id] = kept
            step.positions[j] += kept
            if self.requests.get(req_id) is s:
                self.token_ids[s.row, step.positions[j] - kept:step.positions[j]] = drafts[:kept]
                s.num_tokens += kept
        return firsts, counts

    def _pending_input_ids(self, rows, computed, starts, known) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions in the flat batch, indices in last_sampled) of the inputs that the last
        step sampled and that are still on the device only (async scheduling): the device fills
        them in."""
        idx = self.pending_idx[rows]
        mask = idx >= 0
        if not mask.any():
            return None
        assert (self.pending_step[rows[mask]] == self.num_sampling_steps).all(), \
            "only the last step's tokens can be pending"
        return (starts + known - 1 - computed)[mask], idx[mask]

    def _upload(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """A step's host arrays on the device, through one pinned buffer and one copy: each
        separate copy cost ~50 us of host time (pinning, launch), a dozen of them per step.
        A copy from pageable memory could make the host wait for the stream, which would stall
        async scheduling; the caching host allocator keeps the pinned block until the copy
        has run."""
        if self.device.type == "cpu":
            return {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        offsets, size = {}, 0
        for k, a in arrays.items():
            offsets[k] = size
            # 16-byte aligned: Triton compiles a kernel once per alignment pattern of its
            # pointer arguments, so views at varying alignments cost a compile each (~1 s)
            size += -(-a.nbytes // 16) * 16
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        buf = host.numpy()
        for k, a in arrays.items():
            buf[offsets[k]:offsets[k] + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        dev = host.to(self.device, non_blocking=True)
        return {k: dev[offsets[k]:offsets[k] + a.nbytes].view(TORCH_DTYPES[a.dtype]).view(a.shape)
                for k, a in arrays.items()}

    def upload_batch(self, b: dict, **extra: np.ndarray) -> dict[str, torch.Tensor]:
        """The flat batch's arrays (prepare_inputs) on the device, with ``extra`` arrays in the same copy."""
        return self._upload({**{k: b[k] for k in INPUT_NAMES}, **extra})

    def _to_device(self, x: np.ndarray) -> torch.Tensor:
        """One array on the device (the rare paths: block copies, penalties, prompt logprobs)."""
        return self._upload({"x": x})["x"]

    def _zero_new_blocks(self, block_ids: list[int]) -> None:
        """The torch reference reads whole padded blocks (masking what lies past a request's
        length), so a block's stale contents must at least be finite. The cache is allocated
        uninitialised, so each block is zeroed the first time it is handed out; after that it
        only ever holds K/V. The Triton kernels mask their loads instead and skip this."""
        if not block_ids or self.backend is not TorchAttentionBackend:
            return
        ids = np.unique(np.asarray(block_ids))
        ids = ids[~self.block_used[ids]]
        if len(ids):
            self.block_used[ids] = True
            t = torch.from_numpy(ids).to(self.device)
            for cache in self.kv_caches:
                # (the CPU has no index_fill_ for float8: zero bytes)
                (cache.view(torch.uint8) if cache.element_size() == 1 else cache).index_fill_(1, t, 0)

    def prepare_inputs(self, rows, q_lens, computed) -> dict:
        """The flat batch as numpy arrays: O(requests) Python, the rest vectorized."""
        bs = self.block_size
        total = int(q_lens.sum())
        cu = np.cumsum(q_lens)
        req_idx = np.repeat(np.arange(len(rows)), q_lens)
        positions = computed[req_idx] + (np.arange(total) - (cu - q_lens)[req_idx])
        tok_rows = rows[req_idx]
        seq_lens = (computed + q_lens).astype(np.int32)
        max_seq_len = int(seq_lens.max())
        num_decodes = int((q_lens == 1).sum())
        return {
            "input_ids": self.token_ids[tok_rows, positions].astype(np.int64),
            "positions": positions,
            # (a row a KV cache group)
            "slot_mapping": self.block_table[:, tok_rows, positions // bs].astype(np.int64) * bs + positions % bs,
            "query_start_loc": np.concatenate([[0], cu]).astype(np.int32),
            "seq_lens": seq_lens,
            "block_tables": np.ascontiguousarray(self.block_table[:, rows, :cdiv(max_seq_len, bs)]),
            "num_decodes": num_decodes,
            "max_query_len": int(q_lens.max()),
            "max_seq_len": max_seq_len,
            "max_decode_seq_len": int(seq_lens[:num_decodes].max()) if num_decodes else 0,
        }

    def _forward(self, b: dict, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """The model over the flat batch: ``b`` as prepared on the host, ``t`` its arrays on the
        device. Input ids that only the device knows yet (``pending_dst``) are filled in from
        the last step's sampled tokens."""
        num_tokens = len(b["input_ids"])
        pending = None
        if "pending_dst" in t:
            pending = t["pending_dst"], self.last_sampled[t["pending_src"]]
        if self.pp.world_size == 1:
            return self.run(self.model, self.cuda_graphs, b, t, pending)
        if pending is not None:
            t["input_ids"][pending[0]] = pending[1]
        with set_forward_context(self._metadata(b, t), self.backend):
            return self._forward_stage(t, num_tokens)

    def run(self, model: nn.Module, graphs: CUDAGraphRunner | None, b: dict, t: dict[str, torch.Tensor],
            pending: tuple | None = None) -> torch.Tensor:
        """``model`` (the target, or the draft) over the flat batch: a captured graph of its
        (``graphs``) where one fits, else eagerly."""
        key = graphs and graphs.graph_key(len(b["seq_lens"]), len(b["input_ids"]), b["max_query_len"])
        if key:
            return graphs.run(key, t, pending)
        if pending is not None:
            t["input_ids"][pending[0]] = pending[1]
        with set_forward_context(self._metadata(b, t), self.backend):
            return model(t["input_ids"], t["positions"])

    def _metadata(self, b: dict, t: dict[str, torch.Tensor]) -> list[AttentionMetadata]:
        """The batch as each KV cache group's layers see it."""
        return [AttentionMetadata(len(b["input_ids"]), b["num_decodes"], slots, t["query_start_loc"], t["seq_lens"],
                                  tables, b["max_query_len"], b["max_seq_len"], b["max_decode_seq_len"])
                for slots, tables in zip(t["slot_mapping"], t["block_tables"])]

    def _forward_stage(self, t: dict[str, torch.Tensor], num_tokens: int) -> torch.Tensor | None:
        """This pipeline stage's layers between the previous stage's activations and the next
        one's; the final hidden states on the last stage, None on the others."""
        pp = self.pp
        received = None
        if not pp.is_first_rank:
            received = IntermediateTensors(pp.recv_tensor_dict(
                hidden_shapes(num_tokens, self.arch.hidden_size), self.dtype, self.device))
        out = self.model(t["input_ids"], t["positions"], received)
        if pp.is_last_rank:
            return out
        # Not waited on: the next stage may still be busy with the batch before. Those of a
        # batch as many steps back as there are batches in flight are done by now.
        self.stage_sends.append(pp.send_tensor_dict(out))
        while len(self.stage_sends) > self.batches_in_flight:
            for work, _ in self.stage_sends.popleft():
                work.wait()
        return None

    def _sampling_arrays(self, states: list[CachedRequestState], rows: np.ndarray,
                         offsets: np.ndarray) -> dict[str, np.ndarray]:
        """The sampling rows' parameters for the device: only those some row uses, plus Philox
        seeds when the batch can take the one-kernel GPU sampler (no logprobs or per-request
        extras: penalties, logit bias, allowed token ids, bad words, min_tokens), which then takes
        all three filters."""
        temp = self.temperature[rows]
        a = {"temperature": temp}
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        if top_k.any():
            a["top_k"] = top_k
        if (top_p < 1).any():
            a["top_p"] = top_p
        if min_p.any():
            a["min_p"] = min_p
        if (self.one_kernel_sampler and not (temp == 0).all()
                and (self.num_logprobs[rows] == NO_LOGPROBS).all() and not self._special_rows(states, rows)):
            a["seeds"] = self._philox_seeds(states, rows, offsets)
            if a.keys() & {"top_k", "top_p", "min_p"}:
                a.update(top_k=top_k, top_p=top_p, min_p=min_p)
        return a

    def _special_rows(self, states: list[CachedRequestState], rows: np.ndarray) -> list[int]:
        """The rows needing the rare per-request extras this step (penalties, logit bias, allowed
        token ids, bad words, stop tokens held back by min_tokens): a loop over the flagged rows
        only."""
        return [i for i in np.nonzero(self.special[rows])[0].tolist()
                if _needs_extras(states[i].params)
                or states[i].num_tokens - states[i].num_prompt_tokens < states[i].params.min_tokens]

    def _sampling_metadata(self, states: list[CachedRequestState], rows: np.ndarray,
                           t: dict[str, torch.Tensor]) -> SamplingMetadata:
        top_k = self.top_k[rows]
        md = SamplingMetadata(
            temperature=t["temperature"],
            all_greedy=bool((self.temperature[rows] == 0).all()),
            any_greedy=bool((self.temperature[rows] == 0).any()),
            top_k=t.get("top_k"), top_p=t.get("top_p"), min_p=t.get("min_p"),
            generators={i: states[i].generator for i in np.nonzero(self.seeded[rows])[0].tolist()},
            max_top_k=int(top_k.max()) if top_k.all() else 0,
            seeds=t.get("seeds"),
        )
        ks = self.num_logprobs[rows]
        if (ks != NO_LOGPROBS).any():
            md.max_num_logprobs = -1 if (ks == -1).any() else int(ks.max())
        special = self._special_rows(states, rows)
        if special:
            self._add_special_sampling(md, states, rows, special)
        return md

    def _philox_seeds(self, states: list[CachedRequestState], rows: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Per-row seeds of the one-kernel GPU sampler: fresh ones from the engine's stream,
        except for seeded requests, whose seed and output position alone fix the draw (so the
        output depends neither on the rest of the batch nor on speculative decoding: a row
        ``offsets`` drafts ahead draws for its position)."""
        seeds = self.rng.integers(0, 2**63 - 1, len(states), dtype=np.int64)
        for i in np.nonzero(self.seeded[rows])[0].tolist():
            s = states[i]
            seeds[i] = (s.params.seed * 0x9E3779B97F4A7C15 + s.num_tokens + int(offsets[i])) % (2**63 - 1)
        return seeds

    def _add_special_sampling(self, md, states, rows, special) -> None:
        dev, vocab = self.device, self.arch.vocab_size
        banned_rows, banned_ids, bias_rows, bias_ids, bias_vals = [], [], [], [], []
        pen = [i for i in special if states[i].params.needs_penalties]
        for i in special:
            p, s = states[i].params, states[i]
            if s.num_tokens - s.num_prompt_tokens < p.min_tokens:
                ids = sorted(p.all_stop_token_ids)
                banned_rows += [i] * len(ids)
                banned_ids += ids
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += list(p.logit_bias)
                bias_vals += list(p.logit_bias.values())
        if banned_rows:
            md.banned = (self._to_device(np.array(banned_rows)), self._to_device(np.array(banned_ids)))
        if bias_rows:
            md.logit_bias = (self._to_device(np.array(bias_rows)), self._to_device(np.array(bias_ids)),
                             self._to_device(np.array(bias_vals, dtype=np.float32)))
        self._add_bad_words(md, states, [i for i in special if states[i].params.bad_words_token_ids])
        allowed = [i for i in special if states[i].params.allowed_token_ids]
        if allowed:
            keep = torch.zeros(len(allowed), vocab, dtype=torch.bool, device=dev)
            for k, i in enumerate(allowed):
                s = states[i]
                if s.allowed_ids is None:
                    s.allowed_ids = self._to_device(np.array(s.params.allowed_token_ids))
                keep[k, s.allowed_ids] = True
            md.allowed = (self._to_device(np.array(allowed)), keep)
        if pen:
            b = len(states)
            counts = torch.zeros(b, vocab, device=dev)
            prompt_mask = torch.zeros(b, vocab, dtype=torch.bool, device=dev)
            pp = np.zeros((3, b), dtype=np.float32)
            pp[2] = 1.0
            for i in pen:
                s = states[i]
                toks = self._row_tokens(s)
                prompt_mask[i, toks[:s.num_prompt_tokens]] = True
                out_toks = toks[s.num_prompt_tokens:]
                counts[i].index_add_(0, out_toks, torch.ones(len(out_toks), device=dev))
                pp[:, i] = (s.params.presence_penalty, s.params.frequency_penalty, s.params.repetition_penalty)
            md.output_counts, md.prompt_mask = counts, prompt_mask
            md.presence_penalty, md.frequency_penalty, md.repetition_penalty = (
                self._to_device(x) for x in pp)

    def _row_tokens(self, s: CachedRequestState, first: int = 0) -> torch.Tensor:
        """A request's tokens so far, from ``first`` on, on the device (its last may be known
        there only)."""
        toks = self._to_device(self.token_ids[s.row, first:s.num_tokens].astype(np.int64))
        if self.pending_idx[s.row] >= 0:
            toks[-1] = self.last_sampled[int(self.pending_idx[s.row])]
        return toks

    def _add_bad_words(self, md, states, bad: list[int]) -> None:
        """A bad word's last token is banned where the output so far ends with the rest of it (a
        one-token word: always), as vLLM does; the match is made on the device (no sync)."""
        ban_rows, ban_ids, active = [], [], []
        always = torch.ones((), dtype=torch.bool, device=self.device)
        for i in bad:
            s = states[i]
            if s.bad_word_prefixes is None:
                s.bad_word_prefixes = [self._to_device(np.array(w[:-1])) if len(w) > 1 else None
                                       for w in s.params.bad_words_token_ids]
            num_out = s.num_tokens - s.num_prompt_tokens
            words = [(w, prefix) for w, prefix in zip(s.params.bad_words_token_ids, s.bad_word_prefixes)
                     if len(w) - 1 <= num_out]
            # (only the output's last tokens, as many as the longest word's prefix)
            longest = max((len(w) for w, _ in words), default=1)
            tail = self._row_tokens(s, s.num_tokens - longest + 1) if longest > 1 else None
            for word, prefix in words:
                active.append(always if prefix is None else (tail[len(tail) - len(prefix):] == prefix).all())
                ban_rows.append(i)
                ban_ids.append(word[-1])
        if ban_rows:
            md.bad_words = (self._to_device(np.array(ban_rows)), self._to_device(np.array(ban_ids)), torch.stack(active))

    def _prompt_logprobs(self, hidden, req_ids, states, rows, computed, q_lens, cu, out) -> None:
        """Logprobs of prompt tokens computed this step (a chunk yields those of its next
        tokens, up to the end of the prompt)."""
        if not self.num_prompt_logprob_reqs:
            return
        if hidden is not None:
            self._prompt_logprobs_here(hidden, req_ids, states, rows, computed, q_lens, cu, out)
        if self.driver != 0:     # (computed on the last pipeline stage, wanted by the engine)
            if self.rank == self.driver:
                send_object(out.prompt_logprobs, dst=0)
            elif self.rank == 0:
                out.prompt_logprobs = recv_object(src=self.driver)

    def _prompt_logprobs_here(self, hidden, req_ids, states, rows, computed, q_lens, cu, out) -> None:
        for i, s in enumerate(states):
            k = s.params.prompt_logprobs
            first = int(computed[i])
            if k is None or first >= s.num_prompt_tokens - 1:
                continue
            last = min(first + int(q_lens[i]), s.num_prompt_tokens - 1)   # exclusive
            h = hidden[int(cu[i] - q_lens[i]):int(cu[i] - q_lens[i]) + last - first]
            logits = self.model.compute_logits(h)       # (collective: every tensor-parallel rank)
            if logits is None:             # (a tensor-parallel rank that does not sample)
                continue
            targets = self._to_device(self.token_ids[rows[i], first + 1:last + 1].astype(np.int64))
            lp, ranks, topk_ids, topk_lp = logprobs_of(logits, targets, k)
            out.prompt_logprobs[req_ids[i]] = (first + 1, targets.tolist(), lp.tolist(), ranks.tolist(),
                                               topk_ids.tolist(), topk_lp.tolist())
