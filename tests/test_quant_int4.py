"""GPTQ and AWQ checkpoints (4- and 8-bit weights in groups): the layers' unpacking against the
formats' definitions, whole tiny models against the same models with the dequantized weights,
the seed's quantization samples, and the errors for what is not supported."""
import json
import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.model.layers.linear import ReplicatedLinear
from pagoda.quant.int4 import Int4Config, Int4LinearMethod
from tests.quant_utils import AWQ_ORDER, pack_cols, pack_gptq_qweight, quantize_folder
from tests.test_architectures import save_tiny


@pytest.mark.parametrize("method,bits,v2,desc_act,k,group", [
    ("gptq", 4, False, False, 128, 32), ("gptq", 4, True, True, 128, 32), ("gptq", 8, True, False, 128, 32),
    ("gptq", 4, True, False, 96, 64), ("awq", 4, False, False, 128, 32)])
def test_layer_unpacks_as_the_format_defines(method, bits, v2, desc_act, k, group):
    """A layer given a checkpoint's tensors computes x @ W with W = (q - z) * s per group (GPTQ's
    last group may be partial: 96 inputs in groups of 64)."""
    n = 48
    groups = -(-k // group)
    g = torch.Generator().manual_seed(bits + 2 * v2)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (k, n), generator=g, dtype=torch.int32)
    zeros = torch.randint(1, top + 1, (groups, n), generator=g, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=g) + 0.5).half()
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    if method == "gptq":
        tensors = dict(qweight=pack_gptq_qweight(q, bits), qzeros=pack_cols(zeros if v2 else zeros - 1, bits),
                       scales=scales, g_idx=g_idx)
        qc = dict(bits=bits, group_size=group, desc_act=desc_act, checkpoint_format="gptq_v2" if v2 else "gptq")
    else:
        tensors = dict(qweight=pack_cols(q, bits, AWQ_ORDER), qzeros=pack_cols(zeros, bits, AWQ_ORDER),
                       scales=scales)
        qc = dict(w_bit=bits, q_group_size=group, zero_point=True, version="GEMM")
    layer = ReplicatedLinear(k, n, bias=False, quant_method=Int4LinearMethod(Int4Config.from_checkpoint(method, qc)))
    params = dict(layer.named_parameters())
    assert set(params) == set(tensors)
    for name, t in tensors.items():
        layer.weight_loader(params[name], t)
    layer.quant_method.process_weights_after_loading(layer)
    w = (q - zeros[g_idx.long()]).float() * scales[g_idx.long()].float()        # (K, N)
    x = torch.randn(5, k, generator=g)
    torch.testing.assert_close(layer(x), x @ w, rtol=1e-5, atol=1e-4)


CASES = [("llama3", "gptq", dict()), ("qwen3", "gptq", dict(v2=True, desc_act=True)),
         ("qwen2", "awq", dict()), ("llama3", "gptq", dict(bits=8, v2=True)),
         ("llama3", "compressed-tensors", dict()), ("qwen3", "compressed-tensors", dict(sym=False, desc_act=True)),
         ("qwen2", "compressed-tensors", dict(bits=8, group=None))]


@pytest.mark.parametrize("case,method,kwargs", CASES, ids=["llama3-gptq", "qwen3-gptq-v2-act-order",
                                                           "qwen2-awq", "llama3-gptq-8bit", "llama3-w4a16",
                                                           "qwen3-w4a16-asym-act-order", "qwen2-w8a16-channel"])
def test_quantized_model_matches_its_dequantized_weights(tmp_path, case, method, kwargs):
    """A tiny model's GPTQ / AWQ / compressed-tensors W4A16 checkpoint (fused q/k/v and gate/up
    loaded from their packed shards) gives the prompt logprobs and greedy tokens of the same model with the dequantized
    weights, unquantized."""
    folder, _ = save_tiny(tmp_path, case)
    quantized = quantize_folder(folder, str(tmp_path / f"{case}-{method}"), method, **kwargs)
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (6, 23)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = {}
    for tag, path in [("quantized", quantized), ("dense", quantized + "-dequant")]:
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
        if tag == "quantized":
            assert llm.llm_engine.config.model.quantization == method   # found in config.json
        outs[tag] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    for q, d in zip(outs["quantized"], outs["dense"]):
        assert q.outputs[0].token_ids == d.outputs[0].token_ids
        for pos, (lq, ld) in enumerate(zip(q.prompt_logprobs[1:], d.prompt_logprobs[1:]), 1):
            tok = q.prompt_token_ids[pos]
            assert abs(lq[tok].logprob - ld[tok].logprob) < 1e-4


