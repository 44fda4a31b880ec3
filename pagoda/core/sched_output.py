"""What passes between the scheduler and the model runner each step. Plain data (a leaf module
that the runner may import too), so it can cross a process boundary for multi-GPU executors."""
from dataclasses import dataclass, field

from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (or dropped after a preemption): everything it needs."""
    req_id: str
    token_ids: list[int]          # prompt + outputs so far (outputs are recomputed after preemption)
    num_prompt_tokens: int
    block_ids: list[list[int]]    # its block table in each KV cache group
    num_computed_tokens: int
    sampling_params: SamplingParams
    pooling_params: PoolingParams | None = None     # a pooling request (LLM.embed): pooled, not sampled
    lora_request: object = None                     # its LoRA adapter (a LoRARequest), or None


@dataclass
class CachedRequestData:
    """A request already on the runner: only the blocks added this step."""
    req_id: str
    new_block_ids: tuple[list[int], ...]     # to each KV cache group's table (empty: none added)
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]      # batch order: running first, then new
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)   # runner may drop their state
    # (src, dst) KV blocks to copy before the forward: forked samples' copy-on-write.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Structured outputs: req_id -> the tokens its next sample may take, a bit each (int32 words).
    grammar_bitmasks: dict = field(default_factory=dict)
    # Speculative decoding: req_id -> the draft tokens scheduled after its last token.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # With a draft model: the requests it should propose drafts for after this step (those the
    # scheduler would give drafts to; none while disable_by_batch_size holds)
    draft_req_ids: set[str] = field(default_factory=set)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    # Requests that reached the end of their known tokens and sampled one more (after the
    # drafts kept, if any).
    sampled_token_ids: dict[str, int]
    # Speculative decoding: req_id -> how many of its drafts were kept (0 when absent).
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    # With a draft model: req_id -> the drafts it proposed after this step's tokens.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> for each token of the step (one, or the drafts kept and one more): (token ids
    # (k+1 each: the sampled token, then the top k), logprobs, rank of the sampled token)
    logprobs: dict[str, list[tuple[list[int], list[float], int]]] = field(default_factory=dict)
    # req_id -> (first position, token ids (P, k+1), logprobs (P, k+1), ranks (P,))
    prompt_logprobs: dict[str, tuple] = field(default_factory=dict)
    # Pooling requests whose prompt is computed: req_id -> the pooled vector (float32, CPU tensor)
    pooler_output: dict = field(default_factory=dict)
