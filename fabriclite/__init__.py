"""fabriclite: a lightweight, Lightning-Fabric-compatible training wrapper for PyTorch.

Usage: ``from fabriclite import Fabric, seed_everything``.
"""

# First: with a torch older than fabriclite supports, this raises an ImportError saying which torch is needed.
import fabriclite._versions  # noqa: F401
from fabriclite.fabric import Fabric
from fabriclite.seed import seed_everything
from fabriclite.wrappers import is_wrapped

__version__ = "0.1.0.dev0"
__all__ = ["Fabric", "__version__", "is_wrapped", "seed_everything"]
