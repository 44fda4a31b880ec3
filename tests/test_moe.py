"""Mixtures of experts beyond one process (tests/test_architectures.py checks Mixtral, Qwen2-MoE
and Qwen3-MoE against HF transformers): every expert's intermediate size (and Qwen2-MoE's shared
expert) split over two tensor-parallel ranks, or the experts shared out whole between them
(expert parallelism), the MoE and the dense layer of a Qwen3-MoE on two pipeline stages, dummy
weights from a config alone, and what is refused by name."""
import gc
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import ArchConfig, ParallelConfig
from tests.test_architectures import BASE, save_tiny
from tests.test_tensor_parallel import GREEDY, PROMPTS, SEEDED, SMALL, assert_same, outputs_at, run


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """Two layers: layer 0 a mixture of 8 experts (top 3), layer 1 a dense MLP (mlp_only_layers)."""
    folder, _ = save_tiny(tmp_path_factory.mktemp("moe"), "qwen3_moe")
    return folder


@pytest.fixture(scope="module")
def reference(qwen3_moe):
    return outputs_at(qwen3_moe, 1)


def test_tp2_equals_tp1(qwen3_moe, reference):
    assert_same(reference, outputs_at(qwen3_moe, 2))


def test_shared_expert_tp2_equals_tp1(tmp_path):
    """Qwen2-MoE: the shared expert split as a dense MLP, its gate replicated."""
    folder, _ = save_tiny(tmp_path, "qwen2_moe")
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


@pytest.mark.parametrize("arch", ["granitemoe", "granitemoeshared"])
def test_granite_moe_stacked_experts_tp2_equals_tp1(tmp_path, arch):
    """Granite 3's MoE: the stacked experts' tensors cut into each expert's gate, up and down,
    each rank then taking its half of every expert's intermediate size (and of the shared MLP's,
    whose gate and up are stacked too)."""
    folder, _ = save_tiny(tmp_path, arch)
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2))


def experts_held(worker):
    """(first expert, experts, intermediate size) of the rank's first MoE layer, and the ids of its
    experts that its map sends tokens to."""
    moe = worker.runner.model.model.layers[0].mlp.experts
    held = (moe.expert_map >= 0).nonzero().flatten().tolist() if moe.expert_map is not None else None
    return moe.first_expert, tuple(moe.w13_weight.shape), held


def test_expert_parallel_tp2_equals_tp1(qwen3_moe, reference):
    """Each rank holds 4 of the 8 experts whole (not half of every expert's intermediate size) and
    the all-reduce adds the two shares: the one-process outputs, greedy and sampled."""
    llm = LLM(qwen3_moe, tensor_parallel_size=2, enable_expert_parallel=True, **SMALL)
    try:
        assert llm.collective_rpc(experts_held) == [(0, (4, 64, 64), [0, 1, 2, 3]), (4, (4, 64, 64), [4, 5, 6, 7])]
        assert_same(reference, (llm.generate(PROMPTS, GREEDY, use_tqdm=False), run(llm, SEEDED)))
    finally:
        del llm
        gc.collect()


def test_expert_parallel_with_a_shared_expert(tmp_path):
    """Qwen2-MoE: the routed experts shared out, the shared expert still split as a dense MLP."""
    folder, _ = save_tiny(tmp_path, "qwen2_moe")
    assert_same(outputs_at(folder, 1), outputs_at(folder, 2, enable_expert_parallel=True))


def test_expert_parallel_layout_checks():
    """Experts must share out evenly; their intermediate size then need not split."""
    arch = ArchConfig.from_hf_dict(dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=30))
    ParallelConfig(2, enable_expert_parallel=True).verify(arch, "cpu")
    with pytest.raises(ValueError, match="intermediate size 30 is not divisible by tensor_parallel_size=4"):
        ParallelConfig(4).verify(arch, "cpu")
    with pytest.raises(ValueError, match="model's 6 experts out over tensor_parallel_size=4 ranks"):
        ParallelConfig(4, enable_expert_parallel=True).verify(arch, "cpu")


def test_pp2_equals_pp1(qwen3_moe, reference):
    """The MoE layer on the first stage, the dense one on the last: each builds its own layer's kind."""
    assert_same(reference, outputs_at(qwen3_moe, 1, pipeline_parallel_size=2))


