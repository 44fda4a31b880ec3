"""The offline API, vLLM-compatible: ``LLM(model=...).generate(prompts, sampling_params)``."""
import functools
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from pagoda.beam_search import beam_search
from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.llm_engine import LLMEngine
from pagoda.lora.request import LoRARequest
from pagoda.outputs import (BeamSearchOutput, ClassificationRequestOutput, EmbeddingRequestOutput,
                            PoolingRequestOutput, RequestOutput, ScoringRequestOutput)
from pagoda.pooling_params import PoolingParams, pair_scores, score_pairs, score_prompts
from pagoda.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An offline engine. ``model`` is a model folder, a .gguf file, or a hub name in the local
    Hugging Face cache; with none, the embedded SmolLM2-135M-Instruct. Other keyword arguments
    are vLLM's engine arguments (max_num_seqs, max_num_batched_tokens, dtype, ...)."""

    def __init__(self, model: str | None = None, **kwargs):
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword arguments: {sorted(unknown)}.")
        self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat sample with when given no SamplingParams (vLLM's): the sampling
        fields of the model's generation_config.json (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), see ``generation_config``; else
        SamplingParams()."""
        return SamplingParams(**self.llm_engine.config.model.sampling_defaults)

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 priority: list[int] | None = None, **_ignored) -> list[RequestOutput]:
        """Generate for one prompt or a list of them (strings, token-id lists, or dicts with
        ``prompt`` / ``prompt_token_ids``). Returns outputs in input order. ``lora_request``: the
        LoRA adapter of every prompt, or one a prompt (None: the base model), with
        ``enable_lora=True``. ``priority``: one a prompt, with scheduling_policy="priority"
        (lower first)."""
        prompts = self._as_list(prompts)
        params = self._params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"priority has {len(priority)} values for {len(prompts)} prompts.")
        return self._run(prompts, params, use_tqdm, priority, self._loras(lora_request, len(prompts)))

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest] | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list | None = None, chat_template_kwargs: dict | None = None, **_ignored) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, rendered with
        the model's chat template. ``lora_request``: as for generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = [tok.chat_prompt(conv, add_generation_prompt=add_generation_prompt and not continue_final_message,
                                   tools=tools, chat_template=chat_template,
                                   continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
                   for conv in conversations]
        params = self._params_list(sampling_params or self.get_default_sampling_params(), len(prompts))
        return self._run(prompts, params, use_tqdm, loras=self._loras(lora_request, len(prompts)))

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter before its first request (vLLM's)."""
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    # ------------------------------------------------------------------ pooling
    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None, pooling_task: str | None = None,
               lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
               **_ignored) -> list[PoolingRequestOutput]:
        """Each prompt's pooled output (a tensor), with the pooling runner (``runner="pooling"``):
        the final hidden states pooled as the model's pooler config says (the last token's by
        default), then normalized; a classifier's class probabilities. ``pooling_task``
        (vLLM's): "token_embed" for every prompt token's normalized hidden state, a
        (tokens, hidden size) tensor; "token_classify" for a classifier's probabilities at
        every token, (tokens, classes); or "embed" / "classify". ``lora_request``: as for generate."""
        return self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, pooling_task, lora_request)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
              lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
              **_ignored) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (``outputs.embedding``, a list of floats), as ``encode``."""
        return [EmbeddingRequestOutput.from_base(o)
                for o in self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "embed", lora_request)]

    def classify(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
                 **_ignored) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (``outputs.probs``), with a sequence classification
        model (``*ForSequenceClassification``): its head on the last token's final hidden
        state, then softmax (sigmoid for one label)."""
        return [ClassificationRequestOutput.from_base(o)
                for o in self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "classify",
                                    lora_request)]

    def score(self, data_1, data_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request: LoRARequest | None = None,
              **_ignored) -> list[ScoringRequestOutput]:
        """Each pair's score, as vLLM scores: with a cross-encoder (a classifier of one label)
        its sigmoid output for the two texts read together; with an embedding model the cosine
        of their embeddings. ``data_1`` is one text (scored against each of ``data_2``) or as
        many as ``data_2`` (pairwise)."""
        first, second = score_pairs(self._as_list(data_1), self._as_list(data_2),
                                    ("score()'s first argument", "the second list"))
        prompts = score_prompts(self.llm_engine.config.model.pooling_task, self.get_tokenizer(), first, second)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError("score() takes one LoRARequest for all its pairs.")
        return pair_scores(self._pool(prompts, pooling_params, use_tqdm, truncate_prompt_tokens, "score",
                                      lora_request), len(first))

    def beam_search(self, prompts, params: BeamSearchParams, lora_request: LoRARequest | None = None,
                    use_tqdm: bool = False, **_ignored) -> list[BeamSearchOutput]:
        """Beam search for each prompt (strings, or dicts with ``prompt`` / ``prompt_token_ids``);
        returns the best ``params.beam_width`` sequences of each, best first. ``lora_request``:
        one adapter for every beam."""
        return beam_search(self, self._as_list(prompts), params, use_tqdm, lora_request)

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: ``method`` run on every rank's worker, the results in rank order (with data
        parallelism, replica by replica). ``method``: a function whose first argument is the
        worker (its ``runner``, whose ``model`` is the rank's shard; its ``rank``), or a worker
        method's name. Spawned ranks (tensor / pipeline parallelism, data-parallel replicas)
        receive it pickled: a module-level function, not a lambda. An error in it raises a
        RuntimeError with each failing rank's traceback and leaves the engine running."""
        if timeout is not None:
            raise ValueError("collective_rpc's timeout is not supported: the call waits for every rank "
                             "(pass timeout=None).")
        return self.llm_engine.collective_rpc(method, tuple(args), kwargs)

    def apply_model(self, func) -> list:
        """vLLM's: ``func(model)`` on every rank's model (its shard), the results in rank order."""
        return self.collective_rpc(functools.partial(_apply_model, func))

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``), between uses of an idle engine (in RL,
        while the trainer takes the GPU): every rank frees its KV cache and CUDA graphs and
        moves its weights to the host (level 1) or drops them (level 2: load new ones after
        ``wake_up(["weights"])``, e.g. through collective_rpc); the prefix cache is emptied."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Back from sleep: "weights" then "kv_cache" (its CUDA graphs captured again), or both."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def start_profile(self) -> None:
        """vLLM's: the torch profiler on every rank, until stop_profile writes its traces (one a
        rank) into $PAGODA_TORCH_PROFILER_DIR (or vLLM's $VLLM_TORCH_PROFILER_DIR), which must be
        set."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> None:
        self.llm_engine.stop_profile()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block. Returns False (and keeps them) while requests run."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self):
        """Counters and gauges of the engine: tokens, prefix-cache hits, KV blocks (EngineStats)."""
        return self.llm_engine.stats

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):   # one token-id prompt
            return [prompts]
        return prompts

    @staticmethod
    def _params_list(params, n: int, kind: type = SamplingParams) -> list:
        if params is None:
            params = kind()
        if isinstance(params, kind):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"Got {len(params)} {kind.__name__} for {n} prompts; pass one, or one per prompt.")
        return params

    def _pool(self, prompts, pooling_params, use_tqdm: bool, truncate_prompt_tokens: int | None,
              task: str | None, lora_request=None) -> list[PoolingRequestOutput]:
        prompts = self._as_list(prompts)
        params = [p.clone() for p in self._params_list(pooling_params, len(prompts), PoolingParams)]
        for p in params:
            p.task = task or p.task
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
        return self._run(prompts, params, use_tqdm, loras=self._loras(lora_request, len(prompts)))

    @staticmethod
    def _loras(lora_request, n: int) -> list | None:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return None if lora_request is None else [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"Got {len(loras)} LoRA requests for {n} prompts; pass one, or one per prompt.")
        return loras

    def _run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool,
             priority: list[int] | None = None, loras: list | None = None) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                p = p.clone()
                if isinstance(p, SamplingParams):
                    p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(engine.add_request(None, prompt, p, priority=priority[i] if priority else 0,
                                              lora_request=loras[i] if loras else None))
            finished = self._run_engine(len(ids), use_tqdm)
        except BaseException:
            # Bad input or a failure mid-run: release everything this call holds so the
            # engine stays usable.
            engine.abort_request(ids)
            raise
        return [finished[i] for i in ids]

    def _run_engine(self, total: int, use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.llm_engine
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, in_toks, out_toks = time.time(), 0, 0
        finished: dict[str, RequestOutput] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    in_toks += len(out.prompt_token_ids)
                    if isinstance(out, RequestOutput):
                        out_toks += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = max(time.time() - start, 1e-6)
                    bar.set_postfix_str(f"input: {in_toks / elapsed:.0f} tok/s, output: {out_toks / elapsed:.0f} tok/s",
                                        refresh=False)
                    bar.update(1)
        bar.close()
        return finished


def _apply_model(func, worker):
    return func(worker.runner.model)
