"""Replace a model's ``nn.LayerNorm`` and ``nn.RMSNorm`` submodules with the fused ones, in place, and the rule for
which of them ``Fabric(kernels=True)`` replaces.

The fused modules subclass the torch ones and take over the very same Parameter objects, so state_dict keys and
values, optimizer param groups and ``isinstance(m, nn.LayerNorm)`` all stay as they were; only ``forward`` changes.

The rule (``ops_to_swap``): a kernel replaces torch's op only where it makes training faster.
- Under ``torch.compile`` never: inductor fuses torch's norms with the ops around them, and a custom op is opaque to
  that fusion (on one H100, ViT-B/16 bf16-mixed with compile: 3017 img/s, with compile and the kernels 2391).
- On CUDA only for the (GPU class, op) pairs in ``MEASURED_WINS``, at the widths listed there, each backed by a
  training step measured at least 1% faster with the kernel than without on that class of GPU (gpu_suite.py's
  ``models`` section, benchmarks/in_model.py). A norm of another width stays torch's until a row shows it winning.
- On the CPU always: the kernels run there only under Triton's interpreter (``TRITON_INTERPRET=1``), for tests.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

# Ops ``swap_modules`` can replace: the name of the kernel -> the torch module it stands in for.
SWAPPABLE = {"layer_norm": nn.LayerNorm, "rms_norm": nn.RMSNorm}

# (GPU class, op) -> the widths (elements normalized per row) at which a training step with the kernel was measured
# at least 1% faster than without. Add an entry only with the models row (BENCHMARKS.md) behind it.
MEASURED_WINS: dict[tuple[str, str], frozenset[int]] = {
    # ViT-B/16 eager, bf16-mixed, batch 128, one H200, 2026-11-26: 0.968 of the step time (2886 against 2785 img/s).
    # Not a win yet: rms_norm at 1536 (Llama-style GPT, 0.996), and every norm under torch.compile (1.06).
    ("H100/H200", "layer_norm"): frozenset({768}),
}
# GPU classes: one measurement stands for the GPUs of one architecture and memory system.
DEVICE_CLASSES = {"H100": "H100/H200", "H200": "H100/H200"}
# The norm backward's two designs (kernels/_norm.py): tiles of rows with the next one loaded ahead, or the row loop
# before them. (GPU class, op) -> the widths at which the row loop's forward and backward took less GPU time than the
# tiles' (gpu_suite.py's kernels section); the tiles everywhere else. One H200, 2026-11-27: the tiles faster in 10 of
# 12 rows (op, shape, wall or GPU time; up to 1.43x), the row loop in RMS norm's GPU time at 16384x4096 (0.202 ms
# against 0.216) and in layer norm's wall time at 25216x768 (its GPU time 1.15x faster in tiles: host time).
ROW_LOOP_WINS: dict[tuple[str, str], frozenset[int]] = {("H100/H200", "rms_norm"): frozenset({4096})}

# What ``ops_to_swap`` returns: op -> the widths to swap at (None: every width).
Swaps = dict[str, "frozenset[int] | None"]


def device_class(name: str) -> str | None:
    """The class ``MEASURED_WINS`` knows a GPU by, from ``torch.cuda.get_device_name()``; None for a GPU of no class.

    Usage: ``device_class("NVIDIA H200") == "H100/H200"``.
    """
    return next((cls for key, cls in DEVICE_CLASSES.items() if key in name.split()), None)


def row_loop_measured_faster(device: torch.device, op: str, width: Any) -> bool:
    """Whether the norm backward ``op`` ("rms_norm", "layer_norm") at ``width`` takes the row loop on ``device``
    (``ROW_LOOP_WINS``). A symbolic width (``torch.SymInt``, under compile) is compared, never hashed: Dynamo keeps
    the comparison as a guard.

    Usage: ``row_loop_measured_faster(x.device, "rms_norm", 4096)``.
    """
    return any(width == measured for measured in _row_loop_widths(device, op))


@functools.lru_cache(maxsize=None)
def _row_loop_widths(device: torch.device, op: str) -> frozenset[int]:
    cls = device_class(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return ROW_LOOP_WINS.get((cls, op), frozenset())


def ops_to_swap(device: torch.device | str, compiled: bool) -> Swaps:
    """The ops ``Fabric(kernels=True)`` swaps in on ``device``, each with the widths it is swapped at: none under
    ``torch.compile``, on CUDA those with a measured win on this class of GPU at the widths measured
    (``MEASURED_WINS``), on the CPU (Triton's interpreter, for tests) all of them at every width.

    Usage: ``swap_modules(model, ops_to_swap(fabric.device, compiled=False))``.
    """
    device = torch.device(device)
    if compiled:
        return {}
    if device.type == "cuda":
        cls = device_class(torch.cuda.get_device_name(device))
        return {op: MEASURED_WINS[(cls, op)] for op in SWAPPABLE if (cls, op) in MEASURED_WINS}
    return dict.fromkeys(SWAPPABLE)


def _fused(module: nn.Module, ops: Swaps) -> nn.Module | None:
    """The fused twin of a plain ``nn.LayerNorm`` / ``nn.RMSNorm`` sharing its parameters, else None."""
    from fabriclite.kernels.fused_layer_norm import LayerNorm
    from fabriclite.kernels.fused_rms_norm import RMSNorm

    # Exact types only: a subclass may have changed forward. A module with hooks is left alone, since moving the
    # hooks over would reach into torch's private dicts and dropping them would be silent.
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
        return None
    op = next((op for op, kind in SWAPPABLE.items() if type(module) is kind), None)
    if op not in ops:
        return None
    widths = ops[op]
    if widths is not None and math.prod(module.normalized_shape) not in widths:
        return None
    if op == "layer_norm":
        fused: nn.Module = LayerNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
        fused.bias = module.bias
    else:
        fused = RMSNorm(module.normalized_shape, eps=module.eps, elementwise_affine=False)
    fused.elementwise_affine = module.elementwise_affine
    fused.weight = module.weight
    fused.train(module.training)
    return fused


def swap_modules(model: nn.Module, ops: tuple[str, ...] | list[str] | Swaps = tuple(SWAPPABLE)) -> int:
    """Replace every ``nn.LayerNorm`` / ``nn.RMSNorm`` submodule of ``model`` (those of the kinds named in ``ops``:
    ``"layer_norm"``, ``"rms_norm"``; or, as ``ops_to_swap`` gives it, a dict of those kinds to the widths to swap
    them at, None for every width) by the Triton-backed ``LayerNorm`` / ``RMSNorm`` holding the identical
    Parameters; returns how many modules were replaced. A norm used in several places is replaced by one fused
    module used in the same places. ``model`` itself is never replaced (there is no parent to hold the new one),
    nor subclasses of the norms or norms with hooks.

    Usage: ``swap_modules(model)`` before ``fabric.setup(model, optimizer)`` or ``torch.compile(model)``.
    """
    unknown = [op for op in ops if op not in SWAPPABLE]
    if unknown:
        raise ValueError(f"swap_modules(ops=...) got {unknown}; the ops it can swap in are {list(SWAPPABLE)}.")
    ops = dict(ops) if isinstance(ops, dict) else dict.fromkeys(ops)
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
