"""GGUF reading: config from metadata, weights equal to transformers' loading, errors on bad files."""
import math
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from pagoda.model import gguf_quants
from pagoda.model.gguf_file import GGUFModel
from tests.quant_utils import random_gguf_blocks


@pytest.fixture(scope="module")
def model(smollm_path) -> GGUFModel:
    return GGUFModel(smollm_path)


@pytest.fixture(scope="module")
def weights(model) -> dict[str, torch.Tensor]:
    return dict(model.iter_weights())


def test_smollm2_config(model):
    cfg = model.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and cfg["attention_bias"] is False
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def test_names_and_shapes_match_hf_llama(model, weights):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{k: v for k, v in model.hf_config.items() if k != "torch_dtype"})
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert {name: tuple(w.shape) for name, w in weights.items()} == expected
    assert all(w.dtype == torch.float32 for w in weights.values())


REFERENCE_TENSORS = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight",
                     "blk.0.attn_v.weight", "blk.7.attn_output.weight", "blk.29.ffn_down.weight",
                     "blk.29.attn_k.weight", "blk.3.attn_norm.weight"]


def test_weights_match_transformers(weights, smollm_path):
    """transformers' own GGUF path: its torch dequantizer and its llama q/k reverse permutation."""
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    header = GgufHeader.from_file(smollm_path)
    infos = {info.name: info for info in header.tensors}
    raw = load_gguf_state_dict(header)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    hf_to_gguf = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 30)  # gguf-py's own name table
    ours = {hf_to_gguf.get_name(name.removesuffix(".weight")) + ".weight": w for name, w in weights.items()}
    for gguf_name in REFERENCE_TENSORS:
        info, data = infos[gguf_name], raw[gguf_name][...]
        ref = data.float() if data.is_floating_point() else hf_dequantize(data.reshape(-1), info.ggml_type)
        ref = processor.process(ref.reshape(info.shape).numpy(), gguf_name).weights
        torch.testing.assert_close(ours[gguf_name], torch.as_tensor(ref), rtol=0, atol=0, msg=gguf_name)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PAGODA_SLOW_TESTS"), reason="~30 s; set PAGODA_SLOW_TESTS=1")
def test_all_weights_match_transformers_loader(weights, smollm_path):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = transformers.AutoConfig.from_pretrained(os.path.dirname(smollm_path),
                                                     gguf_file=os.path.basename(smollm_path))
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    ref = load_gguf_checkpoint(smollm_path, return_tensors=True, model_to_load=hf)["tensors"]
    assert set(weights) == set(ref)
    for name, w in weights.items():
        assert torch.equal(w, ref[name].float()), name


# ---- synthetic files --------------------------------------------------------------------------

