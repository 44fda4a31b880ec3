"""A round-to-nearest quantizer that writes GPTQ, AWQ and compressed-tensors checkpoints as
AutoGPTQ / AutoAWQ / llm-compressor lay them out (DESIGN.md's quantization reference), for the
loader's tests. Its packing is written from the formats' descriptions (compressed-tensors': the
package's own packer), not from pagoda's unpacking, so the two check each other."""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Where a GGUF block type keeps its float16 scales: the block's start (legacy types: d, and m for
# the _1 types), or the K-quants' own places (d, dmin / d)
GGUF_SCALE_OFFSETS = {QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2], QT.Q8_0: [0],
                      QT.Q2_K: [80, 82], QT.Q3_K: [108], QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208]}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn(w: torch.Tensor, bits: int, group: int, g_idx: torch.Tensor, sym: bool = False):
    """Round-to-nearest of ``w`` ``(N, K)`` in groups of input channels (``g_idx``): integer
    values ``q (K, N)``, zero points ``(groups, N)`` and scales ``(groups, N)``. Symmetric: every
    zero point is ``2**(bits - 1)`` (what GPTQ's v1 format can store)."""
    groups = int(g_idx.max()) + 1
    wt = w.t().float()                                  # (K, N)
    lo = torch.stack([wt[g_idx == g].min(0).values for g in range(groups)]).clamp(max=0)
    hi = torch.stack([wt[g_idx == g].max(0).values for g in range(groups)]).clamp(min=0)
    top = (1 << bits) - 1
    if sym:
        half = 1 << (bits - 1)
        scales = (torch.maximum(-lo, hi) / (half - 1)).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, half, dtype=torch.int32)
    else:
        scales = ((hi - lo) / top).clamp(min=1e-8).half()
        zeros = (-lo / scales.float()).round().clamp(0, top).int()
    q = (wt / scales[g_idx].float() + zeros[g_idx]).round().clamp(0, top).int()
    return q, zeros, scales


def dequant(q, zeros, scales, g_idx) -> torch.Tensor:
    """``(N, K)``, as the formats define it."""
    return ((q - zeros[g_idx]).float() * scales[g_idx].float()).t()


