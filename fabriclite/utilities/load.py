"""Loading a checkpoint lazily, at Lightning Fabric's import path ``lightning.fabric.utilities.load`` (the code is
``fabriclite.checkpoint.files``): ``_lazy_load`` leaves the tensors in the file until they are touched.

Usage: ``state = _lazy_load("lit_model.pth"); model.load_state_dict(state)``.
"""

from fabriclite.checkpoint.files import NotYetLoadedTensor as _NotYetLoadedTensor
from fabriclite.checkpoint.files import lazy_load as _lazy_load

__all__ = ["_NotYetLoadedTensor", "_lazy_load"]
