"""Plugins a ``Fabric`` accepts in ``plugins=[...]``, at Lightning Fabric's import path: a precision, a
``CheckpointIO`` for checkpoint files, and a ``ClusterEnvironment`` (``fabriclite.plugins.environments``) saying who
started the processes and where this one sits in the job.

Usage: ``Fabric(plugins=[MixedPrecision("bf16-mixed", torch.device("cpu"))])``.
"""

from __future__ import annotations

from typing import Any

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
from fabriclite.plugins.precision.bitsandbytes import BitsandbytesPrecision

__all__ = [
    "BitsandbytesPrecision",
    "CheckpointIO",
    "ClusterEnvironment",
    "DoublePrecision",
    "FSDPPrecision",
    "HalfPrecision",
    "MixedPrecision",
    "Precision",
    "TorchCheckpointIO",
    "TruePrecision",
    "split_plugins",
]


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
