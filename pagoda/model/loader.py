"""Build a model and fill its weights: HF safetensors folders, GGUF files, or random
("dummy") weights for benchmarks."""
import gc
import glob
import os
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from pagoda.config import ArchConfig, ModelConfig, apply_hf_overrides, classifier_from_tokens
from pagoda.model.gguf_file import FLOAT_TYPES, GGUFModel
from pagoda.model.hub import read_json
from pagoda.model.layers.fused_moe import expert_param_name
from pagoda.model.pipeline import missing_prefixes
from pagoda.model.registry import get_model_class
from pagoda.quant.base import get_quant_method


def read_arch_config(path: str, hf_overrides=None) -> ArchConfig:
    """The model's config.json (a GGUF's metadata rendered as one), with vLLM's ``hf_overrides``."""
    d = GGUFModel(path).hf_config if path.endswith(".gguf") else read_json(Path(path) / "config.json")
    return ArchConfig.from_hf_dict(apply_hf_overrides(d, hf_overrides))


def read_quant_config(path: str, arch: ArchConfig) -> dict | None:
    """A checkpoint's quantization config: config.json's ``quantization_config``, or the
    ``quantize_config.json`` that older GPTQ exports put beside it (None for GGUF files, whose
    quantized types are dequantized at load)."""
    if path.endswith(".gguf"):
        return None
    config = arch.hf_config.get("quantization_config")
    f = Path(path) / "quantize_config.json"
    if config is None and f.is_file():
        config = {"quant_method": "gptq", **read_json(f)}
    return config


def read_generation_config(path: str) -> dict:
    f = Path(path) / "generation_config.json"
    return read_json(f) if not path.endswith(".gguf") and f.is_file() else {}


def read_pooler_config(path: str) -> dict:
    """The pooling a sentence-transformers folder declares (``modules.json``, its Pooling
    module's ``config.json``): {"pooling_type", "normalize"}, or {} for a folder without them."""
    modules = Path(path) / "modules.json"
    if path.endswith(".gguf") or not modules.is_file():
        return {}
    found = {"normalize": False}
    for module in read_json(modules):
        kind = module.get("type", "")
        if kind.endswith("Normalize"):
            found["normalize"] = True
        elif kind.endswith("Pooling"):
            modes = read_json(Path(path) / module.get("path", "") / "config.json")
            on = sorted(k for k, v in modes.items() if k.startswith("pooling_mode") and v)
            names = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
            if len(on) != 1 or on[0] not in names:
                raise ValueError(f"{modules.parent}: unsupported sentence-transformers pooling {on}; "
                                 "supported: exactly one of last token, mean, CLS.")
            found["pooling_type"] = names[on[0]]
    return found


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(read_json(index)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise ValueError(f"Model folder {folder} is missing weight files listed in its index: {missing}.")
        return [os.path.join(folder, n) for n in names]
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"Model folder {folder} has no *.safetensors weight files.")
    return files