def _write(path, arch, tensors, n_head=4, n_kv=2, hidden=64, experts=0):
    """A GGUF with `tensors` = {gguf_name: np array (F32/F16) or (raw uint8 rows, qtype)}."""
    w = gguf.GGUFWriter(str(path), arch)
    if experts:
        w.add_expert_count(experts)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(128)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            data, qtype = t  # raw bytes, one row per output feature
            w.add_tensor(name, data, raw_dtype=qtype)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_llama_unpermute_inverts_converter(tmp_path):
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((64, 64), np.float32), rng.standard_normal((32, 64), np.float32)
    bq = rng.standard_normal(64).astype(np.float32)
    path = _write(tmp_path / "l.gguf", "llama", {
        "blk.0.attn_q.weight": _llama_cpp_permute(q, 4), "blk.0.attn_k.weight": _llama_cpp_permute(k, 2),
        "blk.0.attn_q.bias": _llama_cpp_permute(bq, 4), "blk.0.attn_v.weight": k})
    m = GGUFModel(path)
    w = dict(m.iter_weights())
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(w["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(w["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(bq))
    assert torch.equal(w["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(k))
    assert m.hf_config["attention_bias"] is True and m.hf_config["tie_word_embeddings"] is True


def test_qwen3_names_no_permute(tmp_path):
    rng = np.random.default_rng(1)
    q, qn = rng.standard_normal((64, 64), np.float32), rng.standard_normal(16).astype(np.float32)
    path = _write(tmp_path / "q.gguf", "qwen3", {
        "blk.0.attn_q.weight": q, "blk.0.attn_q_norm.weight": qn, "blk.0.attn_k_norm.weight": qn,
        "output.weight": q, "rope_freqs.weight": np.ones(8, np.float32)})
    m = GGUFModel(path)
    w = dict(m.iter_weights())
    assert torch.equal(w["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert set(w) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_norm.weight",
                      "model.layers.0.self_attn.k_norm.weight", "lm_head.weight"}
    cfg = m.hf_config
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == 1e6 and cfg["num_key_value_heads"] == 2
    assert cfg["rope_scaling"] == {"rope_type": "freq_factors", "factors": [1.0] * 8}


K_QUANTS = [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]     # (gguf-py cannot quantize these)
K_AND_LEGACY = [QT.Q4_0, QT.Q4_1, QT.Q8_0] + K_QUANTS


@pytest.mark.parametrize("qtype", K_AND_LEGACY, ids=lambda q: q.name)
def test_dequantize_matches_transformers(tmp_path, qtype):
    pytest.importorskip("transformers")
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize
    rng = np.random.default_rng(int(qtype))
    data = random_gguf_blocks(rng, qtype, 8, 512)
    path = _write(tmp_path / "t.gguf", "qwen2", {"blk.0.ffn_up.weight": (data, qtype)})
    ours = GGUFModel(path).tensor("blk.0.ffn_up.weight")
    ref = hf_dequantize(torch.from_numpy(data.copy()).reshape(-1), int(qtype)).reshape(8, 512)
    assert ours.shape == (8, 512) and torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", sorted(gguf_quants.TYPES), ids=lambda q: q.name)
def test_torch_dequantize_equals_gguf_py(qtype):
    """The torch dequantization (every core; on a GPU, the GPU) gives gguf-py's numpy values bit
    for bit, on random blocks of each type it takes."""
    from gguf.quants import dequantize as np_dequantize
    rng = np.random.default_rng(100 + int(qtype))
    data = random_gguf_blocks(rng, qtype, 6, 1024)
    ref = torch.from_numpy(np_dequantize(data, qtype))
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        ours = gguf_quants.dequantize(torch.from_numpy(data.copy()).to(device), qtype).view(6, 1024)
        assert torch.equal(ours.cpu(), ref), device


def test_float_types(tmp_path):
    x = np.random.default_rng(2).standard_normal((4, 32)).astype(np.float32)
    bf16 = (x.view(np.uint32) >> 16).astype(np.uint16)
    path = _write(tmp_path / "f.gguf", "qwen2", {
        "blk.0.ffn_up.weight": x, "blk.0.ffn_gate.weight": x.astype(np.float16),
        "blk.0.ffn_down.weight": (bf16.view(np.uint8), QT.BF16)})
    m = GGUFModel(path)
    assert torch.equal(m.tensor("blk.0.ffn_up.weight"), torch.from_numpy(x))
    assert torch.equal(m.tensor("blk.0.ffn_gate.weight"), torch.from_numpy(x.astype(np.float16).astype(np.float32)))
    truncated = (bf16.astype(np.uint32) << 16).view(np.float32)
    assert torch.equal(m.tensor("blk.0.ffn_down.weight"), torch.from_numpy(truncated))


# HF names -> llama.cpp's (convert_hf_to_gguf.py), written out here rather than read from pagoda
_HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",     # (Phi-3's fused ones)
               "block_sparse_moe.router.layer": "ffn_gate_inp",                   # (Granite MoE's)
               "block_sparse_moe.output_linear": "ffn_down_exps", "shared_mlp.output_linear": "ffn_down_shexp"}
_HF_EXPERTS = {"gate_proj": "ffn_gate_exps", "w1": "ffn_gate_exps", "up_proj": "ffn_up_exps", "w3": "ffn_up_exps",
               "down_proj": "ffn_down_exps", "w2": "ffn_down_exps"}


# (Gemma 2/3's and OLMo 2/3's norms of each sublayer's output; Gemma's of the MLP's input)
_GEMMA_TO_GGUF = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}
# EXAONE's GPT-2 names -> Llama's
_EXAONE_TO_HF = [(r"transformer\.wte\.", "model.embed_tokens."), (r"transformer\.ln_f\.", "model.norm."),
                 (r"transformer\.h\.", "model.layers."), (r"attn\.attention\.out_proj", "self_attn.o_proj"),
                 (r"attn\.attention\.", "self_attn."), (r"ln_1", "input_layernorm"),
                 (r"ln_2", "post_attention_layernorm"), (r"mlp\.c_fc_0", "mlp.gate_proj"),
                 (r"mlp\.c_fc_1", "mlp.up_proj"), (r"mlp\.c_proj", "mlp.down_proj")]


def _llama3_rope_factors(cfg: dict, s: dict) -> np.ndarray:
    """The divisor of each rotary frequency under Llama-3's scaling, as llama.cpp's converter
    writes it (rope_freqs): 1 for wavelengths under the original context over high_freq_factor,
    the factor over the original context over low_freq_factor, a smooth blend between."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (s.get("rope_theta") or cfg["rope_theta"]) ** (np.arange(0, head_dim, 2) / head_dim)
    old_len, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    factors = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(s["factor"])
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(factors, np.float32)


def _hf_gguf(folder, path, arch, types=None):
    """A tiny HF model as llama.cpp's converter writes it: a mixture's experts stacked (E, out,
    in) per projection, llama's q/k rows permuted, the shared expert's gate a vector, Phi-3's
    fused projections kept fused, Gemma's norm weights plus 1 (and Gemma 2/3's norms of each
    sublayer's output, their caps, a linear rope scaling), Llama-3's rope scaling as a factor a
    frequency, EXAONE's tensors under Llama's names; F32, but for the layer matrices named in
    ``types`` (llama.cpp's module name -> type; ffn_gate_exps, ... the stacked experts): the
    legacy types quantized by gguf-py, the K-quants (which it cannot quantize) random blocks."""
    import glob
    import json
    import re

    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(folder, "config.json")))
    sd = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        sd.update(load_file(f))
    w = gguf.GGUFWriter(str(path), arch)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    rope = cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)     # (Gemma 3's: the full layers')
    gemma = arch.startswith("gemma")
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":       # (OLMo 2/3's converter: the attention factor too)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_attn_factors(rope["attention_factor"])
    if rope.get("rope_type") == "llama3":     # (no scaling type: the factors as a tensor)
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(cfg, rope))
    if rope.get("rope_type") == "longrope":   # (Phi-3's: the factors as tensors, no scaling type)
        old_len = rope.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
        grown = cfg["max_position_embeddings"] / old_len
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(grown) / math.log(old_len)))
        w.add_rope_scaling_orig_ctx_len(old_len)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor")
                                               or 1.0)))
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(cap):
            getattr(w, f"add_{cap}")(cfg[cap])
    if arch in ("gemma3", "olmo2") and "layer_types" in cfg:   # (a window a layer, as newer converters write it)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    for key, value in [("block_count", cfg["num_hidden_layers"]), ("context_length", cfg["max_position_embeddings"]),
                       ("embedding_length", cfg["hidden_size"]), ("feed_forward_length", cfg["intermediate_size"]),
                       ("head_count", heads), ("head_count_kv", kv), ("layer_norm_rms_eps", cfg["rms_norm_eps"]),
                       ("rope_freq_base", cfg.get("rope_theta") or rope["rope_theta"]),
                       ("vocab_size", cfg["vocab_size"]),
                       ("expert_count", cfg.get("num_experts") or cfg.get("num_local_experts")),
                       ("expert_used_count", cfg.get("num_experts_per_tok")),
                       ("sliding_window", cfg.get("sliding_window"))]:
        if value is not None:
            getattr(w, f"add_{key}")(value)
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
    if "moe_intermediate_size" in cfg:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if "norm_topk_prob" in cfg:
        w.add_expert_weights_norm(cfg["norm_topk_prob"])
    if cfg.get("shared_intermediate_size"):     # (Granite MoE Shared's)
        w.add_expert_shared_feed_forward_length(cfg["shared_intermediate_size"])
    if arch.startswith("granite"):
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    experts, rng = {}, np.random.default_rng(0)

    def add(gguf_name, t, module):     # (a stack of experts: random blocks for every row of every expert)
        qtype = (types or {}).get(module)
        if qtype in K_QUANTS:
            w.add_tensor(gguf_name, random_gguf_blocks(rng, qtype, t.size // t.shape[-1], t.shape[-1]).reshape(
                *t.shape[:-1], -1), raw_dtype=qtype)
        elif qtype is not None:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, t)
    for name, t in sd.items():
        t = t.float().numpy()
        if arch == "exaone":
            for pattern, hf in _EXAONE_TO_HF:
                name = re.sub(pattern, hf, name)
        if gemma and name.endswith("norm.weight"):
            t = t + 1
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                          "lm_head.weight": "output.weight"}[name], t)
            continue
        layer, rest = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name).groups()
        if m := re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", rest):
            experts.setdefault(f"blk.{layer}.{_HF_EXPERTS[m[2]]}.weight", {})[int(m[1])] = t
            continue
        # (Granite MoE's gate and up stacked in one input_linear: its experts' and its shared MLP's)
        if m := re.fullmatch(r"(block_sparse_moe|shared_mlp)\.input_linear\.weight", rest):
            kind = "exps" if m[1] == "block_sparse_moe" else "shexp"
            for half, part in zip(("gate", "up"), np.split(t, 2, axis=t.ndim - 2)):
                add(f"blk.{layer}.ffn_{half}_{kind}.weight", np.ascontiguousarray(part), f"ffn_{half}_{kind}")
            continue
        module, kind = rest.rsplit(".", 1)
        if arch in ("llama", "granite", "granitemoe", "smollm3") and module in ("self_attn.q_proj", "self_attn.k_proj"):
            t = _llama_cpp_permute(t, heads if module == "self_attn.q_proj" else kv)
        gate_vector = "shared_expert_gate" in module
        names = {**_HF_TO_GGUF, **(_GEMMA_TO_GGUF if arch in ("gemma2", "gemma3", "olmo2") else {})}
        add(f"blk.{layer}.{names[module]}.{kind}", t.reshape(-1) if gate_vector else t, names[module])
    for name, by_expert in experts.items():
        add(name, np.stack([by_expert[e] for e in sorted(by_expert)]), name.split(".")[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("case,arch", [("mixtral", "llama"), ("qwen3_moe", "qwen3moe"), ("qwen2_moe", "qwen2moe"),
                                       ("granitemoe", "granitemoe"), ("granitemoeshared", "granitemoe")])
def test_mixture_of_experts_gguf_equals_its_safetensors(tmp_path, case, arch):
    """Mixtral (whose files say "llama" with an expert count), Qwen3-MoE (a dense layer: no router
    in it), Qwen2-MoE (a shared expert) and Granite MoE (its scalings; with a shared MLP, Granite
    MoE Shared, whose files say "granitemoe" too): the same greedy tokens and prompt logprobs as
    the HF folder the file was converted from."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case)
    path = _hf_gguf(folder, tmp_path / f"{case}.gguf", arch)
    cfg = GGUFModel(path).hf_config
    assert cfg["model_type"] == {"llama": "mixtral"}.get(arch, case)
    assert cfg["mlp_only_layers"] == ([1] if case == "qwen3_moe" else [])
    assert_same_as_folder(path, folder)


def assert_same_as_folder(path, folder):
    """The GGUF file's greedy tokens and prompt logprobs are the HF folder's it was converted from."""
    from pagoda import LLM, SamplingParams
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 14, 3, 77], list(range(20, 60)))]
    outs = []
    for model in (folder, path):
        llm = LLM(model, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        del llm
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert next(iter(pa.values())).logprob == pytest.approx(next(iter(pb.values())).logprob, abs=1e-4)


def test_phi3_gguf_equals_its_safetensors(tmp_path):
    """Phi-3 as llama.cpp writes it (arch "phi3": attn_qkv fused, ffn_up holding gate and up, no
    q/k permutation, its sliding window): the HF folder's greedy tokens, past the window; and
    Phi-4-mini's (three quarters of each head rotated: the rope's dimension count) with LongRoPE
    (its factors two tensors, the attention factor the converter computed, the original context)."""
    from tests.test_architectures import LONGROPE, save_tiny
    folder, _ = save_tiny(tmp_path, "phi3")
    path = _hf_gguf(folder, tmp_path / "phi3.gguf", "phi3")
    assert GGUFModel(path).hf_config["sliding_window"] == 24
    assert_same_as_folder(path, folder)
    folder, _ = save_tiny(tmp_path / "long", "phi4_mini", **LONGROPE)
    path = _hf_gguf(folder, tmp_path / "long.gguf", "phi3")
    cfg = GGUFModel(path).hf_config
    assert cfg["partial_rotary_factor"] == 0.75
    assert cfg["rope_scaling"]["long_factor"] == LONGROPE["rope_scaling"]["long_factor"]
    assert_same_as_folder(path, folder)
    factors = np.ones(6, np.float32)     # (no original context in the metadata: refused by name)
    with pytest.raises(ValueError, match="LongRoPE factors without .*original_context_length"):
        _ = GGUFModel(_write(tmp_path / "bad.gguf", "phi3", {"rope_factors_long.weight": factors,
                                                            "rope_factors_short.weight": factors})).hf_config


@pytest.mark.parametrize("case,arch,config", [
    ("llama3", "llama", {}),
    ("exaone", "exaone", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64})),
    ("smollm3", "smollm3", dict(num_hidden_layers=4, no_rope_layers=None)),
    ("olmo2", "olmo2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 32, "attention_factor": 1.5})),
    ("olmo3", "olmo2", {})])
