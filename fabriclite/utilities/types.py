"""Lightning Fabric's structural types, at its import path ``lightning.fabric.utilities.types`` (the code is
``fabriclite._types``).

Usage: ``from fabriclite.utilities.types import Optimizable, _Stateful, ReduceOp``.
"""

from fabriclite._types import (
    _DEVICE,
    _MAP_LOCATION_TYPE,
    _PARAMETERS,
    _PATH,
    CollectibleGroup,
    Optimizable,
    ProcessGroup,
    RedOpType,
    ReduceOp,
    Steppable,
    UntypedStorage,
    _Stateful,
)

__all__ = [
    "CollectibleGroup",
    "Optimizable",
    "ProcessGroup",
    "RedOpType",
    "ReduceOp",
    "Steppable",
    "UntypedStorage",
    "_DEVICE",
    "_MAP_LOCATION_TYPE",
    "_PARAMETERS",
    "_PATH",
    "_Stateful",
]
