"""Pipeline parallelism in the model: which decoder layers a stage holds, the placeholder for
the modules it does not, and the activations that pass between stages."""
import torch
from torch import nn


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """Layers ``[start, end)`` of stage ``pp_rank``: an even split, the remainder one each to the
    stages just before the last (the last also runs the norm and the LM head), as vLLM splits."""
    sizes = [num_layers // pp_size] * pp_size
    for i in range(num_layers % pp_size):
        sizes[-2 - i] += 1
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


class PPMissingLayer(nn.Identity):
    """Stands where another stage's module is: no weights, so the loader skips its tensors and
    the parameter names of the modules this stage holds keep their checkpoint indices."""


class IntermediateTensors(dict):
    """What a stage hands the next: ``hidden_states`` and ``residual`` (name -> tensor)."""


def missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The names of the modules another stage holds (``model.layers.3.``, ``lm_head.``)."""
    return tuple(name + "." for name, m in model.named_modules() if isinstance(m, PPMissingLayer))


def make_layers(num_layers: int, pp_rank: int, pp_size: int, make) -> tuple[int, int, nn.ModuleList]:
    """This stage's layers ``make(index)`` at their own indices, PPMissingLayer at the others'."""
    start, end = get_pp_indices(num_layers, pp_rank, pp_size)
    layers = nn.ModuleList(make(i) if start <= i < end else PPMissingLayer() for i in range(num_layers))
    return start, end, layers


def hidden_shapes(num_tokens: int, hidden_size: int) -> dict[str, tuple[int, int]]:
    return {"hidden_states": (num_tokens, hidden_size), "residual": (num_tokens, hidden_size)}


def empty_intermediate(num_tokens: int, hidden_size: int, dtype: torch.dtype, device) -> IntermediateTensors:
    """Stand-in activations for a stage's profiling and warm-up runs."""
    return IntermediateTensors({k: torch.zeros(s, dtype=dtype, device=device)
                                for k, s in hidden_shapes(num_tokens, hidden_size).items()})