def test_llama_like_gguf_equals_its_safetensors(tmp_path, case, arch, config):
    """As llama.cpp writes them: Llama 3.1's rope scaling (no type in the metadata: a divisor a
    frequency in rope_freqs), EXAONE 3.5 (GPT-2's names become Llama's; its Llama-3 scaling),
    SmolLM3 (permuted q/k; every fourth layer without a rotary embedding, which the file does not
    say), OLMo 2 (only the sublayers' outputs normed; here with YaRN and its attention factor) and
    OLMo 3 (arch "olmo2" with a window a layer): the HF folder's greedy tokens and prompt logprobs."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case, **config)
    path = _hf_gguf(folder, tmp_path / f"{case}.gguf", arch)
    cfg = GGUFModel(path).hf_config
    assert cfg["model_type"] == (case if case != "llama3" else "llama")
    assert cfg.get("no_rope_layers") == ([1, 1, 1, 0] if case == "smollm3" else None)
    assert (cfg["rope_scaling"] or {}).get("rope_type") == {"llama3": "freq_factors", "exaone": "freq_factors",
                                                            "olmo2": "yarn"}.get(case)
    assert_same_as_folder(path, folder)


def test_decompose_equals_dequantize():
    """quantization="gguf"'s parts ((q - zero) * scale, a zero and scale a group of 16) give each
    type's values; a group of one value whose scale is 0 (Q4_1's d = 0, m = 0.5) is kept exactly."""
    for qtype in sorted(gguf_quants.TYPES):
        raw = torch.from_numpy(random_gguf_blocks(np.random.default_rng(int(qtype)), qtype, 4, 512).copy())
        q, scale, zero = gguf_quants.decompose(raw, qtype)
        ours = ((q.float().view(q.shape[0], -1, 16) - zero[..., None]) * scale[..., None]).flatten(1)
        ref = gguf_quants.dequantize(raw, qtype)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=qtype.name)
    flat = np.zeros((1, 20), np.uint8)
    flat[0, 2:4] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)        # d = 0, m = 0.5
    q, scale, zero = gguf_quants.decompose(torch.from_numpy(flat), QT.Q4_1)
    assert torch.equal((q.float().view(1, 2, 16) - zero[..., None]) * scale[..., None], torch.full((1, 2, 16), 0.5))


@pytest.mark.parametrize("case,arch,types,layouts", [
    # SmolLM2's own file's type: every layer 4-bit in groups of 32
    ("llama3", "llama", dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                       "ffn_down"), QT.Q4_1),
     {"self_attn.qkv_proj": (4, 32), "self_attn.o_proj": (4, 32), "mlp.gate_up_proj": (4, 32),
      "mlp.down_proj": (4, 32)}),
    # a Q4_K_M-like mix: attn_v and ffn_down Q6_K (8-bit, groups of 16), the fused q/k/v with them
    ("llama3", "llama", dict(attn_q=QT.Q4_K, attn_k=QT.Q4_K, attn_v=QT.Q6_K, attn_output=QT.Q4_K,
                             ffn_gate=QT.Q4_K, ffn_up=QT.Q4_K, ffn_down=QT.Q6_K),
     {"self_attn.qkv_proj": (8, 16), "self_attn.o_proj": (4, 32), "mlp.gate_up_proj": (4, 32),
      "mlp.down_proj": (8, 16)}),
    # every other type once (attn_output F32: a dense layer among packed ones)
    ("qwen3", "qwen3", dict(attn_q=QT.Q8_0, attn_k=QT.Q5_0, attn_v=QT.Q5_1, ffn_gate=QT.Q2_K, ffn_up=QT.Q3_K,
                            ffn_down=QT.Q5_K),
     {"self_attn.qkv_proj": (8, 32), "mlp.gate_up_proj": (4, 16), "mlp.down_proj": (8, 32)}),
], ids=["q4_1", "q4_k_m", "mixed"])
def test_packed_gguf_equals_dequantized(tmp_path, case, arch, types, layouts):
    """quantization="gguf" keeps the layer matrices packed (4-bit words where every part fits,
    else 8-bit; groups of 32 where every part has them, else 16) and gives the dequantized
    file's greedy tokens and prompt logprobs (float32)."""
    from pagoda import LLM, SamplingParams
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case, hidden_size=256, intermediate_size=512, head_dim=64)
    path = _hf_gguf(folder, tmp_path / "q.gguf", arch, types)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 14, 3, 77], list(range(20, 60)))]
    outs, found = [], []     # (each engine's packed layers: bits, group)
    for quantization in (None, "gguf"):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24,
                  max_model_len=128, quantization=quantization)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        found.append(llm.apply_model(lambda m: {n.split(".", 3)[-1]: (l.bits, l.group_size)
                                                  for n, l in m.named_modules() if n.startswith("model.layers.0.")
                                                  and hasattr(l, "qweight")})[0])
        del llm
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert next(iter(pa.values())).logprob == pytest.approx(next(iter(pb.values())).logprob, abs=1e-3)
    assert found[0] == {} and found[1] == layouts


