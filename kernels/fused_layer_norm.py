"""Layer norm, alone or fused with the residual add in front of it (``add_layer_norm``): ``F.layer_norm`` with fp32
statistics and the output in the input's dtype. The kernels and their backward live in ``_norm.py``, shared with
RMS norm.
"""

import math
from typing import Optional, Union

import torch

from fabriclite.kernels._common import check_dtypes
from fabriclite.kernels._norm import norm


def layer_norm(
    x: torch.Tensor,
    normalized_shape: Union[int, list[int], tuple[int, ...], torch.Size],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` on the Triton kernels (fp32 statistics, output in x's dtype).

    Usage: ``y = layer_norm(x, (768,), weight, bias, eps=1e-5)``.
    """
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if tuple(x.shape[x.dim() - len(normalized_shape) :]) != tuple(normalized_shape):
        raise ValueError(
            f"layer_norm over {list(normalized_shape)} needs an input ending in those sizes; got {tuple(x.shape)}."
        )
    check_dtypes("layer_norm", "torch.nn.functional.layer_norm", x, weight, bias)
    return norm(x, None, weight, bias, math.prod(normalized_shape), float(eps), False)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` over the last dimension, in one kernel.

    Usage: ``normed, hidden = add_layer_norm(attn_out, hidden, ln.weight, ln.bias, ln.eps)``.
    """
    if x.shape != residual.shape:
        raise ValueError(
            f"add_layer_norm needs x and residual of one shape (no broadcasting); got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}."
        )
    check_dtypes("add_layer_norm", "torch.nn.functional.layer_norm(x + residual, ...)", x, residual, weight, bias)
    return norm(x, residual, weight, bias, x.shape[-1], float(eps), False)


class LayerNorm(torch.nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, state_dict keys and arguments) whose forward runs the Triton kernels.

    Usage: ``norm = LayerNorm(768)``, or ``swap_modules(model)`` to replace a model's ``nn.LayerNorm`` in place.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


__all__ = ["LayerNorm", "add_layer_norm", "layer_norm"]
