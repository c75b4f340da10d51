"""Hand-written Triton kernels: cross-entropy, layer norm and RMS norm (each with a fused residual add), bias +
GELU, rotary position embedding (RoPE) and SwiGLU; and linear cross-entropy, a language model's output layer and
loss computed in chunks of tokens so the (tokens, vocabulary) logits never exist at once.

Each op lives in its own file (``fused_cross_entropy.py``, ``fused_bias_gelu.py``, ``fused_rope.py``,
``fused_swiglu.py``, ``fused_linear_cross_entropy.py``; named apart from the functions so ``kernels.layer_norm`` is
always the function) with its forward and backward ``@triton.jit`` kernels, the host functions that launch them, a
``torch.autograd.Function`` that eager calls go through (no dispatcher between the call and the launch), its
``torch.library`` custom op (what ``torch.compile`` traces, without a graph break) and its public function or
module. Layer norm and RMS norm share one implementation, ``_norm.py``; ``fused_layer_norm.py`` and
``fused_rms_norm.py`` hold their public functions and modules. ``swap.py`` replaces a model's ``nn.LayerNorm`` /
``nn.RMSNorm`` with the fused modules, and says which of them ``Fabric(kernels=True)`` swaps in where: none under
``torch.compile``, on CUDA only those measured faster (``swap.MEASURED_WINS``), all on the CPU's interpreter.

Importing this package is cheap: triton is imported (and the ops registered with ``torch.library``) on first use of
a name below. The kernels run on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` is set before triton is
imported (Triton's interpreter: slow, for tests).

Usage: ``from fabriclite.kernels import cross_entropy, swap_modules``.
"""

from __future__ import annotations

import importlib
import os
import warnings
from importlib.util import find_spec
from typing import Any

import torch

# Public name -> the module (in this package) that defines it; imported on first access.
_LAZY = {
    "cross_entropy": "fused_cross_entropy",
    "CrossEntropyLoss": "fused_cross_entropy",
    "linear_cross_entropy": "fused_linear_cross_entropy",
    "LinearCrossEntropyLoss": "fused_linear_cross_entropy",
    "layer_norm": "fused_layer_norm",
    "add_layer_norm": "fused_layer_norm",
    "LayerNorm": "fused_layer_norm",
    "rms_norm": "fused_rms_norm",
    "RMSNorm": "fused_rms_norm",
    "add_rms_norm": "fused_rms_norm",
    "bias_gelu": "fused_bias_gelu",
    "rope": "fused_rope",
    "swiglu": "fused_swiglu",
    "swap_modules": "swap",
}

__all__ = [*_LAZY, "kernels_available", "kernels_usable"]


def kernels_available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA (compute capability 7.0 or newer) with triton
    installed, or the CPU when ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests).

    Usage: ``if kernels_available(fabric.device): swap_modules(model)``.
    """
    device = torch.device(device)
    if find_spec("triton") is None:
        return False
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index) >= (7, 0)
    if device.type == "cpu":
        return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
    return False


def kernels_usable(device: torch.device | str) -> bool:
    """``kernels_available(device)``, saying once in a warning why not when they are not (``Fabric(kernels=True)``
    leaves the model's layers as they are then).

    Usage: ``if kernels_usable(fabric.device): swap_modules(model)``.
    """
    if kernels_available(device):
        return True
    warnings.warn(
        f"Fabric(kernels=True): fabriclite's Triton kernels need a CUDA device and triton; on {device} the "
        "models keep torch's LayerNorm/RMSNorm. The script runs unchanged.",
        UserWarning,
        stacklevel=3,  # the line that built the Fabric
    )
    return False


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
