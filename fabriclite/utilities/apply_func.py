"""Walking batches, at Lightning Fabric's import path ``lightning.fabric.utilities.apply_func``.

Usage: ``from fabriclite.utilities.apply_func import move_data_to_device; batch = move_data_to_device(batch, "cuda")``.
"""

from __future__ import annotations

from typing import Any

import torch

from fabriclite._collections import apply_to_collection, convert_to_tensors, move_to_device

__all__ = ["apply_to_collection", "convert_to_tensors", "move_data_to_device"]


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Move every tensor (and module) in ``batch`` to ``device``, keeping the containers.

    Usage: ``move_data_to_device({"x": x, "y": [y]}, torch.device("cuda", 0))``.
    """
    return move_to_device(batch, torch.device(device))
