import functools

import torch
from torch import nn

from pagoda.kernels import reference


@functools.cache
def _triton_ops():
    # Imported on first use, not with the layers: importing triton fixes, for the whole process,
    # whether its kernels run compiled or in the CPU interpreter (TRITON_INTERPRET).
    from pagoda.kernels import triton_ops
    return triton_ops


def kernels_for(x: torch.Tensor):
    """The module of elementwise kernels for ``x``'s device: the fused Triton kernels
    (``pagoda.kernels.triton_ops``) on CUDA, the torch versions (``pagoda.kernels.reference``,
    same functions and signatures) elsewhere. Shared by the norm and activation layers."""
    return _triton_ops() if x.is_cuda else reference


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With ``residual``: add it first (the fused residual-add + norm of every decoder layer)
        and return the sum as the next residual. Inputs are left unchanged."""
        if residual is None:
            return kernels_for(x).rms_norm(x, self.weight, self.eps)
        return kernels_for(x).fused_add_rms_norm(x, residual, self.weight, self.eps)