def iter_safetensors(folder: str, skip: tuple[str, ...] = (), prefixes: dict | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors by the model's names (``prefixes``: its ``checkpoint_prefixes``),
    but for those whose names start with one of ``skip`` and those it has no use for (never read)."""
    from safetensors import SafetensorError, safe_open
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = renamed(stored, prefixes)
                    if name is not None and not (skip and name.startswith(skip)):
                        yield name, f.get_tensor(stored)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"Cannot read weights file {file} (truncated or corrupt?): {e}") from None


def renamed(name: str, prefixes: dict | None) -> str | None:
    """A checkpoint tensor's name in the model: the first of ``prefixes`` (a model class's
    ``checkpoint_prefixes``: {stored prefix: the model's, or None for tensors it does not use})
    that it starts with replaced."""
    for old, new in (prefixes or {}).items():
        if name.startswith(old):
            return None if new is None else new + name[len(old):]
    return name


def stored_unquantized(folder: str, prefixes: dict | None = None) -> set[str]:
    """The modules whose ``.weight`` a (quantized) checkpoint stores in 16- or 32-bit floats: the
    layers its quantization left out (compressed-tensors' ``ignore``, FP8's ``ignored_layers``,
    AWQ's ``modules_to_not_convert``: each format names them its own way, the tensors say it
    one way), by the model's names (``prefixes``: as ``iter_safetensors``'). Reads the files'
    headers only."""
    from safetensors import SafetensorError, safe_open
    found = set()
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():
                    name = renamed(stored, prefixes)
                    if name is not None and name.endswith(".weight") and \
                            f.get_slice(stored).get_dtype() in ("BF16", "F16", "F32"):
                        found.add(name.removesuffix(".weight"))
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ValueError(f"Cannot read weights file {file} (truncated or corrupt?): {e}") from None
    return found


def leave_unquantized(model: nn.Module, modules: set[str]) -> None:
    """Give the quantized linear layers that the checkpoint stores unquantized (``modules``, by
    the checkpoint's names) unquantized weights. A fused layer (q/k/v, gate/up) must have all of
    its parts one way or the other; experts must be quantized."""
    from pagoda.model.layers.linear import LinearBase
    from pagoda.quant.base import UnquantizedLinearMethod
    mapping = getattr(model, "packed_modules_mapping", {})
    owners = dict(model.named_modules())
    parts: dict[str, set] = {}
    for module in modules:
        name, shard_id = _param_name(module + ".weight", mapping)
        owner = name.rpartition(".")[0]
        layer = owners.get(owner)
        if getattr(layer, "int4", None) or getattr(layer, "w8", None):   # (a quantized mixture of experts)
            raise NotImplementedError(f"The checkpoint stores the expert {module} unquantized under its quantization "
                                      "config; pagoda loads the experts of quantized checkpoints quantized only.")
        if isinstance(layer, LinearBase) and not isinstance(layer.quant_method, UnquantizedLinearMethod):
            parts.setdefault(owner, set()).add(shard_id)
    shards: dict[str, set] = {}
    for fused, sid in mapping.values():
        shards.setdefault(fused, set()).add(sid)
    for owner, found in parts.items():
        layer, want = owners[owner], shards.get(owner.rpartition(".")[2], {None})
        if found != want:
            raise NotImplementedError(f"The checkpoint stores parts {sorted(map(str, found))} of {owner} unquantized "
                                      f"and the others {sorted(map(str, want - found))} quantized; pagoda fuses them "
                                      "into one layer, which must be one or the other.")
        for name in [n for n in layer._parameters if n != "bias"]:
            del layer._parameters[name]
        layer.quant_method = UnquantizedLinearMethod()
        layer.quant_method.create_weights(layer, layer.in_features, layer.out_features, torch.get_default_dtype())


# An FP8 KV cache's scales as checkpoints name them (vLLM's own, the older kv_scale for both,
# NVIDIA ModelOpt's, compressed-tensors' output scales of k_proj / v_proj): which of the layer's
# Attention scales each sets.
KV_SCALE_NAMES = {"self_attn.k_scale": ("k_scale",), "self_attn.v_scale": ("v_scale",),
                  "self_attn.kv_scale": ("k_scale", "v_scale"),
                  "self_attn.k_proj.k_scale": ("k_scale",), "self_attn.v_proj.v_scale": ("v_scale",),
                  "self_attn.k_proj.output_scale": ("k_scale",), "self_attn.v_proj.output_scale": ("v_scale",)}


def _load_kv_scale(modules: dict[str, nn.Module], name: str, tensor: torch.Tensor) -> bool:
    """Set the attention's k_scale / v_scale if ``name`` is one (True), else False."""
    for suffix, attrs in KV_SCALE_NAMES.items():
        if name.endswith("." + suffix):
            attn = modules[name.removesuffix(suffix) + "self_attn.attn"]
            scale = float(tensor.float().reshape(-1)[0])
            if not 0 < scale < float("inf"):
                raise ValueError(f"Checkpoint tensor {name!r} is a KV cache scale of {scale}: it must be positive "
                                 "and finite.")
            for attr in attrs:
                setattr(attn, attr, scale)
            return True
    return False


def load_weights(model: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], strict: bool = True,
                 on_layer_loaded: Callable[[nn.Module], None] | None = None) -> set[str]:
    """The checkpoint's (name, tensor) pairs into ``model`` (this rank's shard: the parameters'
    loaders cut theirs). ``strict``: every weight must come (a whole checkpoint); else any of
    them may (a weight update), and those of other pipeline stages are passed over.
    ``on_layer_loaded``: called with each module once all its parameters are (but those with an
    optional one: it may come later or never). Returns the names loaded."""
    params = dict(model.named_parameters(remove_duplicate=False))
    others = () if strict else missing_prefixes(model)
    modules = dict(model.named_modules())
    mapping = getattr(model, "packed_modules_mapping", {})
    aliases = checkpoint_aliases(params)
    tied = ties_lm_head(model)
    prefixes = getattr(model, "checkpoint_prefixes", None)
    expected, optional = _expected_names(model, mapping)
    loaded: set[str] = set()
    if hasattr(model, "checkpoint_weights"):    # (a layout of its own: Granite MoE's stacked experts)
        weights = model.checkpoint_weights(weights)
    for name, tensor in weights:
        name = renamed(name, prefixes)   # (a weight update's come by the checkpoint's names; the model's pass)
        if name is None:
            continue
        # (compressed-tensors' packed weights carry their unpacked shape, which the config gives)
        if "rotary_emb.inv_freq" in name or name.endswith(".weight_shape") or _load_kv_scale(modules, name, tensor):
            continue
        if name == "lm_head.weight" and tied:
            continue
        if tied and name == "model.embed_tokens.weight" and "lm_head.weight" in params \
                and "model.embed_tokens.weight" not in params:
            name = "lm_head.weight"       # a last stage without the embedding: its LM head is it
        name, shard_id = _param_name(name, mapping)
        name = aliases.get(name, name)
        param = params.get(name)
        if param is None and others and name.startswith(others):
            continue
        if param is None:
            raise ValueError(f"Checkpoint tensor {name!r} has no place in {type(model).__name__}.")
        # The layer that owns the parameter cuts its shard. (Its method is looked up here, not
        # stored on the parameter: a bound method there makes a layer <-> parameter cycle,
        # which the engine's gc.freeze() would keep alive after the engine is dropped.)
        owner = name.rpartition(".")[0]
        module = modules[owner]
        if param.is_meta:
            param = params[name] = materialize(module, name.rpartition(".")[2])
        loader = getattr(module, "weight_loader", None)
        if loader is None:
            param.data.copy_(tensor)
            keys = [name]
        elif shard_id is None and hasattr(module, "checkpoint_shards"):
            # a fused layer's projections stored whole (Phi-3's qkv_proj, gate_up_proj)
            keys = []
            for sid, part in module.checkpoint_shards(param, tensor):
                loader(param, part, sid)
                keys.append(f"{name}:{sid}")
        elif shard_id is None:
            loader(param, tensor)
            keys = [name]
        else:
            loader(param, tensor, shard_id)
            keys = [f"{name}:{shard_id}"]
        loaded.update(keys)
        left = expected.get(owner)
        if on_layer_loaded is not None and left and owner not in optional:
            left.difference_update(keys)
            if not left:
                on_layer_loaded(module)
    missing = sorted(k for left in expected.values() for k in left if k not in loaded)
    if missing and strict:
        raise ValueError(f"The checkpoint lacks {len(missing)} weights, e.g. {missing[:4]}.")
    return loaded


def materialize(module: nn.Module, attr: str) -> nn.Parameter:
    """A lazy parameter (``quant.base.lazy_parameter``) of ``module`` given memory, uninitialised,
    on the device the model was built on: a new parameter with the old one's attributes."""
    old = module._parameters[attr]
    new = nn.Parameter(torch.empty(old.shape, dtype=old.dtype, device=old.load_device), requires_grad=False)
    new.__dict__.update(old.__dict__)
    module._parameters[attr] = new
    return new


def checkpoint_aliases(params: dict[str, nn.Parameter]) -> dict[str, str]:
    """Parameters a checkpoint stores under another name (``param.checkpoint_name``, set where
    the layer makes it), by that name: compressed-tensors' block-wise FP8 scales, its
    ``weight_scale``, held as ``weight_scale_inv`` (the name vLLM's FP8 checkpoints give them,
    and the kernels read)."""
    return {f"{name.rpartition('.')[0]}.{p.checkpoint_name}": name for name, p in params.items()
            if hasattr(p, "checkpoint_name")}


def _param_name(name: str, mapping: dict) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills and its loader's shard id (None: the whole
    tensor). ``mapping`` renames the checkpoint's modules (fused ones with the slice they hold:
    q_proj -> qkv_proj "q"; Mixtral's w1 -> gate_up_proj 0), every entry that matches; an
    expert's tensor then goes to the experts' stacked weight."""
    shard_id = None
    for ckpt_name, (fused, sid) in mapping.items():
        if f".{ckpt_name}." in name:
            name = name.replace(f".{ckpt_name}.", f".{fused}.")
            shard_id = sid if sid is not None else shard_id
    return expert_param_name(name, shard_id) or (name, shard_id)


def ties_lm_head(model: nn.Module) -> bool:
    """The LM head is the embedding (a classifier's config may say so too: it has no LM head)."""
    return model.config.tie_word_embeddings and hasattr(model, "lm_head")


def _expected_names(model: nn.Module, mapping: dict) -> tuple[dict[str, set[str]], set[str]]:
    """What a whole checkpoint loads into each module (by the module's name): its parameters'
    names, with each shard's id where shards fill them (optional ones left out); and the
    modules that have an optional parameter."""
    shards: dict[str, list] = {}
    for fused, sid in mapping.values():
        if sid is not None:      # (an entry that only renames loads its tensor whole)
            shards.setdefault(fused, []).append(sid)
    names: dict[str, set[str]] = {}
    optional = set()
    for name, p in model.named_parameters():   # tied weights appear once
        owner = name.rpartition(".")[0]
        if getattr(p, "optional", False):       # (FP8's static input_scale)
            optional.add(owner)
            continue
        module = owner.rpartition(".")[2]
        if hasattr(p, "shard_ids"):             # (the experts' stacked weights)
            keys = {f"{name}:{sid}" for sid in p.shard_ids}
        elif module in shards:
            keys = {f"{name}:{sid}" for sid in shards[module]}
        else:
            keys = {name}
        names.setdefault(owner, set()).update(keys)
    return names, optional


def other_stages_weights(model: nn.Module) -> tuple[str, ...]:
    """Name prefixes of the checkpoint tensors that other pipeline stages hold, so this one
    never reads them (but the embedding's, when this stage's LM head, or the score head made
    from it, is tied to it)."""
    skip = missing_prefixes(model)
    converted = classifier_from_tokens(model.config) is not None
    head = "score." if converted else "lm_head."
    if converted and head in skip:
        skip += ("lm_head.",)          # (the LM head the score head would be made from)
    if model.config.tie_word_embeddings and (ties_lm_head(model) or converted) and head not in skip:
        skip = tuple(p for p in skip if p != "model.embed_tokens.")
    return skip


def score_from_lm_head(weights: Iterator[tuple[str, torch.Tensor]], model: nn.Module,
                       token_ids: tuple[int, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """A causal LM's checkpoint read as the classifier ``model`` (``config.classifier_from_tokens``):
    its LM head (or the embedding it is tied to) is not loaded, but its rows of ``token_ids``
    become ``score.weight``, or their difference true - false for a 2-way softmax."""
    params = dict(model.named_parameters())
    _, two_way = classifier_from_tokens(model.config)
    head = None
    for name, tensor in weights:
        if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and model.config.tie_word_embeddings):
            head = tensor
            if name not in params:      # (an embedding read for the head alone: another stage's)
                continue
        yield name, tensor
    if "score.weight" not in params:    # a pipeline stage before the last
        return
    if head is None:
        raise ValueError("classifier_from_token reads the score head from the checkpoint's LM head, but it has no "
                         "lm_head.weight (nor a tied embedding).")
    rows = head[list(token_ids)].float()
    yield "score.weight", ((rows[1] - rows[0])[None] if two_way else rows).to(head.dtype)


class _Processed:
    """Each layer's ``process_weights_after_loading``, once: as soon as it is loaded (so that the
    memory of what it replaces goes back layer by layer), or after the whole checkpoint."""

    def __init__(self):
        self.done: set[int] = set()

    def process(self, module: nn.Module) -> None:
        qm = getattr(module, "quant_method", None)
        if qm is not None and id(module) not in self.done:
            self.done.add(id(module))
            qm.process_weights_after_loading(module)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Small uniform values: speed does not depend on them and activations stay finite (packed
    integer and FP8 weights of quantized layers: zeros, which every format reads as valid)."""
    for module in model.modules():
        for attr in [a for a, p in module._parameters.items() if p is not None and p.is_meta]:
            materialize(module, attr)
    for i, (name, p) in enumerate(model.named_parameters()):
        if not p.is_floating_point() or p.element_size() == 1:
            p.data.zero_()
        elif name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed + i)
            p.data.uniform_(-1e-2, 1e-2, generator=gen)


def _build(cls, config: ModelConfig, device: torch.device | str, gguf: GGUFModel | None = None) -> nn.Module:
    """The model's modules on ``device``, unloaded (``gguf``: the file of a GGUF config, if
    already open)."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device):
            model = cls(config.arch, get_quant_method(config.quantization, config.quant_config))
            if config.quant_config is not None and config.load_format != "dummy" and not config.is_gguf:
                leave_unquantized(model, stored_unquantized(config.path, getattr(cls, "checkpoint_prefixes", None)))
            if config.quantization == "gguf" and config.load_format != "dummy":
                types = (gguf or GGUFModel(config.path)).hf_types
                _check_gguf_experts(model, types)
                leave_unquantized(model, {name.removesuffix(".weight") for name, qtype in types.items()
                                          if qtype in FLOAT_TYPES})
            return model
    finally:
        torch.set_default_dtype(prev)


def _check_gguf_experts(model: nn.Module, types: dict) -> None:
    """quantization="gguf" keeps experts packed: a file whose experts are floats (whose dense
    layers are left unquantized) needs it unset."""
    from pagoda.model.layers.fused_moe import FusedMoE
    for name, layer in _layers_of(model, types):
        if isinstance(layer, FusedMoE) and types[name] in FLOAT_TYPES:
            raise NotImplementedError(f"quantization='gguf' keeps a mixture's experts packed, but the file stores "
                                      f"{name.rsplit('.', 3)[0]}'s as {types[name].name}: leave quantization unset "
                                      "to load them as they are.")


def gguf_packed(model: nn.Module, gguf: GGUFModel) -> set[str]:
    """The GGUF matrices (HF names) that go to layers of ``quantization="gguf"``'s packed method
    (linear layers, experts)."""
    from pagoda.model.layers.fused_moe import FusedMoE
    from pagoda.model.layers.linear import LinearBase
    from pagoda.quant.int4 import GGUFLinearMethod
    return {name for name, layer in _layers_of(model, gguf.hf_types)
            if isinstance(layer, LinearBase) and isinstance(layer.quant_method, GGUFLinearMethod)
            or isinstance(layer, FusedMoE) and getattr(layer.int4, "method", None) == "gguf"}


def _layers_of(model: nn.Module, names) -> Iterator[tuple[str, nn.Module | None]]:
    """Each checkpoint tensor name with the module that loads it (None: no module's)."""
    mapping, owners = getattr(model, "packed_modules_mapping", {}), dict(model.named_modules())
    for name in names:
        yield name, owners.get(_param_name(name, mapping)[0].rpartition(".")[0])


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of the GPU the model failed to fit on (only CUDA raises
    ``torch.OutOfMemoryError``)."""
    gc.collect()              # the half-built model's tensors
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def weights_do_not_fit(cls, config: ModelConfig, device: torch.device) -> ValueError:
    """The error for weights that exceed the device's free memory, saying how large a model
    would fit (counted on the meta device: shapes and dtypes only). Built only on failure:
    the meta device's first use costs seconds of start-up."""
    free, total = device_memory(device)
    meta = _build(cls, config, "meta")
    need = sum(t.numel() * t.element_size() for t in list(meta.parameters()) + list(meta.buffers()))
    params = sum(t.numel() for t in meta.parameters())
    fits = free / (need / params) / 1e9
    gib = 1 << 30
    return ValueError(
        f"The weights of {config.arch.architecture} ({params / 1e9:.2f}B parameters, {need / gib:.1f} GiB "
        f"in {str(config.dtype).removeprefix('torch.')}) do not fit in the {free / gib:.1f} GiB free on "
        f"{device} ({total / gib:.1f} GiB in all): a model of at most about {fits:.2f}B parameters would, "
        "before any KV cache. Use a smaller model, a quantized checkpoint, or free the device's memory.")


def get_model(config: ModelConfig, device: torch.device) -> nn.Module:
    cls = get_model_class(config.arch.architecture)
    try:
        model = _built_and_loaded(cls, config, device)
    except torch.OutOfMemoryError:
        model = None   # (raised below, once the half-built model is unreferenced)
    if model is None:
        raise weights_do_not_fit(cls, config, device)
    if config.compute_dtype != config.dtype:
        # Weights keep the values of the requested dtype; the math runs in compute_dtype. (Only
        # tensors of that dtype: FP8 weights stay FP8, their float32 scales float32.)
        model._apply(lambda t: t.to(config.compute_dtype) if t.dtype == config.dtype else t)
    return model.eval()


def _built_and_loaded(cls, config: ModelConfig, device: torch.device) -> nn.Module:
    """The model with its weights (lazy parameters given memory as they load: an out-of-memory
    error may come from here as from the build), each layer processed after loading."""
    gguf = GGUFModel(config.path) if config.is_gguf and config.load_format != "dummy" else None
    model = _build(cls, config, device, gguf)
    processed = _Processed()
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        skip = other_stages_weights(model)
        weights = gguf.iter_weights(skip, device, gguf_packed(model, gguf)) if gguf \
            else iter_safetensors(config.path, skip, getattr(model, "checkpoint_prefixes", None))
        if config.classifier_token_ids:
            weights = score_from_lm_head(weights, model, config.classifier_token_ids)
        load_weights(model, weights, on_layer_loaded=processed.process)
    for m in model.modules():
        processed.process(m)
    return model
