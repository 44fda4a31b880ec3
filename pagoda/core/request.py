"""A request as the scheduler sees it: token ids, progress and status."""
import enum
import time

from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_id: int | None, max_tokens: int, arrival_time: float | None = None,
                 cache_salt: str | None = None, fork_parent: "Request | None" = None, priority: int = 0,
                 lora_request=None):
        self.request_id = request_id
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # Every token id that ends the request (EOS unless ignore_eos, and the stop ids).
        self.stop_token_ids = set(sampling_params.stop_token_ids)
        if eos_token_id is not None and not sampling_params.ignore_eos:
            self.stop_token_ids.add(eos_token_id)
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        # len(all_token_ids), kept as a field: the scheduler reads it several times per request
        # per step, and a property call costs more than the rest of a decode's bookkeeping.
        self.num_tokens = self.num_prompt_tokens
        self.num_computed_tokens = 0
        # Tokens sampled by a step still on the device (async scheduling): counted, not yet known.
        self.num_output_placeholders = 0
        # Speculative decoding: draft tokens scheduled after the last one in the step in flight.
        self.spec_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Prefix caching: hashes of the full blocks of all_token_ids (see KVCacheManager), and a
        # salt that keeps this request's prefix apart from everyone else's.
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        # Its LoRA adapter (a LoRARequest), or None: its KV is its own, never another adapter's.
        self.lora_request = lora_request
        self.lora_id = lora_request.lora_int_id if lora_request is not None else 0
        self.num_cached_tokens = 0       # prompt tokens reused at first admission (vLLM's field)
        # Prompt logprobs need every prompt position computed, so no cached prefix.
        self.skip_prefix_cache = sampling_params.prompt_logprobs is not None
        # Parallel sampling (n > 1): the sample that computes the prompt, which this one forks.
        self.fork_parent = fork_parent
        # Structured outputs: the llguidance matcher of this sequence's grammar (set by the engine),
        # and, while a reasoning model thinks, the tokens that end its thinking (the grammar holds
        # what follows them)
        self.matcher = None
        self.thinking_end: tuple[int, ...] | None = None
        # A pooling request (LLM.embed): its output is one vector once its prompt is computed,
        # which the scheduler counts as its one output token (max_tokens 1).
        self.pooling_params = None

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.num_tokens += 1