def _words(values: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits."""
    return (values - (values >= 1 << 31).long() * (1 << 32)).int()


def pack_gptq_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``(K, N)`` -> ``(K * bits / 32, N)``: row r holds inputs ``pack * r + j`` at bits ``bits * j``."""
    pack = 32 // bits
    word = torch.zeros(q.shape[0] // pack, q.shape[1], dtype=torch.int64)
    for j in range(pack):
        word |= q[j::pack].long() << (bits * j)
    return _words(word)


def pack_cols(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """``(R, C)`` -> ``(R, C * bits / 32)``: slot i of word c holds column ``pack * c + order[i]``."""
    pack = 32 // bits
    order = order or tuple(range(pack))
    word = torch.zeros(values.shape[0], values.shape[1] // pack, dtype=torch.int64)
    for i in range(pack):
        word |= values[:, order[i]::pack].long() << (bits * i)
    return _words(word)


def convert_folder(src: str, dst: str, convert, quant_config: dict, dtype: torch.dtype, keep: tuple = ()) -> str:
    """Copy the HF folder ``src`` to ``dst``, each decoder linear weight replaced by what
    ``convert(prefix, projection, weight)`` returns (the checkpoint's tensors for it, and the
    weight they stand for), the other tensors cast to ``dtype``, with ``quant_config``; and beside
    it ``dst + "-dequant"``: the same model unquantized, float32, holding the weights they stand for.
    ``keep``: linear layers (their names) left unquantized, as a quantizer's ignore list leaves them."""
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    quant, dense = {}, {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[-2] not in LINEARS or module[-1] != "weight" or name[:-len(".weight")] in keep:
            quant[name] = w.to(dtype) if w.is_floating_point() else w     # (as checkpoints are)
            dense[name] = quant[name].float()
            continue
        prefix = name[:-len(".weight")]
        stored, dense[name] = convert(prefix, module[-2], w)
        quant.update(stored)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for folder, weights, extra in [
            (dst, quant, {"torch_dtype": str(dtype).removeprefix("torch."), "quantization_config": quant_config}),
            (dst + "-dequant", dense, {"torch_dtype": "float32"})]:
        os.makedirs(folder, exist_ok=True)
        save_file(weights, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    return dst


def quantize_folder(src: str, dst: str, method: str, bits: int = 4, group: int | None = 32, desc_act: bool = False,
                    v2: bool = False, seed: int = 0, sym: bool = True, keep: tuple = ()) -> str:
    """``src`` as a GPTQ, AWQ or compressed-tensors pack-quantized (llm-compressor's W4A16 /
    W8A16) checkpoint (``convert_folder``; GPTQ's v1 format symmetric, as it must be; ``sym``
    False: compressed-tensors' asymmetric scheme, with zero points; ``group`` None: its channel
    strategy). With ``desc_act``, each layer's input channels are put in groups in a random order
    (act-order), shared by the layers that read the same input. ``keep``: layers left unquantized
    (compressed-tensors' ``ignore``). Compressed-tensors words are packed by its own
    ``pack_to_int32``."""
    gen = torch.Generator().manual_seed(seed)
    orders: dict[tuple, torch.Tensor] = {}

    def convert(prefix, projection, w):
        k = w.shape[1]
        g_idx = torch.arange(k) // (group or k)
        if desc_act:   # one random order per input (the layer index and which input it reads)
            key = (prefix.rsplit(".", 2)[0], "mlp_in" if projection in ("gate_proj", "up_proj") else
                   "attn_in" if projection in ("q_proj", "k_proj", "v_proj") else projection)
            if key not in orders:
                orders[key] = g_idx[torch.randperm(k, generator=gen)]
            g_idx = orders[key]
        q, zeros, scales = rtn(w, bits, group or k, g_idx, sym=(method == "gptq" and not v2) or
                               (method == "compressed-tensors" and sym))
        if method == "gptq":
            stored = {".qweight": pack_gptq_qweight(q, bits),
                      ".qzeros": pack_cols(zeros if v2 else zeros - 1, bits),   # v1 stores zero - 1
                      ".g_idx": g_idx.int(), ".scales": scales}
        elif method == "awq":
            stored = {".qweight": pack_cols(q, bits, AWQ_ORDER), ".qzeros": pack_cols(zeros, bits, AWQ_ORDER),
                      ".scales": scales}
        else:     # (N, K) tensors of signed values; the packer offsets them by 2**(bits - 1)
            # (the package's own packer; a test extra, which the GPU machine lacks: skipped there)
            pytest.importorskip("compressed_tensors", reason="writes the checkpoint with compressed-tensors' packer")
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            scales = scales.bfloat16()

            def signed(values):
                return (values - (1 << (bits - 1))).t().contiguous().to(torch.int8)
            stored = {".weight_packed": pack_to_int32(signed(q), bits), ".weight_scale": scales.t().contiguous(),
                      ".weight_shape": torch.tensor(w.shape)}
            if not sym:
                stored[".weight_zero_point"] = pack_to_int32(signed(zeros), bits, packed_dim=0)
            if desc_act:
                stored[".weight_g_idx"] = g_idx.int()
        return {prefix + k: v for k, v in stored.items()}, dequant(q, zeros, scales, g_idx)

    if method == "gptq":
        config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": not v2,
                  "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    elif method == "awq":
        config = {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "group" if group else "channel",
                   "group_size": group, "dynamic": False, "actorder": "group" if desc_act else None}
        config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                  "ignore": ["lm_head", *keep], "config_groups": {"group_0": {
                      "targets": ["Linear"], "weights": weights, "input_activations": None}}}
    return convert_folder(src, dst, convert, config, torch.bfloat16 if method == "compressed-tensors" else torch.float16,
                          keep)


def fp8_folder(src: str, dst: str, static: bool = False, keep: tuple = ()) -> str:
    """``src`` in vLLM's FP8 format (``quant_method: "fp8"``; ``convert_folder``): every decoder
    linear weight in float8_e4m3fn with a per-tensor scale (its largest magnitude over 448; so q,
    k and v, and gate and up, get different scales), with ``static`` a per-tensor
    ``input_scale`` too; ``keep``: its ``ignored_layers``."""
    def convert(prefix, projection, w):
        scale = w.float().abs().max() / 448.0
        q = (w.float() / scale).to(torch.float8_e4m3fn)
        stored = {prefix + ".weight": q, prefix + ".weight_scale": scale.reshape(())}
        if static:
            stored[prefix + ".input_scale"] = torch.tensor(0.05)
        return stored, q.float() * scale

    config = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic", "ignored_layers": list(keep)}
    return convert_folder(src, dst, convert, config, torch.bfloat16, keep)


def fp8_block_folder(src: str, dst: str, block: tuple[int, int] = (32, 32), compressed: bool = False) -> str:
    """``src`` as DeepSeek's and Qwen3's FP8 releases are stored (``quant_method: "fp8"``,
    ``weight_block_size``; ``convert_folder``): every decoder linear weight in float8_e4m3fn with
    a scale per ``block`` of it, ``weight_scale_inv (ceil(N / bn), ceil(K / bk))``, each block's
    largest magnitude over 448 (its dequantizing factor, despite the name). ``compressed``: as
    llm-compressor's FP8_BLOCK scheme writes the same (compressed-tensors, ``block_structure``,
    the scales named ``weight_scale``, activations quantized per group of 128)."""
    bn, bk = block

    def convert(prefix, projection, w):
        n, k = w.shape
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = w.float()
        blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w.float() / full).to(torch.float8_e4m3fn)
        return {prefix + (".weight_scale" if compressed else ".weight_scale_inv"): scale, prefix + ".weight": q}, \
            q.float() * full

    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block)}
    if compressed:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                   "block_structure": list(block), "dynamic": False}
        config = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                      "num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128,
                      "dynamic": True}}}}
    return convert_folder(src, dst, convert, config, torch.bfloat16)


