"""Giving a model built on the meta device its memory, at Lightning Fabric's import path
``lightning.fabric.utilities.init`` (the code is ``fabriclite.strategies.sharding``).

Usage: ``_materialize_meta_tensors(model, torch.device("cuda"))``.
"""

from fabriclite.strategies.sharding import materialize_meta_tensors as _materialize_meta_tensors

__all__ = ["_materialize_meta_tensors"]
