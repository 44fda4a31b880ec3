"""Llama-family decoder: Llama 2/3 (and Mistral, Phi-3, Granite's scalings, SmolLM3's NoPE
layers), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm), their mixtures of experts
(Mixtral, Qwen2-MoE, Qwen3-MoE: the config's experts replace the MLP), Gemma 1-3 (norms of
their own, GELU, each sublayer's output normed too, sliding windows on some layers) and OLMo 2/3
(only the sublayers' outputs normed, q/k norms over the whole projections). One definition
with a few switches (``ArchConfig``'s), since they differ in nothing else; with an LM head
(generation) or a classification head (sequence classification, cross-encoders)."""
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.config import ArchConfig, class_labels
from pagoda.distributed.parallel_state import get_pp_group
from pagoda.kernels.reference import Rope
from pagoda.model.layers.activation import act_and_mul
from pagoda.model.layers.attention import Attention
from pagoda.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.model.layers.layernorm import HeadShardedRMSNorm, RMSNorm
from pagoda.model.layers.fused_moe import FusedMoE
from pagoda.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear,
                                        RowParallelLinear)
from pagoda.model.layers.rotary import RotaryEmbedding
from pagoda.model.pipeline import IntermediateTensors, PPMissingLayer, make_layers
from pagoda.quant.base import QuantMethod


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, rope: RotaryEmbedding | None, qk_norm: bool, quant: QuantMethod | None,
                 sliding_window: int = 0):
        """``rope`` None: a layer without a rotary embedding (SmolLM3's NoPE layers)."""
        super().__init__()
        assert rope is not None or not qk_norm, "the q/k norms ride with the rotary embedding"
        self.head_dim = cfg.head_dim
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.attention_bias,
                                          quant_method=quant)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=False, quant_method=quant)
        self.rotary_emb = rope
        self.attn = Attention(self.num_heads, cfg.head_dim, cfg.attention_multiplier or cfg.head_dim ** -0.5,
                              self.num_kv_heads, sliding_window, cfg.attn_logit_softcapping)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        self.qk_norm_whole = cfg.qk_norm_whole
        if cfg.qk_norm_whole:
            self.q_norm = HeadShardedRMSNorm(self.q_size, cfg.rms_norm_eps)
            self.k_norm = HeadShardedRMSNorm(self.kv_size, cfg.rms_norm_eps, self.qkv_proj.kv_replicas)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:   # (OLMo's: before the rotary embedding, over all heads: a kernel each)
            q, k = self.q_norm(q), self.k_norm(k)
        # The rotary embedding and the per-head norms are applied by the attention backend (on
        # the GPU inside its KV-write and attention kernels: no kernels of their own).
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.unit_offset) \
            if self.qk_norm else ()
        rope = None if self.rotary_emb is None else Rope(positions, self.rotary_emb.cos_sin_cache, *norms)
        return self.o_proj(self.attn(q, k, v, rope))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [intermediate_size] * 2, quant_method=quant)
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, quant_method=quant)
        self.act_fn = act_and_mul(cfg.hidden_act)
        self.act_fn.feeds(self.down_proj)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaMoE(nn.Module):
    """A sparse mixture of experts in the MLP's place (Mixtral, Qwen2/3-MoE): the router (``gate``,
    replicated on every rank) scores the experts for each token. Qwen2-MoE adds a shared expert,
    an MLP every token runs through, scaled by a sigmoid gate of its own (Granite MoE Shared's
    is added as it is)."""

    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None):
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, cfg.norm_topk_prob, quant)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(cfg, quant, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gated:
                self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + (shared if self.shared_expert_gate is None else torch.sigmoid(self.shared_expert_gate(x)) * shared)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer: int, rope: RotaryEmbedding, qk_norm: bool, quant: QuantMethod | None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rope if cfg.uses_rope(layer) else None, qk_norm, quant,
                                        cfg.window(layer))
        self.mlp = LlamaMoE(cfg, quant) if cfg.is_moe_layer(layer) else LlamaMLP(cfg, quant)

        def norm():
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.rms_norm_unit_offset)
        # Gemma 2/3 norm each sublayer's output as well: its post_attention_layernorm is that
        # of the attention's, and pre_feedforward_layernorm the MLP's input norm, which Llama's
        # post_attention_layernorm is. OLMo 2/3 norm only the outputs: post_attention_layernorm
        # and post_feedforward_layernorm.
        self.post_norms_only = cfg.post_norms_only
        self.post_attention_layernorm = norm()
        if self.post_norms_only:
            self.post_feedforward_layernorm = norm()
            return
        self.input_layernorm = norm()
        mlp_norm = self.post_attention_layernorm
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
            mlp_norm = self.pre_feedforward_layernorm
        self.residual_multiplier = cfg.residual_multiplier   # (Granite's; 1.0 elsewhere)
        # (W8A8: the norms hand their matmuls rows already quantized; not a mixture's router)
        self.input_layernorm.feeds(self.self_attn.qkv_proj)
        if isinstance(self.mlp, LlamaMLP):
            mlp_norm.feeds(self.mlp.gate_up_proj)

    def forward(self, positions, hidden, residual):
        if self.post_norms_only:   # (the stream is hidden + residual, as the next layer's fused add takes it)
            x = hidden if residual is None else hidden + residual
            x = x + self.post_attention_layernorm(self.self_attn(positions, x))
            return self.post_feedforward_layernorm(self.mlp(x)), x
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, qk_norm: bool, quant: QuantMethod | None):
        super().__init__()
        pp = get_pp_group()
        self.is_first_stage, self.is_last_stage = pp.is_first_rank, pp.is_last_rank
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if pp.is_first_rank \
            else PPMissingLayer()
        # One cos/sin table for all layers (Gemma 3: another for its sliding layers), owned by
        # the model: freed with it.
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim)
        local_rope = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.local_rope_theta, rotary_dim=cfg.rotary_dim) \
            if cfg.local_rope_theta else rope

        def layer(i):
            return LlamaDecoderLayer(cfg, i, local_rope if cfg.local_layer(i) else rope, qk_norm, quant)
        self.start_layer, self.end_layer, self.layers = make_layers(
            cfg.num_hidden_layers, pp.rank_in_group, pp.world_size, layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.rms_norm_unit_offset) if pp.is_last_rank \
            else PPMissingLayer()
        # (Granite's and Gemma's; 1.0 elsewhere) rounded to the model's dtype, as HF's Gemma does
        self.embedding_multiplier = torch.tensor(cfg.embedding_multiplier, dtype=torch.get_default_dtype(),
                                                 device="cpu").item()
        # The decoder layers this stage runs (all of them without pipeline parallelism), as a
        # tuple: iterating it costs no more than iterating the ModuleList did.
        self.local_layers = tuple(self.layers[self.start_layer:self.end_layer])

    def forward(self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None):
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
        else:
            hidden, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        for layer in self.local_layers:
            hidden, residual = layer(positions, hidden, residual)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states=hidden, residual=residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class _LlamaDecoder(nn.Module):
    """The decoder stack and what its final hidden states feed: an LM head, or a classifier."""
    # checkpoint name -> (our fused parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    qk_norm = False

    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None = None):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, self.qk_norm, quant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None):
        """The final hidden states on the last pipeline stage; on the others, the activations
        for the next stage."""
        return self.model(input_ids, positions, intermediate_tensors)

    def load_weights(self, weights) -> set[str]:
        """vLLM's model API for weight updates (RL): (name, tensor) pairs by the checkpoint's
        names, any subset, into this rank's shard; the others keep their values. Returns the
        parameters loaded. (Unquantized weights: a quantized layer's are repacked at load.)"""
        from pagoda.model.loader import load_weights
        return load_weights(self, iter(weights), strict=False)


