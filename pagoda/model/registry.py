"""Architecture name (config.json's ``architectures[0]``) -> model class."""
from torch import nn

from pagoda.model.llama import LlamaForCausalLM, Qwen3ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,     # q/k/v biases come from config.attention_bias
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"Model architecture {architecture!r} is not supported. "
                         f"Supported architectures: {sorted(_MODELS)}.") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
