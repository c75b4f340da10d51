"""Walking batches, at Lightning Fabric's import path ``lightning.fabric.utilities.apply_func`` (the code is
``fabriclite._collections``).

Usage: ``from fabriclite.utilities.apply_func import move_data_to_device; batch = move_data_to_device(batch, "cuda")``.
"""

from fabriclite._collections import (
    apply_to_collection,
    convert_tensors_to_scalars,
    convert_to_tensors,
    move_data_to_device,
)

__all__ = ["apply_to_collection", "convert_tensors_to_scalars", "convert_to_tensors", "move_data_to_device"]
