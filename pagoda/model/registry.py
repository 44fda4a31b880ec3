"""Architecture name (config.json's ``architectures[0]``) -> model class."""
from torch import nn

from pagoda.model.llama import (ExaoneForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration,
                                GraniteMoeForCausalLM, GraniteMoeSharedForCausalLM, LlamaForCausalLM,
                                LlamaForSequenceClassification, MixtralForCausalLM, Qwen3ForCausalLM,
                                Qwen3ForSequenceClassification)

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,     # q/k/v biases come from config.attention_bias
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,      # its q/k/v and gate/up come fused (loader: checkpoint_shards)
    "GraniteForCausalLM": LlamaForCausalLM,   # (its multipliers: ArchConfig)
    "SmolLM3ForCausalLM": LlamaForCausalLM,   # (its layers without a rotary embedding: ArchConfig)
    "GemmaForCausalLM": LlamaForCausalLM,     # (Gemma's norms, GELU, embedding scale: ArchConfig)
    "Gemma2ForCausalLM": LlamaForCausalLM,    # (and its sublayers' output norms, windows, tanh caps)
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,   # (its text model, text prompts)
    "ExaoneForCausalLM": ExaoneForCausalLM,   # (Llama under GPT-2's tensor names)
    "InternLM3ForCausalLM": LlamaForCausalLM,  # (Llama's, its qkv_bias: ArchConfig)
    "Olmo2ForCausalLM": LlamaForCausalLM,     # (its output-only norms, whole q/k norms: ArchConfig)
    "Olmo3ForCausalLM": LlamaForCausalLM,     # (and OLMo 2's, sliding windows on three layers of four)
    # mixtures of experts
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3ForCausalLM,
    "GraniteMoeForCausalLM": GraniteMoeForCausalLM,
    "GraniteMoeSharedForCausalLM": GraniteMoeSharedForCausalLM,
    # (the pooling runner's: LLM.classify / LLM.score)
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "MistralForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": LlamaForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"Model architecture {architecture!r} is not supported. "
                         f"Supported architectures: {sorted(_MODELS)}.") from None


def supported_architectures() -> list[str]:
    return sorted(_MODELS)
