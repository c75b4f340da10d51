"""Skipping tests a machine cannot run, at Lightning Fabric's import path ``lightning.fabric.utilities.testing``
(the code is ``fabriclite._runif``).

Usage: ``reasons, marker_kwargs = _runif_reasons(min_cuda_gpus=1)``.
"""

from fabriclite._runif import _runif_reasons

__all__ = ["_runif_reasons"]