class LlamaForCausalLM(_LlamaDecoder):
    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None = None):
        super().__init__(cfg, quant)
        pp = get_pp_group()
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if pp.is_last_rank else PPMissingLayer()
        if cfg.tie_word_embeddings and pp.world_size == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits on the tensor-parallel driver (None on the other ranks: they are gathered
        there), Granite's scaling and Gemma 2's cap applied."""
        logits = self.lm_head.compute_logits(hidden)
        if logits is None:
            return None
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if cap := self.config.final_logit_softcapping:    # (Gemma 2's)
            logits = torch.tanh(logits / cap) * cap
        return logits


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model: per-head q/k norms (Gemma's kind) and the rest of Gemma 2."""
    qk_norm = True


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3's multimodal checkpoints (4B, 12B, 27B) as their text model, for text prompts: its
    tensors under the prefix transformers saves them with (or the one it loads them as), the
    vision tower's and the projector's never read (ArchConfig reads the text_config)."""
    checkpoint_prefixes = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                           "model.language_model.": "model.", "vision_tower.": None, "multi_modal_projector.": None,
                           "model.vision_tower.": None, "model.multi_modal_projector.": None}


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention, every MLP a mixture of experts (``block_sparse_moe``, whose
    experts name their projections w1 (gate), w3 (up) and w2 (down))."""
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping, "block_sparse_moe": ("mlp", None),
                              "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}


