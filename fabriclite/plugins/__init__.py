"""Plugins a ``Fabric`` accepts in ``plugins=[...]``, at Lightning Fabric's import path: a precision, a
``CheckpointIO`` for checkpoint files, and a ``ClusterEnvironment`` (``fabriclite.plugins.environments``) saying who
started the processes and where this one sits in the job.

Usage: ``Fabric(plugins=[MixedPrecision("bf16-mixed", torch.device("cpu"))])``.
"""

from __future__ import annotations

from typing import Any

import torch

from fabriclite.checkpoint import CheckpointIO, TorchCheckpointIO
from fabriclite.plugins.environments import ClusterEnvironment
from fabriclite.plugins.precision import (
    DoublePrecision,
    FSDPPrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
    TruePrecision,
)
from fabriclite.plugins.precision import select_precision as _select_builtin_precision
from fabriclite.plugins.precision.bitsandbytes import BitsandbytesPrecision
from fabriclite.plugins.precision.fp8 import Float8Precision
from fabriclite.plugins.precision.transformer_engine import TransformerEnginePrecision
from fabriclite.rank_zero import rank_zero_warn

__all__ = [
    "BitsandbytesPrecision",
    "CheckpointIO",
    "ClusterEnvironment",
    "DoublePrecision",
    "FSDPPrecision",
    "Float8Precision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
    "TransformerEnginePrecision",
    "TruePrecision",
    "split_plugins",
]


def select_precision(name: str, device: torch.device) -> Precision:
    """Build the precision object for a canonical precision name (``choices.parse_precision``) on ``device``: the
    fp8 ones here, beside their optional packages (torchao, Transformer Engine), the rest in
    ``fabriclite.plugins.precision``.

    Usage: ``select_precision("fp8-mixed", torch.device("cpu"))``.
    """
    if name == "fp8-mixed":
        if device.type == "cpu":
            rank_zero_warn(
                "precision='fp8-mixed' on a CPU runs torchao's float8 emulation: fp8's rounding with the products in "
                "high precision, slower than 'bf16-mixed'. For tests: fp8 pays on a GPU of compute capability >= "
                "8.9. Pass plugins=[Float8Precision(emulate=True)] to silence this.",
                stacklevel=5,  # the Fabric(...) line
            )
        return Float8Precision(device=device)
    if name in ("transformer-engine", "transformer-engine-float16"):
        dtype = torch.float16 if name.endswith("float16") else torch.bfloat16
        return TransformerEnginePrecision(weights_dtype=dtype)  # as Lightning: refused without Transformer Engine
    return _select_builtin_precision(name, device)


def split_plugins(plugins: list[Any]) -> tuple[Precision | None, CheckpointIO | None, ClusterEnvironment | None]:
    """The precision, the CheckpointIO and the ClusterEnvironment among ``Fabric(plugins=...)``; at most one of
    each, nothing else.

    Usage: ``precision, checkpoint_io, environment = split_plugins([TorchCheckpointIO()])``.
    """
    found: dict[type, Any] = {Precision: None, CheckpointIO: None, ClusterEnvironment: None}
    for plugin in plugins:
        kind = next((k for k in found if isinstance(plugin, k)), None)
        if kind is None:
            raise ValueError(
                f"plugins={plugin!r} is not supported: fabriclite accepts a Precision, a CheckpointIO and a "
                "ClusterEnvironment as plugins."
            )
        if found[kind] is not None:
            raise ValueError(f"plugins has two {kind.__name__} plugins, {found[kind]!r} and {plugin!r}; pass one.")
        found[kind] = plugin
    return found[Precision], found[CheckpointIO], found[ClusterEnvironment]
