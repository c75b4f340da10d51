"""Small data helpers, at Lightning Fabric's import path ``lightning.fabric.utilities.data`` (the code is
``fabriclite._collections`` and ``fabriclite.data``).

Usage: ``DataLoader(dataset, num_workers=suggested_max_num_workers(fabric.world_size))``.
"""

from fabriclite._collections import AttributeDict
from fabriclite.data import has_iterable_dataset, has_len, suggested_max_num_workers

__all__ = ["AttributeDict", "has_iterable_dataset", "has_len", "suggested_max_num_workers"]