def test_seed_samples_with_a_local_path(tmp_path):
    """The seed's AWQ and GPTQ samples, the model name swapped for a local folder (GPTQ's
    ``revision`` is for the hub, ignored for a folder)."""
    folder, _ = save_tiny(tmp_path, "llama3")
    awq = quantize_folder(folder, str(tmp_path / "awq"), "awq")
    gptq = quantize_folder(folder, str(tmp_path / "gptq"), "gptq")
    for llm in (LLM(model=awq, quantization="awq", dtype="float16", gpu_memory_utilization=0.9,
                    skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24),
                LLM(model=gptq, quantization="gptq", revision="gptq-4bit-32g-actorder_True",
                    skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)):
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, temperature=0.7, top_p=0.9),
                           use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 6
        del llm


def _edit_quant_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"].update(changes)
    with open(path, "w") as f:
        json.dump(config, f)


def test_quantization_errors_name_the_problem(tmp_path):
    folder, _ = save_tiny(tmp_path, "llama3")
    gptq = quantize_folder(folder, str(tmp_path / "gptq"), "gptq")
    small = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="quantization='awq'.*'gptq'"):
        LLM(gptq, quantization="awq", **small)
    with pytest.raises(ValueError, match="has no quantization config"):
        LLM(folder, quantization="gptq", **small)
    _edit_quant_config(gptq, bits=3)
    with pytest.raises(ValueError, match="3 bits are not supported"):
        LLM(gptq, **small)
    awq = quantize_folder(folder, str(tmp_path / "awq"), "awq")
    _edit_quant_config(awq, version="gemv")
    with pytest.raises(ValueError, match="'gemv' are not supported"):
        LLM(awq, **small)
    _edit_quant_config(awq, version="gemm", group_size=48)      # 64 input channels: no whole groups
    with pytest.raises(ValueError, match="groups of 48"):
        LLM(awq, **small)
    _edit_quant_config(awq, quant_method="bitsandbytes")
    with pytest.raises(NotImplementedError, match="'bitsandbytes'"):
        LLM(awq, **small)
    w4a16 = quantize_folder(folder, str(tmp_path / "w4a16"), "compressed-tensors")
    with open(os.path.join(w4a16, "config.json")) as f:
        groups = json.load(f)["quantization_config"]["config_groups"]
    for change, error, match in [
            (dict(num_bits=3), ValueError, "compressed-tensors pack-quantized checkpoints of 3 bits are not supported"),
            (dict(group_size=None), ValueError, "group strategy needs a positive group_size"),
            (dict(type="float"), NotImplementedError, "pack-quantized weights .* are not supported")]:
        _edit_quant_config(w4a16, config_groups={"group_0": {**groups["group_0"],
                                                             "weights": {**groups["group_0"]["weights"], **change}}})
        with pytest.raises(error, match=match):
            LLM(w4a16, **small)
    w4a8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    _edit_quant_config(w4a16, config_groups={"group_0": {**groups["group_0"], "input_activations": w4a8}})
    with pytest.raises(NotImplementedError, match="activations unquantized .W4A16 / W8A16."):
        LLM(w4a16, **small)


def test_dummy_weights_from_a_quantized_config(tmp_path):
    """``load_format="dummy"`` builds a quantized model from its config alone (the benchmarks'
    way): packed weights zero, scales random."""
    folder, _ = save_tiny(tmp_path, "qwen3")
    quantized = quantize_folder(folder, str(tmp_path / "gptq"), "gptq", desc_act=True, v2=True)
    os.remove(os.path.join(quantized, "model.safetensors"))
    llm = LLM(quantized, load_format="dummy", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