class GraniteMoeForCausalLM(LlamaForCausalLM):
    """IBM Granite 3's mixtures of experts (granite-3.x-1b-a400m, 3b-a800m): Granite's scalings,
    every MLP a mixture whose checkpoint stacks the experts (``input_linear`` (E, 2I, H): gate
    then up; ``output_linear`` (E, H, I)) and names the router ``router.layer``; the top k
    logits' softmax weighs the experts, as Mixtral's renormalised weights do."""
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping, "block_sparse_moe": ("mlp", None),
                              "router.layer": ("gate", None)}

    @staticmethod
    def checkpoint_weights(weights):
        """The stacked experts as an expert's gate, up and down at a time (a layout, which the
        names' mapping cannot express); Granite MoE Shared's ``shared_mlp`` (its gate and up
        stacked in ``input_linear`` too) as the shared expert's."""
        for name, tensor in weights:
            layer, _, rest = name.partition(".block_sparse_moe.")
            if rest == "input_linear.weight":
                for e, w in enumerate(tensor):
                    gate, up = w.chunk(2)
                    yield f"{layer}.block_sparse_moe.experts.{e}.gate_proj.weight", gate
                    yield f"{layer}.block_sparse_moe.experts.{e}.up_proj.weight", up
            elif rest == "output_linear.weight":
                for e, w in enumerate(tensor):
                    yield f"{layer}.block_sparse_moe.experts.{e}.down_proj.weight", w
            elif name.endswith(".shared_mlp.input_linear.weight"):
                gate, up = tensor.chunk(2)
                layer = name.removesuffix(".shared_mlp.input_linear.weight")
                yield f"{layer}.mlp.shared_expert.gate_proj.weight", gate
                yield f"{layer}.mlp.shared_expert.up_proj.weight", up
            elif name.endswith(".shared_mlp.output_linear.weight"):
                yield name.replace(".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."), tensor
            else:
                yield name, tensor


class GraniteMoeSharedForCausalLM(GraniteMoeForCausalLM):
    """Granite MoE with a shared expert (``shared_mlp``: an MLP every token runs through, added to
    the experts' sum without a gate)."""


class ExaoneForCausalLM(LlamaForCausalLM):
    """LG's EXAONE 3.0 / 3.5: Llama's model under GPT-2's names (``transformer.h.N.attn.attention``,
    ``ln_1``, ``mlp.c_fc_0``, ...): the stored prefixes and module names mapped to Llama's, as every
    model's are (so a pipeline stage's skipped tensors and a quantized checkpoint's unquantized
    layers are known by them too)."""
    checkpoint_prefixes = {"transformer.wte.": "model.embed_tokens.", "transformer.h.": "model.layers.",
                           "transformer.ln_f.": "model.norm."}
    packed_modules_mapping = {**LlamaForCausalLM.packed_modules_mapping, "attn.attention": ("self_attn", None),
                              "out_proj": ("o_proj", None), "ln_1": ("input_layernorm", None),
                              "ln_2": ("post_attention_layernorm", None), "c_fc_0": ("gate_up_proj", 0),
                              "c_fc_1": ("gate_up_proj", 1), "c_proj": ("down_proj", None)}


class LlamaForSequenceClassification(_LlamaDecoder):
    """HF's ``*ForSequenceClassification``: the classes' logits from a final hidden state by
    ``score`` (hidden -> num_labels, no bias) instead of an LM head. The pooling runner applies
    it to the last token's state; with one label the model is a cross-encoder (a reranker)."""

    def __init__(self, cfg: ArchConfig, quant: QuantMethod | None = None):
        super().__init__(cfg, quant)
        # (small: replicated on every tensor-parallel rank; on the last pipeline stage only)
        self.score = nn.Linear(cfg.hidden_size, len(class_labels(cfg)), bias=False) \
            if get_pp_group().is_last_rank else PPMissingLayer()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The classes' logits, in float32 (no collective: each rank has the whole head)."""
        return F.linear(hidden.float(), self.score.weight.float())


class Qwen3ForSequenceClassification(LlamaForSequenceClassification):
    qk_norm = True