def test_packed_gguf_over_two_ranks(tmp_path):
    """Packed at tp=2 (each rank its slice: output rows of the column-parallel layers, groups of
    16 inputs of the row-parallel ones): one process's greedy tokens and prompt logprobs."""
    from pagoda import LLM, SamplingParams
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "llama3", hidden_size=256, intermediate_size=512, head_dim=64)
    path = _hf_gguf(folder, tmp_path / "q.gguf", "llama", dict(attn_q=QT.Q4_K, attn_k=QT.Q4_K, attn_v=QT.Q6_K,
                                                                attn_output=QT.Q4_K, ffn_gate=QT.Q4_1,
                                                                ffn_up=QT.Q4_1, ffn_down=QT.Q6_K))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = []
    for tp in (1, 2):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
                  quantization="gguf", tensor_parallel_size=tp, device="cpu")   # (one GPU machines too)
        outs.append(llm.generate([{"prompt_token_ids": list(range(30, 70))}], params, use_tqdm=False)[0])
        del llm
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    for pa, pb in zip(outs[0].prompt_logprobs[1:], outs[1].prompt_logprobs[1:]):
        assert next(iter(pa.values())).logprob == pytest.approx(next(iter(pb.values())).logprob, abs=1e-3)


def test_smollm2_packed(llm, smollm_path):
    """SmolLM2's own file (Q4_1 matrices) kept packed: the dequantized engine's greedy tokens and
    prompt logprobs (float32), its layers in under a fifth of their float32 bytes (4-bit words, a
    float32 scale and zero a group of 32)."""
    from pagoda import LLM, SamplingParams
    packed = LLM(smollm_path, dtype="float32", kv_cache_memory_bytes=1 << 26, max_model_len=512, quantization="gguf")
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    for a, b in zip(llm.generate(prompts, params, use_tqdm=False), packed.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert next(iter(pa.values())).logprob == pytest.approx(next(iter(pb.values())).logprob, abs=1e-3)

    def layer_bytes(model):
        return sum(t.numel() * t.element_size() for n, t in model.named_parameters() if ".layers." in n)
    dense, ours = llm.apply_model(layer_bytes)[0], packed.apply_model(layer_bytes)[0]
    assert ours < dense / 5, (ours, dense)


@pytest.mark.parametrize("case,arch,types,layouts,tp", [
    # Q4_K_M's experts: gate / up Q4_K (4-bit, groups of 32, zeros with fractions), down Q6_K
    ("qwen3_moe", "qwen3moe", dict(ffn_gate_exps=QT.Q4_K, ffn_up_exps=QT.Q4_K, ffn_down_exps=QT.Q6_K,
                                   attn_q=QT.Q4_K, attn_k=QT.Q4_K, attn_v=QT.Q6_K, attn_output=QT.Q4_K,
                                   ffn_gate=QT.Q4_K, ffn_up=QT.Q4_K, ffn_down=QT.Q6_K), ((4, 32), (8, 16)), 1),
    # Mixtral (arch "llama"): legacy types quantized by gguf-py, gate and up of two types (w13 8-bit)
    ("mixtral", "llama", dict(ffn_gate_exps=QT.Q4_1, ffn_up_exps=QT.Q5_0, ffn_down_exps=QT.Q4_0), ((8, 32), (4, 32)),
     1),
    # each rank its slice of every expert's intermediate size: w13's rows, w2's groups of inputs
    ("qwen3_moe", "qwen3moe", dict(ffn_gate_exps=QT.Q2_K, ffn_up_exps=QT.Q2_K, ffn_down_exps=QT.Q5_K),
     ((4, 16), (8, 32)), 2),
    # a shared expert beside them, packed as a dense MLP (Qwen2-MoE's, with its gate; Granite MoE
    # Shared's, whose experts' gate and up come from one stacked input_linear)
    ("qwen2_moe", "qwen2moe", dict(ffn_gate_exps=QT.Q4_0, ffn_up_exps=QT.Q4_0, ffn_down_exps=QT.Q8_0,
                                   ffn_gate_shexp=QT.Q4_K, ffn_up_shexp=QT.Q4_K, ffn_down_shexp=QT.Q6_K),
     ((4, 32), (8, 32)), 1),
    ("granitemoeshared", "granitemoe", dict(ffn_gate_exps=QT.Q4_K, ffn_up_exps=QT.Q4_K, ffn_down_exps=QT.Q6_K,
                                            ffn_gate_shexp=QT.Q4_K, ffn_up_shexp=QT.Q4_K, ffn_down_shexp=QT.Q6_K),
     ((4, 32), (8, 16)), 1),
], ids=["q4_k_m", "legacy", "tp2", "qwen2_shared", "granite_shared"])
def test_packed_gguf_experts_equal_dequantized(tmp_path, case, arch, types, layouts, tp):
    """quantization="gguf" keeps a mixture's experts packed too (w13 and w2 each 4- or 8-bit in
    groups of 32 or 16 as its block types allow) and gives the dequantized file's greedy tokens
    and prompt logprobs (float32)."""
    from pagoda import LLM, SamplingParams
    from tests.test_architectures import save_tiny
    sizes = {"qwen3_moe": dict(intermediate_size=512, moe_intermediate_size=256),
             "qwen2_moe": dict(moe_intermediate_size=256, shared_expert_intermediate_size=256),
             "granitemoeshared": dict(intermediate_size=256, shared_intermediate_size=256)}.get(
        case, dict(intermediate_size=256))    # (Mixtral's experts')
    folder, _ = save_tiny(tmp_path, case, hidden_size=256, head_dim=64, **sizes)
    path = _hf_gguf(folder, tmp_path / "q.gguf", arch, types)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in ([5, 9, 14, 3, 77], list(range(20, 60)))]
    outs, found = [], []
    for quantization in (None, "gguf"):
        llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
                  quantization=quantization, tensor_parallel_size=tp, **({"device": "cpu"} if tp > 1 else {}))
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        found.append(llm.apply_model(_first_experts_layouts)[0])
        del llm
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert next(iter(pa.values())).logprob == pytest.approx(next(iter(pb.values())).logprob, abs=1e-3)
    assert found == [[], list(layouts)]


