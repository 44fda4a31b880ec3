"""The OpenAI API's request bodies (with vLLM's extra sampling fields), validated by pydantic.
Responses are plain dicts in OpenAI's shapes, built by the serving classes."""
import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagoda.pooling_params import PoolingParams
from pagoda.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(BaseModel):
    """The fields completions and chat share; unknown fields are ignored, as vLLM does."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0                  # with --scheduling-policy priority: lower first (vLLM's)
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Structured outputs: OpenAI's response_format ({"type": "json_object"}, or "json_schema" with
    # {"json_schema": {"schema": ...}}), vLLM's structured_outputs ({"json" | "regex" | "choice" |
    # "grammar" | "json_object": ...}) and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """Raises ValueError (an HTTP 400) on values SamplingParams refuses. ``defaults``: the
        model's (ModelConfig.sampling_defaults), for the sampling fields the request leaves unset."""
        def given(name, fallback):
            value = getattr(self, name) if name != "max_tokens" else max_tokens
            return value if value is not None else defaults.get(name, fallback)
        return SamplingParams(
            n=self.n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", 0),
            min_p=given("min_p", 0.0), seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=given("repetition_penalty", 1.0),
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            ignore_eos=self.ignore_eos, max_tokens=given("max_tokens", None), min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured_outputs=self.structured(),
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    def structured(self) -> StructuredOutputsParams | None:
        """The request's constraint, from whichever field names it (a 400 if they are malformed)."""
        fields = dict(self.structured_outputs or {})
        for key in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{key}") is not None:
                fields[key] = getattr(self, f"guided_{key}")
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_object":
            fields["json_object"] = True
        elif kind == "json_schema":
            schema = (self.response_format.get("json_schema") or {}).get("schema")
            if schema is None:
                raise ValueError('response_format of type "json_schema" needs json_schema.schema.')
            fields["json"] = schema
        elif kind != "text":
            raise ValueError(f"Unknown response_format type {kind!r}; known: text, json_object, json_schema.")
        known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
        unknown = set(fields) - set(known)
        if unknown:
            raise ValueError(f"Unknown structured_outputs field(s) {sorted(unknown)}; known: {', '.join(known)}.")
        return StructuredOutputsParams(**fields) if fields else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def sampling_params(self, defaults: dict) -> SamplingParams:
        return self.to_sampling_params(self.max_tokens, self.logprobs, defaults)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None    # "none", "auto" (the default with tools), ...
    parallel_tool_calls: bool = True

    def sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.to_sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's extra ones)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens, task="embed")


class ScoreRequest(BaseModel):
    """POST /v1/score (vLLM's): ``text_1`` (one text, or as many as ``text_2``) against ``text_2``."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, as Jina's and Cohere's): the documents
    ordered by their score against the query, the best ``top_n`` (0: all)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ClassificationRequest(BaseModel):
    """POST /classify (vLLM's; also /v1/classify): each input's class probabilities."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    user: str | None = None
    priority: int = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens, use_activation=self.use_activation,
                             task="classify")


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a ``prompt``, or chat ``messages`` rendered as a chat completion's."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None     # None: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text, special tokens kept."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class PoolingRequest(BaseModel):
    """POST /pooling (vLLM's): each input's output of the pooling ``task`` ("embed", "classify",
    "token_embed", "token_classify"; default: the model's), as LLM.encode gives it."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    priority: int = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize, use_activation=self.use_activation,
                             truncate_prompt_tokens=self.truncate_prompt_tokens, task=self.task)


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."""
    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's, with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)."""
    model_config = ConfigDict(extra="ignore")

    lora_name: str


def error_body(message: str, status: int, param: str | None = None) -> dict:
    """OpenAI's error shape, which its client reads the message from."""
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
