"""A round-to-nearest quantizer that writes GPTQ and AWQ checkpoints as AutoGPTQ / AutoAWQ lay
them out (DESIGN.md's quantization reference), for the loader's tests. Its packing is written
from the formats' descriptions, not from pagoda's unpacking, so the two check each other."""
import json
import os

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
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


def quantize_folder(src: str, dst: str, method: str, bits: int = 4, group: int = 32, desc_act: bool = False,
                    v2: bool = False, seed: int = 0) -> str:
    """Copy the HF folder ``src`` to ``dst`` with every decoder linear layer quantized (GPTQ or
    AWQ; GPTQ's v1 format symmetric, as it must be), and beside it ``dst + "-dequant"``: the same
    model with the dequantized weights in float32, unquantized. With ``desc_act``, each layer's
    input channels are put in groups in a random order (GPTQ act-order), shared by the layers
    that read the same input."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    quant, dense = {}, {}
    orders: dict[tuple, torch.Tensor] = {}
    for name, w in tensors.items():
        module = name.rsplit(".", 2)
        if len(module) < 3 or module[-2] not in LINEARS or module[-1] != "weight":
            quant[name] = w.half() if w.is_floating_point() else w     # (a float16 checkpoint, as they are)
            dense[name] = quant[name].float()
            continue
        prefix = name[:-len(".weight")]
        n, k = w.shape
        g_idx = torch.arange(k) // group
        if desc_act:   # one random order per input (the layer index and which input it reads)
            key = (prefix.rsplit(".", 2)[0], "mlp_in" if module[-2] in ("gate_proj", "up_proj") else
                   "attn_in" if module[-2] in ("q_proj", "k_proj", "v_proj") else module[-2])
            if key not in orders:
                orders[key] = g_idx[torch.randperm(k, generator=gen)]
            g_idx = orders[key]
        q, zeros, scales = rtn(w, bits, group, g_idx, sym=method == "gptq" and not v2)
        dense[name] = dequant(q, zeros, scales, g_idx)
        if method == "gptq":
            quant[prefix + ".qweight"] = pack_gptq_qweight(q, bits)
            quant[prefix + ".qzeros"] = pack_cols(zeros if v2 else zeros - 1, bits)   # v1 stores zero - 1
            quant[prefix + ".g_idx"] = g_idx.int()
        else:
            quant[prefix + ".qweight"] = pack_cols(q, bits, AWQ_ORDER)
            quant[prefix + ".qzeros"] = pack_cols(zeros, bits, AWQ_ORDER)
        quant[prefix + ".scales"] = scales
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for folder, weights, extra in [
            (dst, quant, {"torch_dtype": "float16", "quantization_config": (
                {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": not v2,
                 "checkpoint_format": "gptq_v2" if v2 else "gptq"} if method == "gptq" else
                {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"})}),
            (dst + "-dequant", dense, {"torch_dtype": "float32"})]:
        os.makedirs(folder, exist_ok=True)
        save_file(weights, os.path.join(folder, "model.safetensors"))
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)
    return dst
