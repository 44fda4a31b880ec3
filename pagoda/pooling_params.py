"""What a pooling request asks for (``LLM.embed`` / ``LLM.encode``, ``/v1/embeddings``), with
vLLM's names. The model's pooler config (``PoolerConfig``) says how its hidden states become one
vector; these adjust it per request."""
from dataclasses import dataclass, replace


@dataclass
class PoolingParams:
    dimensions: int | None = None            # keep the first k dimensions (Matryoshka), before normalizing
    normalize: bool | None = None            # None: the pooler config's (True for embeddings)
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self):
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < 1
                                                        and self.truncate_prompt_tokens != -1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1 (or -1), got {self.truncate_prompt_tokens}.")

    def clone(self) -> "PoolingParams":
        return replace(self)


def score_pairs(first: list, second: list, names: tuple[str, str]) -> tuple[list, list]:
    """The texts scoring pairs (LLM.score, /v1/score): one first text against each second one,
    or as many of each, pairwise. ``names``: the two arguments', for the error."""
    if len(first) == 1:
        first = first * len(second)
    if not second or len(first) != len(second):
        raise ValueError(f"{names[0]} must be one text or as many as {names[1]} ({len(second)}); got {len(first)}.")
    return first, second