@pytest.mark.parametrize("quantization,case,arch", [("gguf", "qwen3_moe", "qwen3moe"), ("fp8", "qwen3", None)])
def test_replaced_weights_take_memory_a_layer_at_a_time(tmp_path, monkeypatch, quantization, case, arch):
    """What a layer's process_weights_after_loading replaces (GGUF's decomposed parts, linear
    and experts; bf16 weights quantized to FP8 at load) is given memory as it loads, and each
    layer is processed once whole: the first layer is repacked before the last one's tensors
    are read, then every parameter has memory, processed exactly once."""
    from pagoda import LLM, SamplingParams
    from pagoda.model import loader
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case, hidden_size=256, head_dim=64, intermediate_size=512,
                          **({"moe_intermediate_size": 256} if arch else {}))
    path = _hf_gguf(folder, tmp_path / "q.gguf", arch, dict.fromkeys(
        ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "attn_q", "attn_k", "attn_v", "attn_output"), QT.Q4_K)) \
        if arch else folder
    events = []
    materialize = loader.materialize
    monkeypatch.setattr(loader, "materialize", lambda m, a: events.append("give memory") or materialize(m, a))
    process = loader._Processed.process

    def recorded(self, module):
        before = len(self.done)
        process(self, module)
        if len(self.done) > before:
            events.append(("process", id(module)))
    monkeypatch.setattr(loader._Processed, "process", recorded)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128,
              quantization=quantization)
    out = llm.generate([{"prompt_token_ids": [5, 9, 14]}], SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert llm.apply_model(_meta_parameters)[0] == 0
    given = [i for i, e in enumerate(events) if e == "give memory"]
    processed = [e for e in events if e != "give memory"]
    assert given and events.index(processed[0]) < given[-1], events
    assert len(processed) == len(set(processed))


def _meta_parameters(model):
    return sum(p.is_meta for p in model.parameters())


def _first_experts_layouts(model):
    """The first packed mixture's (bits, group) of w13 and w2 (picklable: for apply_model at tp > 1)."""
    return [(moe.int4_bits[w], moe.group_sizes[w]) for moe in model.modules()
            if getattr(moe, "int4", None) for w in ("w13", "w2")][:2]


def test_packed_gguf_refusals(tmp_path, smollm_path):
    """quantization="gguf" needs a GGUF file, and experts of a block type (a file of float
    experts loads with it unset)."""
    from pagoda import LLM
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "qwen3")
    with pytest.raises(ValueError, match="no .gguf file"):
        LLM(folder, quantization="gguf")
    folder, _ = save_tiny(tmp_path, "mixtral")
    path = _hf_gguf(folder, tmp_path / "moe.gguf", "llama")
    with pytest.raises(NotImplementedError, match=r"model\.layers\.0\.mlp\.experts's as F32: leave quantization"):
        LLM(path, quantization="gguf", skip_tokenizer_init=True, kv_cache_memory_bytes=1 << 24, max_model_len=128)


