"""DataParallel ("dp"): one process drives several CUDA devices; each forward splits the batch over them, and
the gradients land on the first device's parameters. PyTorch recommends DDP instead (one process per device); this
is here so Lightning Fabric scripts written with ``strategy="dp"`` run unchanged.
"""

from __future__ import annotations

import torch
from torch.nn import DataParallel

from fabriclite.strategies.strategy import Strategy


class DataParallelStrategy(Strategy):
    """``torch.nn.DataParallel`` over every device of the accelerator, in this one process; on a CPU,
    ``Fabric(strategy="dp")`` uses DDP instead.

    Usage: ``Fabric(accelerator="cuda", devices=2, strategy="dp")``.
    """

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        assert self.accelerator is not None, "Strategy.configure comes first"
        return DataParallel(module, device_ids=self.accelerator.device_indices)
