"""Seeding, at Lightning Fabric's import path ``lightning.fabric.utilities.seed`` (the code is ``fabriclite.seed``).

Usage: ``from fabriclite.utilities.seed import seed_everything; seed_everything(42, workers=True)``.
"""

from fabriclite.seed import pl_worker_init_function, reset_seed, seed_everything

__all__ = ["pl_worker_init_function", "reset_seed", "seed_everything"]
