"""Run or log on rank 0 only, at Lightning Fabric's import path ``lightning.fabric.utilities.rank_zero`` (the code is
``fabriclite.rank_zero``).

Usage: ``from fabriclite.utilities.rank_zero import rank_zero_only, rank_zero_info``.
"""

from fabriclite.rank_zero import (
    rank_zero_debug,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
)

__all__ = ["rank_zero_debug", "rank_zero_deprecation", "rank_zero_info", "rank_zero_only", "rank_zero_warn"]
