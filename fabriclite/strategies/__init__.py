"""How the work is spread over processes and devices, at Lightning Fabric's import path.

``Strategy`` and ``SingleDeviceStrategy`` load with ``import fabriclite``; the distributed strategies load
``torch.distributed``'s heavier parts (DDP, FSDP2), so they are imported on first use: ``from fabriclite.strategies
import FSDPStrategy`` works as usual. Every strategy name ``Fabric(strategy=...)`` takes is in ``STRATEGY_NAMES``,
with the class it builds and the arguments it stands for; ``select_strategy`` turns a name into its object.
"""

from __future__ import annotations

import warnings
from typing import Any

from fabriclite.accelerators import Accelerator
from fabriclite.choices import apply_cli_state_dict_type, invalid_choice
from fabriclite.strategies.strategy import SingleDeviceStrategy, Strategy

__all__ = [
    "DDPStrategy",
    "DataParallelStrategy",
    "FSDPStrategy",
    "ModelParallelStrategy",
    "ParallelStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "parse_strategy",
    "select_strategy",
]

# Lightning's DDP names: how the processes start, and optionally DDP's find_unused_parameters as a suffix.
_DDP_START_METHODS = {"ddp": "subprocess", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}
_FIND_UNUSED: dict[str, dict[str, Any]] = {
    "": {},
    "_find_unused_parameters_true": {"find_unused_parameters": True},
    "_find_unused_parameters_false": {"find_unused_parameters": False},
}

# Every strategy name: the class it builds and the keyword arguments it stands for. On one process "auto" and
# "single_device" are SingleDeviceStrategy; off CUDA "dp" is DDP (see select_strategy).
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "auto": ("DDPStrategy", {}),
    "single_device": ("SingleDeviceStrategy", {}),
    "dp": ("DataParallelStrategy", {}),
    **{
        f"{name}{suffix}": ("DDPStrategy", {"start_method": start, **unused})
        for name, start in _DDP_START_METHODS.items()
        for suffix, unused in _FIND_UNUSED.items()
    },
    # also on one process: a group of one, so checkpoints and DTensors look the same
    "fsdp": ("FSDPStrategy", {}),
    "fsdp_cpu_offload": ("FSDPStrategy", {"cpu_offload": True}),
}


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
        from fabriclite.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if name == "ModelParallelStrategy":
        from fabriclite.strategies.model_parallel import ModelParallelStrategy

        return ModelParallelStrategy
    raise AttributeError(f"module 'fabriclite.strategies' has no attribute {name!r}")


def parse_strategy(strategy: Any) -> Any:
    """Return the lower-case strategy name, or any other object unchanged (``select_strategy`` checks that it is a
    ``Strategy``).

    Usage: ``parse_strategy("FSDP") == "fsdp"``.
    """
    if not isinstance(strategy, str):
        return strategy
    if strategy.lower() in STRATEGY_NAMES:
        return strategy.lower()
    raise invalid_choice("strategy", strategy, list(STRATEGY_NAMES))


def select_strategy(strategy: Any, accelerator: Accelerator, num_nodes: int) -> Strategy:
    """Build the strategy object for a parsed strategy name (or take the user's object).

    Usage: ``select_strategy("auto", CPUAccelerator([0]), num_nodes=1)``.
    """
    built = _select_strategy(strategy, accelerator, num_nodes)
    apply_cli_state_dict_type(built)  # `fabriclite run --state-dict-type full`
    return built


def _select_strategy(strategy: Any, accelerator: Accelerator, num_nodes: int) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str) or strategy not in STRATEGY_NAMES:
        raise invalid_choice("strategy", strategy, list(STRATEGY_NAMES))
    processes = len(accelerator.device_indices) * num_nodes
    if strategy in ("auto", "single_device") and processes == 1:
        return SingleDeviceStrategy()
    if strategy == "single_device":
        raise ValueError(
            f"strategy='single_device' runs one process, but devices * num_nodes = {processes}. "
            "Use devices=1, or a distributed strategy."
        )
    if strategy == "dp" and accelerator.type != "cuda":
        warnings.warn(
            f"strategy='dp' (torch.nn.DataParallel) runs on several CUDA devices only; on {accelerator.type} "
            "fabriclite uses strategy='ddp' instead, as Lightning Fabric does.",
            UserWarning,
            stacklevel=3,
        )
        strategy = "ddp"
    class_name, settings = STRATEGY_NAMES[strategy]
    return __getattr__(class_name)(**settings)
