"""Replace a model's ``nn.LayerNorm`` and ``nn.RMSNorm`` submodules with the fused ones, in place.

The fused modules subclass the torch ones and take over the very same Parameter objects, so state_dict keys and
values, optimizer param groups and ``isinstance(m, nn.LayerNorm)`` all stay as they were; only ``forward`` changes.
"""

from __future__ import annotations

from torch import nn

from fabriclite.kernels.fused_layer_norm import LayerNorm
from fabriclite.kernels.fused_rms_norm import RMSNorm


def _fused(module: nn.Module) -> nn.Module | None:
    """The fused twin of a plain ``nn.LayerNorm`` / ``nn.RMSNorm`` sharing its parameters, else None."""
    # Exact types only: a subclass may have changed forward. A module with hooks is left alone, since moving the
    # hooks over would reach into torch's private dicts and dropping them would be silent.
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    if type(module) is nn.LayerNorm:
        fused: nn.Module = LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
        fused.bias = module.bias
    elif type(module) is nn.RMSNorm:
        fused = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
    else:
        return None
    fused.elementwise_affine = module.elementwise_affine
    fused.weight = module.weight
    fused.train(module.training)
    return fused


def swap_modules(model: nn.Module) -> int:
    """Replace every ``nn.LayerNorm`` / ``nn.RMSNorm`` submodule of ``model`` by the Triton-backed ``LayerNorm`` /
    ``RMSNorm`` holding the identical Parameters; returns how many modules were replaced. A norm used in several
    places is replaced by one fused module used in the same places. ``model`` itself is never replaced (there is no
    parent to hold the new one), nor subclasses of the norms or norms with hooks.

    Usage: ``swap_modules(model)`` before ``fabric.setup(model, optimizer)`` or ``torch.compile(model)``.
    """
    replaced: dict[nn.Module, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            fused = replaced[child] if child in replaced else _fused(child)
            if fused is not None:
                replaced[child] = fused
                setattr(parent, name, fused)
    return len(replaced)
