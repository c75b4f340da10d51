"""Helpers for training scripts, at Lightning Fabric's import path ``lightning.fabric.utilities``.

Usage: ``from fabriclite.utilities import seed_everything, move_data_to_device``.
"""

from fabriclite._collections import apply_to_collection
from fabriclite._collections import move_to_device as move_data_to_device
from fabriclite.seed import pl_worker_init_function, reset_seed, seed_everything
from fabriclite.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = [
    "apply_to_collection",
    "move_data_to_device",
    "pl_worker_init_function",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "reset_seed",
    "seed_everything",
]
