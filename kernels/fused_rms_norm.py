"""RMS norm: ``x * rsqrt(mean(x ** 2) + eps) * weight`` over the trailing dimensions, as ``F.rms_norm``, alone or
fused with the residual add in front of it (``add_rms_norm``). The kernels and their backward live in ``_norm.py``,
shared with layer norm.

``eps=None`` means fp32's eps, as in torch, which computes fp32, bf16 and fp16 RMS norm in fp32 and takes the eps of
that dtype (bf16's own, 0.0078, would swamp ``mean(x ** 2)`` of small activations).
"""

import math
from typing import Optional, Union

import torch

from fabriclite.kernels._common import check_dtypes
from fabriclite.kernels._norm import norm

_FP32_EPS = torch.finfo(torch.float32).eps  # the dtype the kernel computes in, whatever x's dtype


def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    normalized_shape: Union[int, list[int], tuple[int, ...], torch.Size, None] = None,
) -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2) + eps) * weight`` over ``normalized_shape`` (default: weight's shape, else the
    last dimension), as ``F.rms_norm(x, normalized_shape, weight, eps)``; ``eps=None`` is fp32's eps, as in torch.

    Usage: ``y = rms_norm(x, weight, eps=1e-6)``.
    """
    if normalized_shape is None:
        shape = tuple(weight.shape) if weight is not None else (x.shape[-1],)
    else:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"rms_norm over {list(shape)} needs an input ending in those sizes; got {tuple(x.shape)}.")
    check_dtypes("rms_norm", "torch.nn.functional.rms_norm", x, weight)
    return norm(x, None, weight, None, math.prod(shape), _FP32_EPS if eps is None else float(eps), True)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` over the last dimension, in one kernel; ``eps=None``
    is fp32's eps, as in ``rms_norm``.

    Usage: ``normed, hidden = add_rms_norm(attn_out, hidden, norm.weight, norm.eps)``.
    """
    if x.shape != residual.shape:
        raise ValueError(
            f"add_rms_norm needs x and residual of one shape (no broadcasting); got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}."
        )
    if x.dim() == 0 or (weight is not None and tuple(weight.shape) != (x.shape[-1],)):
        weight_shape = None if weight is None else tuple(weight.shape)
        raise ValueError(
            f"add_rms_norm normalizes over the last dimension and needs a 1-D weight as long as it; got x "
            f"{tuple(x.shape)} and weight {weight_shape}. For several trailing dimensions use rms_norm(x + residual)."
        )
    check_dtypes("add_rms_norm", "torch.nn.functional.rms_norm(x + residual, ...)", x, residual, weight)
    return norm(x, residual, weight, None, x.shape[-1], _FP32_EPS if eps is None else float(eps), True)


class RMSNorm(torch.nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, state_dict keys and arguments) whose forward runs the Triton kernels.

    Usage: ``norm = RMSNorm(4096, eps=1e-6)``, or ``swap_modules(model)`` to replace a model's ``nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.normalized_shape)


__all__ = ["RMSNorm", "add_rms_norm", "rms_norm"]