def test_dummy_weights_from_a_config(tmp_path):
    cfg = dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16, num_experts=16,
               num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), load_format="dummy", **SMALL)
    layers = llm.llm_engine.executor.runner.model.model.layers
    assert [type(layer.mlp).__name__ for layer in layers] == ["LlamaMLP", "LlamaMoE"]   # every 2nd layer
    assert tuple(layers[1].mlp.experts.w13_weight.shape) == (16, 64, 64)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


@pytest.mark.parametrize("case,block,compressed", [("qwen3_moe", (16, 32), False), ("qwen2_moe", (16, 16), False),
                                                  ("qwen3_moe", (16, 32), True)])
def test_block_fp8_experts_match_their_dequantized_weights(tmp_path, case, block, compressed):
    """A block-wise FP8 checkpoint of a mixture of experts (Qwen3-30B-A3B-FP8's format, or
    compressed-tensors' FP8_BLOCK): its experts stay FP8 with their block scales and give the
    outputs of the same model holding the dequantized weights."""
    from tests.quant_utils import fp8_block_folder
    from tests.test_quant_w8 import same_outputs
    folder, _ = save_tiny(tmp_path, case)
    path = fp8_block_folder(folder, str(tmp_path / "fp8b"), block, compressed)
    same_outputs(path, path + "-dequant")
    llm = LLM(path, **SMALL)
    model = llm.llm_engine.executor.runner.model
    experts = model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w2_weight_scale_inv.shape[1:] == (
        64 // block[0], 32 // block[1])
    # A weight update (RL) reads the checkpoint's own names: compressed-tensors' weight_scale too
    from pagoda.model.loader import iter_safetensors
    assert "model.layers.0.mlp.experts.w2_weight_scale_inv:(3, None)" in model.load_weights(iter_safetensors(path))


@pytest.mark.parametrize("static", [False, True])
def test_per_tensor_fp8_experts_match_their_dequantized_weights(tmp_path, static):
    """vLLM's FP8 checkpoints of a mixture of experts: a scale per tensor (each expert's gate and
    up their own), filling the stacked per-row scales; static activation scales read, unused."""
    from tests.quant_utils import fp8_folder
    from tests.test_quant_w8 import same_outputs
    folder, _ = save_tiny(tmp_path, "qwen3_moe")
    path = fp8_folder(folder, str(tmp_path / "fp8"), static=static)
    same_outputs(path, path + "-dequant")
    experts = LLM(path, **SMALL).llm_engine.executor.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn and experts.w13_weight_scale.shape == (8, 64, 1)
    assert experts.w13_weight_scale[0, 0] != experts.w13_weight_scale[0, 32]     # gate's scale, then up's


@pytest.mark.parametrize("case,kind,strategy", [("qwen3_moe", "int", "channel"), ("qwen2_moe", "int", "tensor"),
                                                ("qwen3_moe", "float", "channel")])
def test_compressed_tensors_experts_match_their_dequantized_weights(tmp_path, case, kind, strategy):
    """llm-compressor's INT8 (W8A8) and FP8 checkpoints of a mixture of experts, the routers in
    its ``ignore`` list as its MoE recipes put them: the experts stay 8-bit, a scale a row, and
    the model gives the outputs of the same model holding the dequantized weights."""
    from tests.quant_utils import compressed_folder
    from tests.test_quant_w8 import same_outputs
    folder, _ = save_tiny(tmp_path, case)
    path = compressed_folder(folder, str(tmp_path / "ct"), kind, strategy, keep=("re:.*mlp.gate$",))
    same_outputs(path, path + "-dequant")
    experts = LLM(path, **SMALL).llm_engine.executor.runner.model.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == (torch.int8 if kind == "int" else torch.float8_e4m3fn)
    assert experts.w2_weight_scale.shape[1:] == (64, 1)


def test_fp8_at_load_quantizes_each_experts_rows(tmp_path):
    """quantization="fp8" on a bf16 mixture of experts: every expert's rows as FP8 over a scale of
    their own (``quant.w8.quantize_rows``); the model equals one holding those weights dequantized."""
    from safetensors.torch import load_file, save_file

    from pagoda.quant.w8 import quantize_rows
    from tests.test_quant_w8 import same_outputs
    folder, _ = save_tiny(tmp_path, "qwen2_moe")
    twin = tmp_path / "twin"
    twin.mkdir()
    weights = load_file(os.path.join(folder, "model.safetensors"))
    for name, w in weights.items():
        if name.endswith("_proj.weight"):       # (attention, experts, shared expert; not the routers)
            q, scale = quantize_rows(w)
            weights[name] = q.float() * scale
    save_file(weights, str(twin / "model.safetensors"))
    (twin / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    same_outputs(folder, str(twin), quantization="fp8")


def test_block_fp8_experts_over_two_ranks(tmp_path):
    """tp=2 with each expert's intermediate size split (in whole blocks) and with the experts
    shared out; an intermediate size whose slices would cut blocks is refused by name."""
    from tests.quant_utils import fp8_block_folder
    folder, _ = save_tiny(tmp_path, "qwen3_moe")
    path = fp8_block_folder(folder, str(tmp_path / "fp8b"), (16, 16))
    one = outputs_at(path, 1)
    assert_same(one, outputs_at(path, 2))
    assert_same(one, outputs_at(path, 2, enable_expert_parallel=True))
    wide = fp8_block_folder(folder, str(tmp_path / "fp8w"), (16, 32))
    with pytest.raises(Exception, match="16 of each expert's intermediate size .this rank's. is not a whole number"):
        LLM(wide, tensor_parallel_size=2, **SMALL)


@pytest.mark.parametrize("case,method,kwargs", [("qwen3_moe", "gptq", dict()),
                                                 ("qwen3_moe", "gptq", dict(v2=True, desc_act=True)),
                                                 ("qwen2_moe", "awq", dict(group=16)),
                                                 ("qwen3_moe", "gptq", dict(bits=8, v2=True)),
                                                 ("qwen3_moe", "compressed-tensors",
                                                  dict(group=16, sym=False, desc_act=True)),
                                                 ("qwen2_moe", "compressed-tensors", dict(bits=8, group=None))],
                         ids=["gptq", "gptq-v2-act-order", "awq-shared-expert", "gptq-8bit", "w4a16-asym-act-order",
                              "w8a16-channel-shared-expert"])
def test_int4_experts_match_their_dequantized_weights(tmp_path, case, method, kwargs):
    """GPTQ / AWQ / compressed-tensors pack-quantized checkpoints of a mixture of experts
    (Qwen3-30B-A3B-GPTQ-Int4's format; Qwen2-MoE's shared expert quantized too, its routers
    not): the experts stay packed, and the model gives the outputs of the same model holding the
    dequantized weights."""
    from tests.quant_utils import quantize_folder
    from tests.test_quant_w8 import same_outputs
    folder, _ = save_tiny(tmp_path, case)
    path = quantize_folder(folder, str(tmp_path / method), method, **kwargs)
    same_outputs(path, path + "-dequant")
    experts = LLM(path, **SMALL).llm_engine.executor.runner.model.model.layers[0].mlp.experts
    pack = 32 // kwargs.get("bits", 4)
    assert experts.w13_qweight.dtype == torch.int32 and experts.w13_qweight.shape[1:] == (64 // pack, 64)
    assert (experts.w13_g_idx is not None) == kwargs.get("desc_act", False)


def test_int4_experts_over_two_ranks(tmp_path):
    """tp=2 with each expert's intermediate size split (in whole groups) and with the experts
    shared out; act-order checkpoints refused by name (a rank's slice of an input would need the
    checkpoint's order)."""
    from tests.quant_utils import quantize_folder
    folder, _ = save_tiny(tmp_path, "qwen3_moe")
    path = quantize_folder(folder, str(tmp_path / "gptq"), "gptq", group=16)
    one = outputs_at(path, 1)
    assert_same(one, outputs_at(path, 2))
    assert_same(one, outputs_at(path, 2, enable_expert_parallel=True))
    act = quantize_folder(folder, str(tmp_path / "act"), "gptq", group=16, v2=True, desc_act=True)
    with pytest.raises(Exception, match="with act-order .desc_act. do not split over tensor_parallel_size=2"):
        LLM(act, tensor_parallel_size=2, **SMALL)


def test_int4_experts_gate_and_up_act_orders_apart():
    """Under act-order each of an expert's gate and up projections keeps its own g_idx (the
    kernels read w13's halves' groups apart), loaded as GPTQ lays them out."""
    from pagoda.kernels.reference import fused_moe, select_experts
    from pagoda.model.layers.fused_moe import FusedMoE
    from pagoda.quant.int4 import Int4Config, Int4LinearMethod
    from tests.quant_utils import dequant, pack_cols, pack_gptq_qweight
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, group = 4, 64, 32, 16
    config = Int4Config.from_checkpoint("gptq", dict(bits=4, group_size=group, desc_act=True,
                                                     checkpoint_format="gptq_v2"))
    moe = FusedMoE(experts, 2, hidden, inter, renormalize=True, quant=Int4LinearMethod(config))
    params = dict(moe.named_parameters())
    dense = {}
    for e in range(experts):
        for proj, (k, n), shard in (("gate", (hidden, inter), (e, 0)), ("up", (hidden, inter), (e, 1)),
                                    ("down", (inter, hidden), (e, None))):
            q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
            zeros = torch.randint(0, 16, (k // group, n), generator=g, dtype=torch.int32)
            scales = torch.rand(k // group, n, generator=g) / 16
            g_idx = (torch.arange(k) // group)[torch.randperm(k, generator=g)].int()
            w = "w2" if proj == "down" else "w13"
            for name, t in (("qweight", pack_gptq_qweight(q, 4)), ("qzeros", pack_cols(zeros, 4)),
                            ("scales", scales), ("g_idx", g_idx)):
                moe.weight_loader(params[f"{w}_{name}"], t, shard)
            dense[proj, e] = dequant(q, zeros, scales, g_idx.long())
    moe.quant_method.process_weights_after_loading(moe)
    assert not torch.equal(moe.w13_g_idx[0, 0], moe.w13_g_idx[0, 1])
    w13 = torch.stack([torch.cat([dense["gate", e], dense["up", e]]) for e in range(experts)])
    w2 = torch.stack([dense["down", e] for e in range(experts)])
    x, logits = torch.randn(5, hidden, generator=g), torch.randn(5, experts, generator=g)
    weights, ids = select_experts(logits, 2, True)
    torch.testing.assert_close(moe(x, logits), fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    corrupt = FusedMoE(experts, 2, hidden, inter, renormalize=True, quant=Int4LinearMethod(config))
    for p in corrupt.parameters():
        p.data.zero_()
    corrupt.w2_g_idx.data[1, 5] = inter // group          # (one past its last group)
    with pytest.raises(ValueError, match="Corrupt GPTQ checkpoint: a g_idx entry is outside its layer's 2 groups"):
        corrupt.quant_method.process_weights_after_loading(corrupt)


def test_refused_by_name(qwen3_moe, tmp_path):
    with pytest.raises(ValueError, match="LoRA adapters on a mixture of experts"):
        LLM(qwen3_moe, enable_lora=True, **SMALL)
    from tests.quant_utils import quantize_folder
    mixed = quantize_folder(qwen3_moe, str(tmp_path / "mixed"), "gptq", keep=("model.layers.0.mlp.experts.3.down_proj",))
    with pytest.raises(NotImplementedError, match="stores the expert model.layers.0.mlp.experts.3.down_proj unquantized"):
        LLM(mixed, **SMALL)
    uneven = dict(BASE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=16, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=30)
    (tmp_path / "config.json").write_text(json.dumps(uneven))
    with pytest.raises(ValueError, match="intermediate size 30 is not divisible by tensor_parallel_size=4"):
        LLM(str(tmp_path), load_format="dummy", tensor_parallel_size=4, **SMALL)


def test_expert_parallel_from_the_command_line():
    import argparse
    from pagoda.entrypoints.cli import add_engine_args, engine_args_from
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_args_from(p.parse_args(["-tp", "2", "--enable-expert-parallel"])).enable_expert_parallel
    assert engine_args_from(p.parse_args(["-ep"])).enable_expert_parallel
    assert not engine_args_from(p.parse_args([])).enable_expert_parallel
