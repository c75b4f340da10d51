"""Helpers for training scripts, at Lightning Fabric's import path ``lightning.fabric.utilities`` and its submodules
(``.rank_zero``, ``.seed``, ``.apply_func``, ``.data``, ``.throughput``, ``.warnings``).

Usage: ``from fabriclite.utilities import seed_everything, move_data_to_device, ThroughputMonitor``.
"""

from fabriclite.utilities.apply_func import apply_to_collection, convert_to_tensors, move_data_to_device
from fabriclite.utilities.data import AttributeDict, suggested_max_num_workers
from fabriclite.utilities.rank_zero import (
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)
from fabriclite.utilities.seed import pl_worker_init_function, reset_seed, seed_everything
from fabriclite.throughput import Throughput, ThroughputMonitor, get_available_flops, measure_flops

__all__ = [
    "AttributeDict",
    "Throughput",
    "ThroughputMonitor",
    "apply_to_collection",
    "convert_to_tensors",
    "get_available_flops",
    "measure_flops",
    "move_data_to_device",
    "pl_worker_init_function",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
    "reset_seed",
    "seed_everything",
    "suggested_max_num_workers",
]
