"""CUDA, at Lightning Fabric's import path ``lightning.fabric.accelerators.cuda`` (the code is
``fabriclite.accelerators``).

Usage: ``from fabriclite.accelerators.cuda import find_usable_cuda_devices; Fabric(devices=find_usable_cuda_devices(2))``.
"""

from fabriclite.accelerators import CUDAAccelerator, find_usable_cuda_devices

__all__ = ["CUDAAccelerator", "find_usable_cuda_devices"]
