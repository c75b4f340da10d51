"""Lightning Fabric's path for the torch version flags (``lightning.fabric.utilities.imports``): the same module as
``fabriclite._versions``, the version module at the bottom of the package, whichever path imported it.

Usage: ``from fabriclite.utilities.imports import _TORCH_GREATER_EQUAL_2_3``.
"""

import sys

from fabriclite import _versions

sys.modules[__name__] = _versions
