"""8-bit weights: vLLM's FP8 checkpoints (per-tensor scales, dynamic or static activations),
compressed-tensors checkpoints of INT8 (W8A8) and FP8 weights (per-channel or per-tensor scales),
and quantization="fp8" on an unquantized checkpoint (a scale per row, at load), against the same
tiny models holding the dequantized weights; the weights stay 8-bit; errors for what is not
supported."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagoda import LLM, SamplingParams
from pagoda.quant.w8 import FP8, quantize_rows
from tests.quant_utils import LINEARS, compressed_folder, fp8_folder
from tests.test_architectures import save_tiny

SMALL = dict(skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24)


def same_outputs(a: str, b: str, **kwargs) -> None:
    """Greedy tokens equal and prompt logprobs within 1e-4 (float32)."""
    g = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()} for n in (6, 21)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = []
    for path, kw in ((a, kwargs), (b, {})):
        llm = LLM(path, dtype="float32", **SMALL, **kw)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    for x, y in zip(*outs):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for pos in range(1, len(x.prompt_token_ids)):
            tok = x.prompt_token_ids[pos]
            assert abs(x.prompt_logprobs[pos][tok].logprob - y.prompt_logprobs[pos][tok].logprob) < 1e-4


@pytest.mark.parametrize("case,static", [("llama3", False), ("qwen2", True)])
def test_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, case, static):
    """q, k and v (and gate and up) come with different per-tensor scales: each fills its rows of
    the fused layer's per-row scale, nothing requantized. A static input_scale is read, unused."""
    folder, _ = save_tiny(tmp_path, case)
    fp8 = fp8_folder(folder, str(tmp_path / "fp8"), static=static)
    same_outputs(fp8, fp8 + "-dequant")
    llm = LLM(fp8, dtype="float32", **SMALL)
    layer = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
    assert llm.llm_engine.config.model.quantization == "fp8"


@pytest.mark.parametrize("kind,strategy", [("int", "channel"), ("float", "tensor")])
def test_compressed_tensors_checkpoint_matches_its_dequantized_weights(tmp_path, kind, strategy):
    folder, _ = save_tiny(tmp_path, "qwen3")
    path = compressed_folder(folder, str(tmp_path / "ct"), kind, strategy)
    same_outputs(path, path + "-dequant")
    llm = LLM(path, dtype="float32", quantization="w8a8" if kind == "int" else None, **SMALL)
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == (torch.int8 if kind == "int" else FP8)
    assert llm.llm_engine.config.model.quantization == "compressed-tensors"


def test_online_fp8_matches_rowwise_quantized_weights(tmp_path):
    """quantization="fp8" on a float32 checkpoint quantizes each weight at load, a scale per
    row: the model equals one holding those weights dequantized."""
    folder, _ = save_tiny(tmp_path, "qwen3")
    weights = load_file(os.path.join(folder, "model.safetensors"))
    twin = tmp_path / "twin"
    twin.mkdir()
    for name, w in list(weights.items()):
        if name.rsplit(".", 2)[-2] in LINEARS and name.endswith(".weight"):
            q, scale = quantize_rows(w)
            weights[name] = q.float() * scale
    save_file(weights, str(twin / "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        (twin / "config.json").write_text(f.read())
    same_outputs(folder, str(twin), quantization="fp8")


def test_fp8_errors_and_dummy_weights(tmp_path):
    folder, _ = save_tiny(tmp_path, "llama3")
    fp8 = fp8_folder(folder, str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match="quantization='gptq' does not match the checkpoint's 'fp8'"):
        LLM(fp8, quantization="gptq", **SMALL)
    path = os.path.join(fp8, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["weight_block_size"] = [128, 128]
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(NotImplementedError, match="block-wise scales"):
        LLM(fp8, **SMALL)
    del config["quantization_config"]["weight_block_size"]
    with open(path, "w") as f:
        json.dump(config, f)
    ct = compressed_folder(folder, str(tmp_path / "ct"))
    path = os.path.join(ct, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(NotImplementedError, match="symmetric 8-bit weights"):
        LLM(ct, **SMALL)
    os.remove(os.path.join(fp8, "model.safetensors"))          # the benchmarks' dummy weights
    llm = LLM(fp8, load_format="dummy", **SMALL)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
