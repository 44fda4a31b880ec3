"""What a pooling request asks for (``LLM.embed`` / ``classify`` / ``score`` / ``encode``, the
server's embeddings, classify, score and rerank routes), with vLLM's names. The model's pooler
config (``PoolerConfig``) says how its hidden states become one vector; these adjust it per
request."""
from dataclasses import dataclass, replace

from pagoda.outputs import PoolingRequestOutput, ScoringRequestOutput


POOLING_TASKS = ("embed", "classify", "score", "token_embed", "token_classify")


@dataclass
class PoolingParams:
    dimensions: int | None = None            # keep the first k dimensions (Matryoshka), before normalizing
    normalize: bool | None = None            # None: the pooler config's (True for embeddings)
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: max_model_len)
    # The output's activation: L2 normalization of an embedding, softmax (sigmoid for one label)
    # of a classifier's logits. None: on (for embeddings, ``normalize`` / the pooler config's).
    use_activation: bool | None = None
    # What the caller expects ("embed", "classify", "score"; set by LLM's methods and the server's
    # routes): the engine refuses a model that does not give it. None: whatever the model gives.
    # The token-level tasks ("token_embed", "token_classify", LLM.encode's pooling_task) give a
    # row for every prompt token instead of one vector.
    task: str | None = None

    def __post_init__(self):
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be at least 1, got {self.dimensions}.")
        if self.truncate_prompt_tokens is not None and (self.truncate_prompt_tokens < 1
                                                        and self.truncate_prompt_tokens != -1):
            raise ValueError(f"truncate_prompt_tokens must be at least 1 (or -1), got {self.truncate_prompt_tokens}.")
        if self.task not in (None, *POOLING_TASKS):
            raise ValueError(f"Unknown pooling task {self.task!r}; choose one of {', '.join(POOLING_TASKS)}.")

    @property
    def is_token_task(self) -> bool:
        return self.task in ("token_embed", "token_classify")

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


def cross_encoder_prompt(tokenizer, first, second) -> dict:
    """A pair's input to a cross-encoder: two texts encoded together, as transformers encodes a
    ``text_pair`` (the tokenizer's pair template); two token-id prompts joined as they are."""
    texts = [p.get("prompt") if isinstance(p, dict) else p for p in (first, second)]
    if all(isinstance(t, str) for t in texts):
        if tokenizer is None:
            raise ValueError("Scoring texts needs the tokenizer (skip_tokenizer_init=False); or pass token ids.")
        return {"prompt_token_ids": tokenizer.encode(texts[0], pair=texts[1])}
    ids = [p.get("prompt_token_ids") if isinstance(p, dict) else None for p in (first, second)]
    if all(i is not None for i in ids):
        return {"prompt_token_ids": list(ids[0]) + list(ids[1])}
    raise ValueError("A cross-encoder's pair is two texts or two token-id prompts ({'prompt_token_ids': [...]}), "
                     "not one of each.")


def score_prompts(pooling_task: str, tokenizer, first: list, second: list) -> list:
    """What the engine runs to score the pairs: each pair read together by a cross-encoder
    (a classifier), or for an embedding model each text alone, the first ones then the second."""
    if pooling_task == "classify":
        return [cross_encoder_prompt(tokenizer, a, b) for a, b in zip(first, second)]
    return first + second


def pair_scores(outputs: list[PoolingRequestOutput], num_pairs: int) -> list[ScoringRequestOutput]:
    """The pairs' scores from the outputs of ``score_prompts``' prompts: a cross-encoder's one
    output a pair, or the cosine of the pair's two embeddings."""
    if len(outputs) == num_pairs:
        return [ScoringRequestOutput.from_cross_encoder(o) for o in outputs]
    return [ScoringRequestOutput.from_pair(str(i), a, b)
            for i, (a, b) in enumerate(zip(outputs[:num_pairs], outputs[num_pairs:]))]
