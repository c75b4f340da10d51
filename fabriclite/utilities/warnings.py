"""Warning categories, at Lightning Fabric's import path ``lightning.fabric.utilities.warnings`` (the code is
``fabriclite.rank_zero``).

Usage: ``warnings.filterwarnings("ignore", category=PossibleUserWarning)``.
"""

from fabriclite.rank_zero import PossibleUserWarning

__all__ = ["PossibleUserWarning"]
