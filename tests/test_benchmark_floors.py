"""The benchmarks' floors (benchmarks/common.py) count what a step must run, checked against the
model pagoda builds (on the meta device) from each benchmark config: the decoder's parameters a
token runs through (a mixture of experts': the router and top_k experts a layer), and the bytes
of weights a step reads (of an MoE, its tokens' experts: top_k for one token, all for many)."""
import json
import os
import sys

import pytest
import torch

from pagoda.config import ArchConfig
from pagoda.model.registry import get_model_class

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
import common  # noqa: E402


# (besides the benchmark configs: a Qwen2-MoE with a shared expert and a dense layer, q/k/v biases
# left out of the count)
QWEN2_MOE = dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", qkv_bias=False, vocab_size=1000,
                 hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, mlp_only_layers=[1])


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama3-8b", "qwen3-30b-a3b", "qwen2-moe"])
def test_floors_count_the_built_model(name):
    if name == "qwen2-moe":
        cfg = QWEN2_MOE
    else:
        with open(os.path.join(BENCHMARKS, "models", f"{name}.json")) as f:
            cfg = json.load(f)
    arch = ArchConfig.from_hf_dict(cfg)
    with torch.device("meta"):
        model = get_model_class(arch.architecture)(arch)
    params = {n: p.numel() for n, p in model.named_parameters() if ".layers." in n and not n.endswith("norm.weight")}
    experts = sum(v for n, v in params.items() if ".experts." in n)
    assert (experts > 0) == (arch.num_experts > 0)
    every = sum(params.values())
    k, e = arch.num_experts_per_tok, max(1, arch.num_experts)
    layers, head = common.param_counts(cfg)
    assert layers == every - experts + experts * k // e
    assert head == arch.hidden_size * arch.vocab_size
    assert common.weight_bytes(cfg, 1) == pytest.approx(2 * (layers + head))
    assert common.weight_bytes(cfg, 10 ** 6) == pytest.approx(2 * (every + head))


@pytest.mark.parametrize("quantization", sorted(common.DUMMY_QUANT_CONFIGS))
def test_dummy_quantization_configs_load_and_count_their_bytes(quantization):
    """W5's dummy checkpoints: each quantization_config is one pagoda loads as that method, and the
    floors count its bytes a weight (8-bit: one; 4-bit in groups of 128: half, plus a bf16 scale
    and zero a group)."""
    from pagoda.quant.base import resolve_quantization
    from pagoda.quant.w8 import weight_dtype
    with open(os.path.join(BENCHMARKS, "models", "llama3-8b.json")) as f:
        cfg = json.load(f)
    quantized = common.model_config(os.path.join(BENCHMARKS, "models", "llama3-8b.json"), quantization)
    method, qc = resolve_quantization(None, quantized["quantization_config"], "dummy")
    assert qc is quantized["quantization_config"]
    eight_bit = method in ("fp8", "compressed-tensors")
    if eight_bit:
        assert weight_dtype(method, qc) == (torch.int8 if quantization == "w8a8" else torch.float8_e4m3fn)
    layers, head = common.param_counts(cfg)
    per_weight = 1 if eight_bit else 0.5 + 4 / 128
    assert common.weight_bytes(quantized) == pytest.approx(per_weight * layers + 2 * head)
