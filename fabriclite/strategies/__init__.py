"""How the work is spread over processes and devices, at Lightning Fabric's import path.

``Strategy`` and ``SingleDeviceStrategy`` load with ``import fabriclite``; the distributed strategies load
``torch.distributed``'s heavier parts (DDP, FSDP2), so they are imported on first use: ``from fabriclite.strategies
import FSDPStrategy`` works as usual. ``select_strategy`` turns a strategy name into its object.
"""

from __future__ import annotations

import warnings
from typing import Any

from fabriclite.accelerators import Accelerator
from fabriclite.choices import STRATEGIES, invalid_choice, strategy_settings
from fabriclite.strategies.strategy import SingleDeviceStrategy, Strategy

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "select_strategy",
]


def __getattr__(name: str) -> Any:
    if name == "ParallelStrategy":
        from fabriclite.strategies.parallel import ParallelStrategy

        return ParallelStrategy
    if name == "DDPStrategy":
        from fabriclite.strategies.ddp import DDPStrategy

        return DDPStrategy
    if name == "DataParallelStrategy":
        from fabriclite.strategies.dp import DataParallelStrategy

        return DataParallelStrategy
    if name == "FSDPStrategy":
        return _fsdp_strategy_class()
    if name == "ModelParallelStrategy":
        _fsdp_strategy_class()  # the same torch requirement, with its clear error
        from fabriclite.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module 'fabriclite.strategies' has no attribute {name!r}")


def _fsdp_strategy_class() -> type:
    try:
        from fabriclite.strategies.fsdp import FSDPStrategy
    except ImportError as err:  # FSDP2's public fully_shard arrived in torch 2.6
        import torch

        raise RuntimeError(
            f"strategy='fsdp' uses FSDP2 (torch.distributed.fsdp.fully_shard), which needs torch >= 2.6; this is "
            f"torch {torch.__version__} ({err}). Upgrade torch, or use strategy='ddp'."
        ) from err
    return FSDPStrategy


def select_strategy(strategy: Any, accelerator: Accelerator, num_nodes: int) -> Strategy:
    """Build the strategy object for a parsed strategy name (or take the user's object).

    Usage: ``select_strategy("auto", CPUAccelerator([0]), num_nodes=1)``.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise invalid_choice("strategy", strategy, STRATEGIES)
    processes = len(accelerator.device_indices) * num_nodes
    if strategy in ("auto", "single_device") and processes == 1:
        return SingleDeviceStrategy()
    if strategy == "single_device":
        raise ValueError(
            f"strategy='single_device' runs one process, but devices * num_nodes = {processes}. "
            "Use devices=1, or a distributed strategy."
        )
    if strategy == "dp" and accelerator.type == "cuda":
        from fabriclite.strategies.dp import DataParallelStrategy

        return DataParallelStrategy()
    if strategy == "dp":
        warnings.warn(
            f"strategy='dp' (torch.nn.DataParallel) runs on several CUDA devices only; on {accelerator.type} "
            "fabriclite uses strategy='ddp' instead, as Lightning Fabric does.",
            UserWarning,
            stacklevel=3,
        )
    if strategy in ("auto", "dp") or strategy.startswith("ddp"):
        from fabriclite.strategies.ddp import DDPStrategy

        return DDPStrategy(**strategy_settings(strategy))
    if strategy.startswith("fsdp"):  # also on one process: a group of one, so checkpoints and DTensors look the same
        return _fsdp_strategy_class()(**strategy_settings(strategy))
    raise invalid_choice("strategy", strategy, STRATEGIES)
