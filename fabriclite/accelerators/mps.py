"""Apple's MPS, at Lightning Fabric's import path ``lightning.fabric.accelerators.mps`` (the code is
``fabriclite.accelerators``).

Usage: ``from fabriclite.accelerators.mps import MPSAccelerator; MPSAccelerator.is_available()``.
"""

from fabriclite.accelerators import MPSAccelerator

__all__ = ["MPSAccelerator"]