def compressed_folder(src: str, dst: str, kind: str = "int", strategy: str = "channel", keep: tuple = ()) -> str:
    """``src`` as llm-compressor writes a compressed-tensors checkpoint of symmetric 8-bit
    weights (``convert_folder``): ``kind`` "int" (INT8, the W8A8 scheme, dynamic per-token
    activations) or "float" (FP8), scales per channel ``(N, 1)`` or per tensor ``(1,)``; ``keep``:
    layers it ignores."""
    top = 127.0 if kind == "int" else 448.0

    def convert(prefix, projection, w):
        amax = w.float().abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.float().abs().max().reshape(1)
        scale = amax / top
        scaled = w.float() / (scale if strategy == "channel" else scale[0])
        q = scaled.round().clamp(-128, 127).to(torch.int8) if kind == "int" else scaled.to(torch.float8_e4m3fn)
        return ({prefix + ".weight": q, prefix + ".weight_scale": scale},
                q.float() * (scale if strategy == "channel" else scale[0]))

    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy, "dynamic": False}
    config = {"quant_method": "compressed-tensors", "format": f"{kind}-quantized", "ignore": ["lm_head", *keep],
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": {
                  "num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}}}}
    return convert_folder(src, dst, convert, config, torch.bfloat16, keep)


def random_gguf_blocks(rng: np.random.Generator, qtype: QT, rows: int, cols: int, scale: float = 0.01) -> np.ndarray:
    """Random ``rows`` of GGUF blocks of ``qtype`` (uint8, a row of blocks each) whose float16
    scales are ``scale``: finite, as a real file's (random bytes would be NaN or huge)."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    half = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    for offset in GGUF_SCALE_OFFSETS[qtype]:
        data[..., offset:offset + 2] = half
    return data.reshape(rows, -1)
