"""Replace a model's ``nn.LayerNorm`` and ``nn.RMSNorm`` submodules with the fused ones, in place, and the rule for
which of them ``Fabric(kernels=True)`` replaces.

The fused modules subclass the torch ones and take over the very same Parameter objects, so state_dict keys and
values, optimizer param groups and ``isinstance(m, nn.LayerNorm)`` all stay as they were; only ``forward`` changes.

The rule (``ops_to_swap``): a kernel replaces torch's op only where it makes training faster.
- Under ``torch.compile`` never: inductor fuses torch's norms with the ops around them, and a custom op is opaque to
  that fusion (on one H100, ViT-B/16 bf16-mixed with compile: 3017 img/s, with compile and the kernels 2391).
- On CUDA only for the (op, GPU) pairs in ``MEASURED_WINS``, each backed by a measurement of a training step on
  that GPU with the kernel faster than without. The table is empty: on one H100 the kernels made ViT-B/16 slower
  (2546 img/s eager without them, 2316 with), and the cheaper host path since then is not yet measured on a GPU.
- On the CPU always: the kernels run there only under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
"""

from __future__ import annotations

import torch
from torch import nn

# Ops ``swap_modules`` can replace: the name of the kernel -> the torch module it stands in for.
SWAPPABLE = {"layer_norm": nn.LayerNorm, "rms_norm": nn.RMSNorm}

# (op, torch.cuda.get_device_name()) pairs where a training step with the kernel was measured faster than without,
# e.g. ("layer_norm", "NVIDIA H100 80GB HBM3"). Add a pair only with the measurement (BENCHMARKS.md) behind it.
MEASURED_WINS: frozenset[tuple[str, str]] = frozenset()


def ops_to_swap(device: torch.device | str, compiled: bool) -> tuple[str, ...]:
    """The ops ``Fabric(kernels=True)`` swaps in on ``device``: none under ``torch.compile``, on CUDA those with a
    measured win on this GPU (``MEASURED_WINS``), on the CPU (Triton's interpreter, for tests) all of them.

    Usage: ``swap_modules(model, ops_to_swap(fabric.device, compiled=False))``.
    """
    device = torch.device(device)
    if compiled:
        return ()
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return tuple(op for op in SWAPPABLE if (op, name) in MEASURED_WINS)
    return tuple(SWAPPABLE)


def _fused(module: nn.Module, ops: tuple[str, ...]) -> nn.Module | None:
    """The fused twin of a plain ``nn.LayerNorm`` / ``nn.RMSNorm`` sharing its parameters, else None."""
    from fabriclite.kernels.fused_layer_norm import LayerNorm
    from fabriclite.kernels.fused_rms_norm import RMSNorm

    # Exact types only: a subclass may have changed forward. A module with hooks is left alone, since moving the
    # hooks over would reach into torch's private dicts and dropping them would be silent.
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    if type(module) is nn.LayerNorm and "layer_norm" in ops:
        fused: nn.Module = LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
        fused.bias = module.bias
    elif type(module) is nn.RMSNorm and "rms_norm" in ops:
        fused = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
    else:
        return None
    fused.elementwise_affine = module.elementwise_affine
    fused.weight = module.weight
    fused.train(module.training)
    return fused


def swap_modules(model: nn.Module, ops: tuple[str, ...] | list[str] = tuple(SWAPPABLE)) -> int:
    """Replace every ``nn.LayerNorm`` / ``nn.RMSNorm`` submodule of ``model`` (those of the kinds named in ``ops``:
    ``"layer_norm"``, ``"rms_norm"``) by the Triton-backed ``LayerNorm`` / ``RMSNorm`` holding the identical
    Parameters; returns how many modules were replaced. A norm used in several places is replaced by one fused
    module used in the same places. ``model`` itself is never replaced (there is no parent to hold the new one),
    nor subclasses of the norms or norms with hooks.

    Usage: ``swap_modules(model)`` before ``fabric.setup(model, optimizer)`` or ``torch.compile(model)``.
    """
    unknown = [op for op in ops if op not in SWAPPABLE]
    if unknown:
        raise ValueError(f"swap_modules(ops=...) got {unknown}; the ops it can swap in are {list(SWAPPABLE)}.")
    ops = tuple(ops)
    replaced: dict[nn.Module, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            fused = replaced[child] if child in replaced else _fused(child, ops)
            if fused is not None:
                replaced[child] = fused
                setattr(parent, name, fused)
    return len(replaced)
