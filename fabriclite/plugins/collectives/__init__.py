"""Collectives that each own a process group, at Lightning Fabric's import path
``lightning.fabric.plugins.collectives``: ``TorchCollective`` (torch.distributed) and ``SingleDeviceCollective``
(a world of one), both filling in ``Collective``.

Usage: ``from fabriclite.plugins.collectives import TorchCollective``.
"""

from fabriclite.plugins.collectives.collective import Collective
from fabriclite.plugins.collectives.single_device import SingleDeviceCollective
from fabriclite.plugins.collectives.torch_collective import TorchCollective

__all__ = ["Collective", "SingleDeviceCollective", "TorchCollective"]
