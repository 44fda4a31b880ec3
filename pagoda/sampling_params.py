"""Sampling parameters, with vLLM's names, defaults and validation."""
import enum
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0     # every output holds everything so far
    DELTA = 1          # every output holds only what is new
    FINAL_ONLY = 2     # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """vLLM's constraint on an answer (``SamplingParams(structured_outputs=...)``): exactly one of
    a JSON schema (a dict or its JSON text), any JSON object, a regex, one of several strings,
    or a Lark grammar (llguidance's dialect)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False     # JSON: no whitespace but ", " and ": " (else any)

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar or json_object; "
                             f"got {given or 'none'}.")
        if self.choice is not None and not all(isinstance(c, str) for c in self.choice):
            raise ValueError("structured_outputs.choice must be a list of strings.")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None     # sample only among these (vLLM's)
    bad_words: list[str] | None = None             # words never generated (vLLM's)
    truncate_prompt_tokens: int | None = None      # keep the prompt's last k tokens (-1: max_model_len)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine: every token id that ends the request (EOS + stop_token_ids).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the engine: each bad word's token ids, with and without a space before it.
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the filters would only cost time, so neutralise them as vLLM does.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self):
        def check(ok: bool, msg: str):
            if not ok:
                raise ValueError(msg)
        check(isinstance(self.n, int) and self.n >= 1, f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            check(self.best_of >= self.n, f"best_of must be >= n, got best_of={self.best_of}, n={self.n}.")
        check(-2.0 <= self.presence_penalty <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(self.repetition_penalty > 0.0,
              f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(isinstance(self.top_k, int) and self.top_k >= 0,
              f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens,
                  f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.")
        if self.logprobs is not None:
            check(self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None:
            check(self.prompt_logprobs >= 0, f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings.")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}.")
        if self.seed is not None:
            check(isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}.")
        if self.allowed_token_ids is not None:
            check(bool(self.allowed_token_ids) and all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                  f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids}.")
        if self.bad_words is not None:
            check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
                  f"bad_words must be non-empty strings, got {self.bad_words}.")
        if self.truncate_prompt_tokens is not None:
            check(isinstance(self.truncate_prompt_tokens, int) and (self.truncate_prompt_tokens == -1
                                                                    or self.truncate_prompt_tokens >= 1),
                  f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}.")

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self) -> "SamplingParams":
        # Not deepcopy (45 us a call on the development CPU, 4x this; two calls a request). The
        # containers hold only ints, floats and strings, so copying them suffices.
        new = object.__new__(type(self))
        new.__dict__.update({k: type(v)(v) if isinstance(v, (list, dict, set)) else v
                             for k, v in self.__dict__.items()})
        return new


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}.")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
