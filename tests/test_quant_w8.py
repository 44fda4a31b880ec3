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
from pagoda.model.loader import iter_safetensors
from pagoda.quant.w8 import FP8, quantize_rows
from tests.quant_utils import LINEARS, compressed_folder, fp8_block_folder, fp8_folder, quantize_folder
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


@pytest.mark.parametrize("case,block,compressed", [("llama3", (32, 32), False), ("qwen3", (16, 64), False),
                                                  ("qwen2", (32, 48), False), ("qwen3", (16, 32), True)])
def test_block_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, case, block, compressed):
    """Block-wise FP8 (weight_block_size, a weight_scale_inv per block; or compressed-tensors'
    FP8_BLOCK, block_structure and weight_scale), kept 8-bit with its block scales: the fused
    q/k/v and gate/up layers take each projection's blocks; K not a multiple of the block
    (qwen2's 64 and 128 inputs in 48-wide blocks) ends in partial blocks."""
    folder, _ = save_tiny(tmp_path, case)
    path = fp8_block_folder(folder, str(tmp_path / "fp8b"), block, compressed)
    same_outputs(path, path + "-dequant")
    llm = LLM(path, dtype="float32", **SMALL)
    model = llm.llm_engine.executor.runner.model
    layer = model.model.layers[0].mlp.gate_up_proj
    assert layer.weight.dtype == FP8 and layer.weight_scale_inv.shape == (2 * 128 // block[0], -(-64 // block[1]))
    # A weight update (RL) reads the checkpoint's own names: compressed-tensors' weight_scale too
    assert "model.layers.0.mlp.gate_up_proj.weight_scale_inv:1" in model.load_weights(iter_safetensors(path))


def test_block_fp8_tensor_parallel(tmp_path):
    """tp=2: each rank's rows and columns of blocks (q/k/v's 16-row shards, o_proj's and
    down_proj's halves of K); blocks that would straddle two ranks' rows are refused by name."""
    from tests.test_tensor_parallel import assert_same, outputs_at
    folder, _ = save_tiny(tmp_path, "llama3")
    path = fp8_block_folder(folder, str(tmp_path / "fp8b"), (16, 32))
    kw = dict(dtype="float32", kv_cache_memory_bytes=1 << 24, device="cpu")      # (two ranks: the CPU's)
    assert_same(outputs_at(path, 1, **kw), outputs_at(path, 2, **kw))
    wide = fp8_block_folder(folder, str(tmp_path / "fp8w"), (32, 32))   # k / v: 16 rows a rank
    with pytest.raises(Exception, match="do not fall on whole blocks"):
        LLM(wide, tensor_parallel_size=2, device="cpu", **SMALL)


def test_block_fp8_errors(tmp_path):
    folder, _ = save_tiny(tmp_path, "llama3")
    path = fp8_block_folder(folder, str(tmp_path / "fp8b"), (48, 32))    # q's 64 rows: a block straddles q and k
    with pytest.raises(ValueError, match="at row 0 of its layer do not fall on whole blocks of the checkpoint.s 48-row"):
        LLM(path, **SMALL)
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    for bad, error, match in [({"activation_scheme": "static"}, NotImplementedError, "activation_scheme='static'"),
                              ({"weight_block_size": [128]}, ValueError, "two positive integers")]:
        config["quantization_config"].update(bad)
        with open(config_path, "w") as f:
            json.dump(config, f)
        with pytest.raises(error, match=match):
            LLM(path, **SMALL)
        config["quantization_config"].update(activation_scheme="dynamic", weight_block_size=[48, 32])


@pytest.mark.parametrize("kind,strategy", [("int", "channel"), ("float", "tensor")])
def test_compressed_tensors_checkpoint_matches_its_dequantized_weights(tmp_path, kind, strategy):
    folder, _ = save_tiny(tmp_path, "qwen3")
    path = compressed_folder(folder, str(tmp_path / "ct"), kind, strategy)
    same_outputs(path, path + "-dequant")
    llm = LLM(path, dtype="float32", quantization="w8a8" if kind == "int" else None, **SMALL)
    layer = llm.llm_engine.executor.runner.model.model.layers[1].mlp.down_proj
    assert layer.weight.dtype == (torch.int8 if kind == "int" else FP8)
    assert llm.llm_engine.config.model.quantization == "compressed-tensors"


WRITERS = {"fp8": fp8_folder, "w8a8": compressed_folder,
           "gptq": lambda src, dst, keep: quantize_folder(src, dst, "gptq", keep=keep),
           "w4a16": lambda src, dst, keep: quantize_folder(src, dst, "compressed-tensors", keep=keep)}


@pytest.mark.parametrize("method", WRITERS)
def test_layers_the_checkpoint_leaves_unquantized(tmp_path, method):
    """Layers a quantizer left out (compressed-tensors' ``ignore``, FP8's ``ignored_layers``;
    found by their 16-bit weights) load unquantized: a whole fused q/k/v, one down projection. A
    fused layer half quantized is refused by name."""
    folder, _ = save_tiny(tmp_path, "qwen3")
    keep = ("model.layers.0.mlp.down_proj",) + tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    path = WRITERS[method](folder, str(tmp_path / method), keep=keep)
    same_outputs(path, path + "-dequant")
    llm = LLM(path, dtype="float32", **SMALL)
    layers = llm.llm_engine.executor.runner.model.model.layers
    assert layers[1].self_attn.qkv_proj.weight.dtype == layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert not hasattr(layers[0].self_attn.qkv_proj, "weight") or layers[0].self_attn.qkv_proj.weight.dtype != torch.float32
    del llm
    half = WRITERS[method](folder, str(tmp_path / "half"), keep=("model.layers.1.self_attn.q_proj",))
    with pytest.raises(NotImplementedError, match=r"parts \['q'\] of model.layers.1.self_attn.qkv_proj unquantized"):
        LLM(half, **SMALL)


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
    with pytest.raises(ValueError, match="weight_scale' has no place"):   # per-tensor scales, said to be blocks
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


def _w8_layer(n, k, weight_dtype, dtype, device, gen):
    from pagoda.model.layers.linear import ReplicatedLinear
    from pagoda.quant.w8 import W8LinearMethod
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = ReplicatedLinear(k, n, bias=True, quant_method=W8LinearMethod(weight_dtype)).to(device)
    finally:
        torch.set_default_dtype(prev)
    w = (torch.randn(n, k, generator=gen) * 60).clamp(-127, 127)
    layer.weight.data = (w.round().to(torch.int8) if weight_dtype == torch.int8 else w.to(weight_dtype)).to(device)
    layer.weight_scale.data = (torch.rand(n, 1, generator=gen) * 0.01 + 1e-3).to(device)
    layer.bias.data = torch.randn(n, generator=gen).to(device, dtype)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("weight_dtype", [FP8, torch.int8], ids=str)
def test_w8_matmul_paths(weight_dtype, monkeypatch):
    """Which matmul an 8-bit layer runs: on the GPU one row takes the slab kernel; INT8 weights
    above that the INT8 tensor cores (W8A8); FP8 weights under bf16 the W8A16 kernel up to
    W8A16_MAX_M rows, the FP8 tensor cores (W8A8) above, under float16 the W8A16 kernel up to its
    MAX_M rows, the dequantized weight above; on the CPU always the dequantized weight, exactly."""
    from pagoda.kernels import triton_linear, triton_w4a16
    from pagoda.quant import w8
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(3)
    calls = []
    for module, name, label in ((triton_linear, "small_m_linear", "slab"), (triton_w4a16, "w8a16_linear", "w8a16"),
                                (w8, "fp8_linear", "w8a8"), (w8, "int8_linear", "int8 w8a8")):
        monkeypatch.setattr(module, name, lambda *a, real=getattr(module, name), label=label:
                            calls.append(label) or real(*a))
    monkeypatch.setattr(w8, "W8A16_MAX_M", 4)
    for dtype in (torch.bfloat16, torch.float16):
        layer = _w8_layer(96, 64, weight_dtype, dtype, device, gen)
        dense = layer.weight.float() * layer.weight_scale
        for m in (1, 3, 5, triton_w4a16.MAX_M + 1):
            x = torch.randn(m, 64, generator=gen).to(device, dtype)
            calls.clear()
            out = layer(x)
            assert out.dtype == dtype and out.shape == (m, 96)
            tensor_cores = dtype == torch.bfloat16 and weight_dtype == FP8
            expected = ([] if not on_gpu else ["slab"] if m == 1 else ["int8 w8a8"] if weight_dtype == torch.int8
                        else ["w8a8"] if tensor_cores and m > 4 else ["w8a16"] if m <= triton_w4a16.MAX_M else [])
            assert calls == expected, (dtype, m)
            ref = torch.nn.functional.linear(x.float(), dense, layer.bias.float())
            if not on_gpu:
                assert torch.equal(out, torch.nn.functional.linear(
                    x, layer.weight.to(dtype) * layer.weight_scale.to(dtype), layer.bias))
            # (W8A8 adds each token's FP8 (INT8) rounding: a few percent (about one))
            bound = 5e-2 if calls == ["w8a8"] else 2e-2 if calls == ["int8 w8a8"] else 1e-2
            assert ((out.float() - ref).norm() / ref.norm()).item() < bound


def test_block_fp8_matmul_paths(monkeypatch):
    """Block scales: on the GPU the W8A16 kernel up to its MAX_M rows (one row too: the slab
    kernel takes a scale a row), the dequantized weight above; on the CPU the dequantized weight,
    exactly."""
    from pagoda.kernels import triton_w4a16
    from pagoda.model.layers.linear import ReplicatedLinear
    from pagoda.kernels.reference import dequantize_blocks
    from pagoda.quant.w8 import W8LinearMethod
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(4)
    calls = []
    monkeypatch.setattr(triton_w4a16, "w8a16_linear", lambda *a, real=triton_w4a16.w8a16_linear:
                        calls.append(a[-1]) or real(*a))
    block, n, k = (32, 64), 96, 200
    with torch.device(device):
        layer = ReplicatedLinear(k, n, bias=True, quant_method=W8LinearMethod(FP8, block))
    layer.weight.data = (torch.randn(n, k, generator=gen) * 60).clamp(-400, 400).to(FP8).to(device)
    layer.weight_scale_inv.data = (torch.rand(3, 4, generator=gen) * 0.01 + 1e-3).to(device)
    layer.quant_method.process_weights_after_loading(layer)
    for dtype in (torch.bfloat16, torch.float16):
        layer.bias.data = torch.randn(n, generator=gen).to(device, dtype)
        dense = dequantize_blocks(layer.weight, layer.weight_scale_inv, block, torch.float32)
        for m in (1, 9, triton_w4a16.MAX_M + 1):
            x = torch.randn(m, k, generator=gen).to(device, dtype)
            calls.clear()
            out = layer(x)
            assert out.dtype == dtype and out.shape == (m, n)
            assert calls == ([block] if on_gpu and m <= triton_w4a16.MAX_M else []), (dtype, m)
            if not on_gpu:
                assert torch.equal(out, torch.nn.functional.linear(x, dense.to(dtype), layer.bias))
            ref = torch.nn.functional.linear(x.float(), dense, layer.bias.float())
            assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("kind,path,dtype", [("int", "int8", torch.int8), ("float", "fp8", torch.float8_e4m3fn)])
def test_norms_hand_w8a8_matmuls_their_rows_quantized(tmp_path, monkeypatch, kind, path, dtype):
    """W8A8 (INT8 and FP8): the RMSNorms and SiLU-and-mul before qkv_proj, gate_up_proj and
    down_proj write their rows quantized (only o_proj, after the attention, quantizes its own),
    and the model generates exactly what it does with each matmul quantizing its input. The
    GPU's choice of path (INT8 or FP8 tensor cores from two rows) is made on the CPU here: the
    norms' torch versions quantize (their Triton kernels are held to them in tests/kernels), the
    INT8 GEMM runs in the interpreter, torch._scaled_mm on the CPU; no LoRA adapter on the layer,
    which reads the plain rows itself."""
    from pagoda.kernels import triton_ops
    from pagoda.model.layers.layernorm import QuantizesForNext
    from pagoda.quant.w8 import W8LinearMethod
    folder, _ = save_tiny(tmp_path, "llama3")
    checkpoint = compressed_folder(folder, str(tmp_path / "ct"), kind, "channel")
    monkeypatch.setattr(W8LinearMethod, "path", lambda self, layer, x: path if x.shape[0] > 1 else "dense")
    launches = []
    monkeypatch.setattr(triton_ops, "per_token_quant", lambda x, dtype, real=triton_ops.per_token_quant:
                        launches.append(x.shape) or real(x, dtype))
    prompts = [{"prompt_token_ids": list(range(5 + i, 40 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    # (CUDA's row-scaled FP8 matmul writes only bf16)
    model_dtype = "bfloat16" if kind == "float" and torch.cuda.is_available() else "float32"

    def run():
        launches.clear()
        llm = LLM(checkpoint, dtype=model_dtype, **SMALL)
        outs = llm.generate(prompts, params, use_tqdm=False)
        layer = llm.llm_engine.executor.runner.model.model.layers[0]
        del llm
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], len(launches), layer

    fused, fused_launches, layer = run()
    assert layer.input_layernorm.quant_dtype(torch.zeros(2, 64)) == dtype
    monkeypatch.setattr(QuantizesForNext, "quant_dtype", lambda self, x: None)
    plain, plain_launches = run()[:2]
    assert fused_launches > 0 and plain_launches == 4 * fused_launches
    # (the same tokens; on the GPU a fused norm may round a row in the last bit, and so an INT8 value)
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(fused, plain):
        assert tokens == plain_tokens
        for a, b in zip(logprobs, plain_logprobs):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-2 for t in a)
            assert torch.cuda.is_available() or a == b


@pytest.mark.parametrize("m,n,k", [(3, 64, 96), (17, 64, 96), (40, 48, 200)] + ([(300, 4096, 14336), (2048, 6144, 4096)]
                                                                   if torch.cuda.is_available() else []), ids=str)
def test_int8_linear_matches_the_scaled_matmul_it_stands_for(m, n, k):
    """W8A8 on INT8 tensor cores (``triton_int8_mm``, in the interpreter on the CPU) against
    ``reference.scaled_mm`` of the reference's INT8 activations: the same math, its sums exact in
    int32 (the reference's in float32), and against the W8A16 matmul it replaces."""
    from pagoda.kernels import reference
    from pagoda.quant.w8 import int8_linear
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    w_scale = w.abs().amax(dim=1, keepdim=True) / 127
    w_q = (w / w_scale).round().to(torch.int8)
    x = torch.randn(m, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16()
    w_q, w_scale, x, bias = (t.to(device) for t in (w_q, w_scale, x, bias))
    out = int8_linear(x, w_q, w_scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # (rows the kernel before it quantized already: the same product)
    assert torch.equal(int8_linear(reference.quantized(x, torch.int8), w_q, w_scale, bias), out)
    ref = reference.scaled_mm(*reference.per_token_quant(x, torch.int8), w_q, w_scale, bias, torch.float32)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 4e-3     # (bf16 output rounding)
    w8a16 = torch.nn.functional.linear(x.float(), w_q.float() * w_scale, bias.float())
    assert ((out.float() - w8a16).norm() / w8a16.norm()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 tensor cores (torch._scaled_mm) need a GPU")
@pytest.mark.parametrize("m,n,k", [(2, 4096, 1024), (7, 1024, 3072), (64, 6144, 4096), (300, 4096, 14336)],
                         ids=str)
def test_fp8_linear_matches_the_scaled_matmul_it_stands_for(m, n, k):
    """W8A8 on FP8 tensor cores against ``reference.scaled_mm`` of the reference's quantized
    activations (the same math in float32: only the accumulation order and the bf16 output
    rounding differ), and against the W8A16 matmul it replaces (activation rounding: a few %)."""
    from pagoda.kernels import reference
    from pagoda.quant.w8 import fp8_linear
    gen = torch.Generator().manual_seed(m * n + k)
    w_q, w_scale = (t.cuda() for t in quantize_rows(torch.randn(n, k, generator=gen) * k ** -0.5))
    x = torch.randn(m, k, generator=gen).cuda().bfloat16()
    bias = torch.randn(n, generator=gen).cuda().bfloat16()
    out = fp8_linear(x, w_q, w_scale, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = reference.scaled_mm(*reference.per_token_quant(x), w_q, w_scale, bias, torch.float32)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    w8a16 = torch.nn.functional.linear(x.float(), w_q.float() * w_scale, bias.float())
    assert ((out.float() - w8a16).norm() / w8a16.norm()).item() < 5e-2
