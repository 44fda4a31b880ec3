"""Request outputs, with vLLM's classes and field names."""
from dataclasses import dataclass, field
from typing import ClassVar

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token_id: Logprob}, holding the chosen token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None          # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None      # the stop token id or string; None for EOS
    lora_request: None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    lora_request: object = None          # the LoRARequest it ran with
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: dict = field(default_factory=dict)

    def add(self, later: "RequestOutput") -> None:
        """Fold ``later``, the next delta output (``RequestOutputKind.DELTA``) of the same request,
        into this one, as if the engine had made one output of both steps. A server whose reader
        falls behind the engine sends one chunk for what piled up, instead of one per step."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:
                mine[c.index] = c
                self.outputs.append(c)
                continue
            o = mine[c.index]
            o.text += c.text
            o.token_ids = o.token_ids + c.token_ids
            if c.logprobs is not None:
                o.logprobs = (o.logprobs or []) + c.logprobs
            o.cumulative_logprob, o.finish_reason, o.stop_reason = c.cumulative_logprob, c.finish_reason, c.stop_reason
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.metrics, self.num_cached_tokens = later.finished, later.metrics, later.num_cached_tokens


@dataclass
class BeamSearchSequence:
    """One beam: the prompt and its continuation (``tokens`` holds both, as in vLLM)."""
    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]


@dataclass
class PoolingOutput:
    data: torch.Tensor                       # the pooled vector (float32, on the CPU)


@dataclass
class PoolingRequestOutput:
    """A pooling request's result (``LLM.encode``)."""
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]                       # one per class (the logits with use_activation=False)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class _ListRequestOutput:
    """A pooling request's result with its vector as a list of floats (``output_cls``'s field)."""
    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True
    output_cls: ClassVar[type]

    @classmethod
    def from_base(cls, out: PoolingRequestOutput):
        return cls(out.request_id, cls.output_cls(out.outputs.data.tolist()), out.prompt_token_ids, out.finished)


@dataclass
class EmbeddingRequestOutput(_ListRequestOutput):
    """An embedding (``LLM.embed``): ``outputs.embedding``, the pooled vector."""
    outputs: EmbeddingOutput
    output_cls: ClassVar[type] = EmbeddingOutput


@dataclass
class ClassificationRequestOutput(_ListRequestOutput):
    """A classification (``LLM.classify``): ``outputs.probs``, the classes' probabilities."""
    outputs: ClassificationOutput
    output_cls: ClassVar[type] = ClassificationOutput


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """A pair's score (``LLM.score``): the cosine of their embeddings, or a cross-encoder's
    output for the two texts read together."""
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]          # the first text's, then the second's
    finished: bool = True

    @classmethod
    def from_cross_encoder(cls, out: PoolingRequestOutput) -> "ScoringRequestOutput":
        return cls(out.request_id, ScoringOutput(out.outputs.data.item()), out.prompt_token_ids, out.finished)

    @classmethod
    def from_pair(cls, request_id: str, first: PoolingRequestOutput,
                  second: PoolingRequestOutput) -> "ScoringRequestOutput":
        score = torch.nn.functional.cosine_similarity(first.outputs.data, second.outputs.data, dim=0).item()
        return cls(request_id, ScoringOutput(score), first.prompt_token_ids + second.prompt_token_ids)