def test_granite_gguf_equals_its_safetensors(tmp_path):
    """Granite 3 as llama.cpp writes it (arch "granite": llama's permuted q/k rows, its four
    scalings as metadata): the HF folder's greedy tokens and prompt logprobs."""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, "granite")
    path = _hf_gguf(folder, tmp_path / "granite.gguf", "granite")
    assert GGUFModel(path).hf_config["logits_scaling"] == 8.0
    assert_same_as_folder(path, folder)


@pytest.mark.parametrize("case", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_equals_its_safetensors(tmp_path, case):
    """Gemma as llama.cpp writes it (norm weights stored plus 1; Gemma 2/3's output norms named
    post_attention_norm / post_ffw_norm and their MLP's input norm ffn_norm; Gemma 2's caps, Gemma
    3's linear rope scaling; the sliding window on some layers as llama.cpp places it): the HF
    folder's greedy tokens and prompt logprobs. (Scores over head_dim's root: only the 27B
    models' are not, which the files do not say and the layer count tells.)"""
    from tests.test_architectures import save_tiny
    folder, _ = save_tiny(tmp_path, case, **({} if case == "gemma" else dict(query_pre_attn_scalar=32)))
    path = _hf_gguf(folder, tmp_path / f"{case}.gguf", case)
    assert GGUFModel(path).hf_config["model_type"] == {"gemma3": "gemma3_text"}.get(case, case)
    assert_same_as_folder(path, folder)


def test_gemma_27b_scale_from_the_layer_count(tmp_path):
    """Gemma 2 / 3 27B: the scores over the root of hidden / heads (their query_pre_attn_scalar),
    as llama.cpp reads such files; other sizes over head_dim's."""
    for arch, layers, want in [("gemma3", 62, 64 // 4), ("gemma3", 26, 32), ("gemma2", 46, 64 // 4)]:
        path = tmp_path / f"{arch}-{layers}.gguf"
        w = gguf.GGUFWriter(str(path), arch)
        w.add_block_count(layers)
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_key_length(32)
        w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        assert GGUFModel(path).hf_config["query_pre_attn_scalar"] == want


def test_unsupported_type_names_tensor(tmp_path):
    block, type_size = gguf.GGML_QUANT_SIZES[QT.IQ4_NL]
    data = np.zeros((2, 64 // block * type_size), np.uint8)
    path = _write(tmp_path / "u.gguf", "llama", {"blk.0.ffn_up.weight": (data, QT.IQ4_NL)})
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*IQ4_NL"):
        list(GGUFModel(path).iter_weights())


@pytest.mark.parametrize("size", [0, 3, 100, 1 << 20, 3 << 20])
def test_truncated_file_raises_value_error(smollm_path, tmp_path, size):
    bad = tmp_path / f"cut_{size}.gguf"
    with open(smollm_path, "rb") as f:
        bad.write_bytes(f.read(size))
    with pytest.raises(ValueError, match=str(bad)):
        GGUFModel(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(ValueError, match="x.gguf"):
        GGUFModel(bad)


def test_tokenizer_metadata(model):
    md = model.tokenizer_metadata
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "smollm"
    assert len(md["tokenizer.ggml.tokens"]) == 49152 and md["tokenizer.ggml.tokens"][1] == "<|im_start|>"
