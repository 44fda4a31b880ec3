"""The engine: add requests, then step until done. One step = schedule, execute, update,
detokenize; with async scheduling the update and detokenization of step N run while the device
runs step N+1."""
import functools
import gc
import itertools
import logging
import time
import traceback
import weakref
from collections import deque
from dataclasses import asdict

from pagoda.config import EngineConfig, class_labels
from pagoda.core.kv_cache_manager import KVCacheManager, max_blocks_per_request
from pagoda.core.request import Request, RequestStatus
from pagoda.core.scheduler import Scheduler
from pagoda.distributed.child_procs import run_call
from pagoda.distributed.executor import get_executor
from pagoda.engine import profiler
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.output_processor import OutputProcessor, ParentState
from pagoda.engine.stats import EngineStats, StatLogger
from pagoda.engine.structured_output import StructuredOutputs
from pagoda.lora.adapter import load_adapter
from pagoda.lora.request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.pooling_params import PoolingParams
from pagoda.reasoning import REASONING_FORMATS
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineAsleepError(RuntimeError):
    """A request for an engine in sleep mode (the server answers 503)."""


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None):
        t0 = time.time()
        self.config = config
        self.tokenizer = tokenizer
        self.executor = get_executor(config)
        self.enable_sleep_mode = config.enable_sleep_mode
        self.sleeping: set[str] = set()      # what sleeps (sleep mode): "weights", "kv_cache"
        num_blocks = self.executor.determine_num_blocks()
        windows = tuple(g.window for g in config.cache.groups)
        self._check_kv_cache_fits(num_blocks, windows)
        self.executor.initialize_kv_cache(num_blocks)
        config.cache.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                               windows)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache_manager, config.speculative, config.lora)
        self.output_processor = OutputProcessor(tokenizer)
        self.num_steps = self.num_prompt_tokens = 0
        self.stat_logger = StatLogger() if config.log_stats else None
        self._ids = itertools.count()
        self.eos_token_id = self._eos_token_id()
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight = None         # (SchedulerOutput, AsyncRunnerOutput) of the step on the device
        # Pipeline parallelism: up to one step a stage in flight, oldest first (vLLM's batch queue).
        self.batch_queue_size = config.scheduler.max_concurrent_batches
        self._batch_queue: deque = deque()
        self.structured: StructuredOutputs | None = None     # made at the first structured request
        self._structured_ids: set[str] = set()                  # its sequences that may still run
        self.lora_requests: dict[int, LoRARequest] = {}         # the adapters checked, by lora_int_id
        # What exists now (torch, the model, its CUDA graphs: ~450,000 objects) lives as long as
        # the engine. Frozen, the cyclic GC no longer rescans it: one full collection, which adding
        # W1's 256 requests triggered, took 0.1-0.16 s on this CPU. (The engine holds no reference
        # cycles: dropped, it is still freed, by reference counting.) The freeze takes in the whole
        # process's objects, the caller's too: a cycle of theirs that dies while the engine lives
        # (an HF model loaded before it, say) is only freed after the engine is gone, which
        # unfreezes everything.
        gc.collect()
        gc.freeze()
        weakref.finalize(self, gc.unfreeze)
        groups = config.cache.groups
        logger.info("Engine ready in %.1f s: %d KV blocks of %d tokens (KV cache dtype %s%s).", time.time() - t0,
                    num_blocks - 1, config.cache.block_size, config.cache.cache_dtype,
                    f"; {len(groups)} KV cache groups of {len(groups[0].layers)} layers, windows {windows}"
                    if len(groups) > 1 else "")

    @classmethod
    def from_engine_args(cls, args: EngineArgs):
        """The engine ``args`` describe: this class, or with data_parallel_size > 1 a front
        (DPEngine) over replicas of it, which answers the same calls."""
        config = args.create_engine_config()
        tokenizer = load_tokenizer(args, config.model.path)
        if config.parallel.data_parallel_size > 1:
            from pagoda.engine.dp_engine import DPEngine
            return DPEngine(args, config, tokenizer)
        return cls(config, tokenizer)

    def _check_kv_cache_fits(self, num_blocks: int, windows: tuple[int, ...]) -> None:
        bs, sc = self.config.cache.block_size, self.config.scheduler

        def blocks(num_tokens: int) -> int:
            return max_blocks_per_request(windows, bs, num_tokens, sc.max_num_batched_tokens)

        if blocks(sc.max_model_len) > num_blocks - 1:
            fits = max((n for n in range(0, sc.max_model_len + 1, bs) if blocks(n) <= num_blocks - 1), default=0)
            raise ValueError(
                f"The KV cache holds {(num_blocks - 1) * bs} tokens ({num_blocks - 1} blocks), less than "
                f"one sequence of max_model_len={sc.max_model_len} needs. Lower max_model_len to at most "
                f"{fits} or give the KV cache more memory.")

    def _eos_token_id(self) -> int | None:
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            return self.tokenizer.eos_token_id
        eos = self.config.model.arch.eos_token_id
        return eos[0] if eos else None

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | PoolingParams | None = None, arrival_time: float | None = None,
                    priority: int = 0, lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises ValueError on bad input, leaving the engine
        untouched. ``priority``: with scheduling_policy="priority", lower values are served first.
        PoolingParams make a pooling request (the pooling runner's): its prompt's vector.
        ``lora_request``: the LoRA adapter it runs with (``enable_lora=True``)."""
        if self.sleeping:
            raise EngineAsleepError("The engine is asleep: wake_up() first.")
        self._check_lora(lora_request)
        params, pooling = self._pooling(params or SamplingParams())
        if priority != 0 and self.config.scheduler.policy != "priority":
            raise ValueError(f"Got priority {priority}, but priority scheduling is not enabled: start the engine "
                             "with scheduling_policy='priority'.")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.output_processor.parents:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.scheduler.max_model_len
        if params.truncate_prompt_tokens is not None:   # (vLLM's: the prompt's end is kept)
            token_ids = token_ids[-(max_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens):]
        if not token_ids:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        if len(token_ids) > max_len:
            raise ValueError(f"The prompt (length {len(token_ids)}) is longer than the maximum model "
                             f"length of {max_len}. Shorten the prompt or raise max_model_len.")
        vocab = self.config.model.arch.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"Prompt token ids must be in [0, {vocab}); got min {min(token_ids)}, "
                             f"max {max(token_ids)}.")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise ValueError(f"allowed_token_ids must be in [0, {vocab}); got {max(params.allowed_token_ids)}.")
        cap = self.config.model.max_logprobs
        for what, k in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if k is not None and cap != -1 and k > cap:
                raise ValueError(f"Requested {what} logprobs of {k}, which is greater than max allowed: {cap} "
                                 "(the engine's max_logprobs).")
        params = self._finalize_params(params)
        grammar = self._grammar(params.structured_outputs) if params.structured_outputs is not None else None
        max_tokens = params.max_tokens if params.max_tokens is not None else max_len - len(token_ids)
        arrival = arrival_time or time.time()
        parent = ParentState(request_id, text, token_ids, params, arrival)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone()
                child_params.n = 1
                if params.seed is not None:
                    child_params.seed = params.seed + i
            # Samples after the first fork its KV once it has computed the prompt.
            children.append(Request(f"{i}_{request_id}" if params.n > 1 else request_id, token_ids,
                                    child_params, self.eos_token_id, max(1, max_tokens), arrival,
                                    cache_salt, fork_parent=children[0] if children else None, priority=priority,
                                    lora_request=lora_request))
        self.output_processor.add(parent, children)
        if pooling is not None:
            children[0].pooling_params = pooling
            # Mean / CLS pooling and the token-level tasks need every token's hidden state: no
            # cached prefix.
            children[0].skip_prefix_cache |= pooling.is_token_task or self.config.model.pooler.pooling_type != "LAST"
        for req in children:
            if grammar is not None:
                req.matcher = self.structured.matcher(grammar)
                req.thinking_end = self.structured.thinking_end(token_ids)
                self._structured_ids.add(req.request_id)
            self.scheduler.add_request(req)
        self.num_prompt_tokens += len(token_ids) * params.n
        return request_id

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter, read and checked against the model the first time its id comes
        (the runner reads it again from its folder when a step needs it)."""
        if lora_request is None:
            return
        lora = self.config.lora
        if lora is None:
            raise ValueError(f"Got a LoRA request ({lora_request.lora_name!r}), but LoRA is not enabled: start the "
                             "engine with enable_lora=True.")
        known = self.lora_requests.get(lora_request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (lora_request.lora_name, lora_request.lora_path):
                raise ValueError(f"lora_int_id {lora_request.lora_int_id} names adapter {known.lora_name!r} at "
                                 f"{known.lora_path!r} already; give each adapter an id of its own.")
            return
        load_adapter(lora_request, self.config.model.arch, lora.max_lora_rank)
        self.lora_requests[lora_request.lora_int_id] = lora_request

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check an adapter ahead of its requests (vLLM's add_lora)."""
        self._check_lora(lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (vLLM's remove_lora): its id may then name another one. Requests
        using it must have ended. Returns whether it was known."""
        if any(r.lora_id == lora_id for r in self.scheduler.requests.values()):
            raise ValueError(f"LoRA adapter {lora_id} still has requests running or waiting.")
        return self.lora_requests.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.lora_requests)

    def _pooling(self, params) -> tuple[SamplingParams, PoolingParams | None]:
        """A pooling request runs as a greedy one-token request that is pooled instead of
        sampled; (its stand-in SamplingParams, its PoolingParams). Each runner takes its own kind."""
        model = self.config.model
        if not isinstance(params, PoolingParams):
            if model.runner == "pooling":
                raise ValueError("This engine runs the pooling runner (runner='pooling'): use LLM.embed, "
                                 "LLM.classify, LLM.score or LLM.encode, or start another engine to generate.")
            return params, None
        if model.runner != "pooling":
            raise ValueError("Embeddings, classes and scores need the pooling runner: start the engine with "
                             "runner='pooling' (or task='embed').")
        _check_pooling_task(params, model)
        return SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                              truncate_prompt_tokens=params.truncate_prompt_tokens), params

    def _grammar(self, params) -> str:
        parser = self.config.model.reasoning_parser
        if parser is not None and not REASONING_FORMATS[parser].tagged:
            raise ValueError(f"Structured outputs do not run with the {parser!r} reasoning parser (nor in vLLM): "
                             "its thinking ends at a sentence the engine cannot find among the tokens.")
        if self.structured is None:
            eos = sorted({self.eos_token_id, *(self.tokenizer.eos_token_ids if self.tokenizer else ())} - {None})
            self.structured = StructuredOutputs(self.tokenizer, self.config.model.arch.vocab_size, eos,
                                                reasoning=parser is not None)
        return self.structured.compile(params)

    def prompt_token_ids(self, prompt) -> list[int]:
        return self._tokenize(prompt)[1]

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if isinstance(ids, str) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integer token ids.")
                return prompt.get("prompt"), list(ids)
            prompt = prompt.get("prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("Text prompts need a tokenizer (skip_tokenizer_init=True was set).")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"A prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids'; got {type(prompt).__name__}.")

    def _finalize_params(self, params: SamplingParams) -> SamplingParams:
        params = params.clone()
        if not params.ignore_eos:
            gen_eos = self.config.model.generation_config.get("eos_token_id")
            extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
            if self.tokenizer is not None:
                extra = list(extra) + sorted(self.tokenizer.eos_token_ids)
            params.stop_token_ids = params.stop_token_ids + [
                t for t in dict.fromkeys(extra) if t != self.eos_token_id and t not in params.stop_token_ids]
        params.all_stop_token_ids = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            params.all_stop_token_ids.add(self.eos_token_id)
        if params.bad_words:
            params.bad_words_token_ids = self._bad_words_token_ids(params.bad_words)
        return params

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each word's token ids at the start of a text and after a space, as vLLM bans them (the
        second only where the space makes other tokens of the same count)."""
        if self.tokenizer is None:
            raise ValueError("bad_words need the tokenizer (the engine was started with skip_tokenizer_init).")
        ids = []
        for word in words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            ids.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                ids.append(spaced)
        return ids

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.scheduler.finish_requests(self.output_processor.remove(rid), RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    # ------------------------------------------------------------------ every rank's
    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """``method`` (a function taking a rank's worker first, or a worker method's name) run on
        every rank, the results in rank order. An error in it raises here, naming the ranks, and
        leaves the engine running (a worker that raised on its own would end)."""
        results = self.executor.collective_rpc(functools.partial(_caught, method, kwargs or {}), args)
        failed = [f"rank {rank}: {text}" for rank, (ok, text) in enumerate(results) if not ok]
        if failed:
            raise RuntimeError("collective_rpc failed on " + "\n".join(failed))
        return [value for _, value in results]

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, for an idle engine: every rank frees its KV cache and CUDA graphs
        and moves its weights to the host (level 1) or drops them (level 2); the prefix cache is
        emptied. Requests are refused until wake_up."""
        if not self.enable_sleep_mode:
            raise RuntimeError("Sleep mode is off: start the engine with enable_sleep_mode=True.")
        if level not in (1, 2):
            raise ValueError(f"Sleep level must be 1 (weights to the host) or 2 (weights dropped), got {level}.")
        if self.has_unfinished_requests():
            raise RuntimeError(f"The engine sleeps only when idle; {self.get_num_unfinished_requests()} requests "
                               "are unfinished.")
        if self.sleeping:
            raise RuntimeError("The engine is asleep already.")
        self.scheduler.reset_prefix_cache()
        self.collective_rpc(_on_runner, ("sleep", level))
        self.sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Back from sleep (vLLM's): ``tags`` "weights" (to load new weights into, after level 2,
        before the KV cache takes its memory) and "kv_cache" (its CUDA graphs captured again);
        both by default."""
        tags = ["weights", "kv_cache"] if tags is None else list(tags)
        unknown = set(tags) - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"Unknown wake_up tags {sorted(unknown)}; known: weights, kv_cache.")
        self.collective_rpc(_on_runner, ("wake_up", tags))
        self.sleeping -= set(tags)

    def is_sleeping(self) -> bool:
        return bool(self.sleeping)

    def start_profile(self, directory: str | None = None) -> None:
        """The torch profiler on every rank (engine/profiler.py), its traces into ``directory``
        (default: $PAGODA_TORCH_PROFILER_DIR) when stop_profile stops it."""
        self.collective_rpc(profiler.start, (directory or profiler.profiler_dir(),))

    def stop_profile(self) -> None:
        self.collective_rpc(profiler.stop)

    # ------------------------------------------------------------------ one step
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """Schedule and queue step N+1, then finish step N while the device runs N+1: its tokens
        reach the host, stop checks, detokenization, outputs. Without async scheduling (or
        when nothing is left to run) the step just queued is finished at once, so the two
        modes share this code. Step N+1 needs none of step N's tokens on the host: the
        scheduler counts them as placeholders and the runner reads them on the device. Structured
        outputs do need them (their masks follow the tokens): while such sequences run, step N is
        finished before step N+1 is scheduled."""
        if self.batch_queue_size > 1:
            return self._step_with_batch_queue()
        outputs, sched = [], None
        try:
            if self._in_flight is not None and self._structured_running():
                outputs, self._in_flight = self._finish_step(*self._in_flight), None
            sched = self._schedule()
            launched = self.executor.execute_model(sched)
            if self._in_flight is not None:
                outputs += self._finish_step(*self._in_flight)
        except BaseException:
            self._drop_steps_in_flight(sched)
            raise
        self._in_flight = sched, launched
        if not self.async_scheduling or not self.scheduler.has_unfinished_requests():
            outputs += self._finish_step(sched, launched)
            self._in_flight = None
        return outputs

    def _step_with_batch_queue(self) -> list[RequestOutput]:
        """Pipeline parallelism: while fewer steps than stages are in flight, schedule and queue
        another (of the requests whose tokens are not in flight: the scheduler skips those),
        so that every stage has a batch to run; then finish the oldest step once the queue is
        full or nothing else can be scheduled. A step's tokens thus come back while the first
        stage already runs the next batch."""
        queue, sched = self._batch_queue, None
        try:
            if len(queue) < self.batch_queue_size:
                sched = self._schedule()
                if not sched.is_empty or sched.finished_req_ids:   # (the runner drops the finished)
                    queue.append((sched, self.executor.execute_model(sched)))
                if not sched.is_empty and len(queue) < self.batch_queue_size:
                    return []
            outputs = self._finish_step(*queue.popleft()) if queue else []
            if not self.scheduler.has_unfinished_requests():    # (left in flight after aborts)
                while queue:
                    outputs += self._finish_step(*queue.popleft())
        except BaseException:
            self._drop_steps_in_flight(sched)
            raise
        return outputs

    def _drop_steps_in_flight(self, failed) -> None:
        """After a failed step (the caller aborts the requests): no step stays in flight, in either
        step path. The blocks the failed steps were to fill are already indexed: forget the
        index, so no later request reads what was never written. The requests that finished
        before the last step scheduled (``failed``, if it was scheduled) go to the runner with
        the next step instead: the failed one may not have dropped their rows."""
        if failed is not None:
            self.scheduler.finished_req_ids |= failed.finished_req_ids
        self._in_flight = None
        self._batch_queue.clear()
        self.kv_cache_manager.pool.forget_cached_blocks()

    def _schedule(self):
        """The next step, with the allowed-token masks of its structured requests."""
        sched = self.scheduler.schedule()
        if self._structured_ids:
            sched.grammar_bitmasks = self.structured.bitmasks(sched.num_scheduled_tokens, self.scheduler.requests)
        return sched

    def _structured_running(self) -> bool:
        self._structured_ids.intersection_update(self.scheduler.requests)
        return bool(self._structured_ids)

    def _finish_step(self, sched, launched) -> list[RequestOutput]:
        runner_out = launched.get_output()
        updated = self.scheduler.update_from_output(sched, runner_out)
        if self._structured_ids and (done := self.structured.accept(updated)):
            self.scheduler.finish_requests(done, RequestStatus.FINISHED_STOPPED)   # grammar complete
        outputs, stopped = self.output_processor.process(updated, runner_out)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self.num_steps += 1
        if self.stat_logger is not None:
            self.stat_logger.maybe_log(self.stats)
        return outputs

    def take_inter_token_latencies(self) -> list[float]:
        """The inter-token latencies of the steps finished since the last call (seconds)."""
        latencies, self.output_processor.inter_token_latencies = self.output_processor.inter_token_latencies, []
        return latencies

    @property
    def stats(self) -> EngineStats:
        pool = self.kv_cache_manager.pool
        return EngineStats(
            num_steps=self.num_steps, num_prompt_tokens=self.num_prompt_tokens,
            **asdict(self.scheduler.stats),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=pool.num_usable_blocks, kv_blocks_in_use=pool.num_usable_blocks - pool.num_free_blocks,
            kv_blocks_cached=pool.num_cached_blocks, kv_blocks_free=pool.num_free_blocks)


def _on_runner(worker, name: str, *args):
    """collective_rpc's function for a ModelRunner method on every rank."""
    return getattr(worker.runner, name)(*args)


def _caught(method, kwargs: dict, worker, *args) -> tuple[bool, object]:
    """A collective_rpc call on one rank: (True, its result), or (False, its traceback)."""
    try:
        return True, run_call(worker, method, args, kwargs)
    except Exception:      # noqa: BLE001 - the user's function: told back, the rank goes on
        return False, traceback.format_exc()


def load_tokenizer(args: EngineArgs, model_path: str) -> Tokenizer | None:
    """The tokenizer ``args`` name, else the model's (``model_path``: its resolved folder or file)."""
    if args.skip_tokenizer_init:
        return None
    source = args.tokenizer or model_path
    return Tokenizer.from_gguf(source) if source.endswith(".gguf") else Tokenizer.from_pretrained(source)


def _check_pooling_task(params: PoolingParams, model) -> None:
    """Refuse what the model cannot give: an embedding from a classifier, classes from an
    embedding model, a cross-encoder's score from a classifier of several labels."""
    arch = model.arch.architecture
    if model.pooling_task == "classify":
        labels = len(class_labels(model.arch))
        if params.task in ("embed", "token_embed"):
            raise ValueError(f"This model ({arch}) classifies; it gives no embeddings: use LLM.classify or LLM.score "
                             "(or pooling_task='token_classify').")
        if params.task == "score" and labels != 1:
            raise ValueError(f"Scoring pairs with a classifier needs a cross-encoder (one label); {arch} has "
                             f"{labels}: use LLM.classify.")
        if params.dimensions is not None:
            raise ValueError("dimensions is for embeddings; this model classifies.")
        return
    if params.task in ("classify", "token_classify"):
        raise ValueError(f"Classification needs a sequence classification model (an architecture "
                         f"*ForSequenceClassification); this one ({arch}) gives embeddings: use LLM.embed "
                         "(or pooling_task='token_embed').")
    hidden = model.arch.hidden_size
    if params.dimensions is not None and params.dimensions > hidden:
        raise ValueError(f"dimensions={params.dimensions} is more than the model's hidden size ({hidden}).")
