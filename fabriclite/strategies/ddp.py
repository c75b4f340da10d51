"""DistributedDataParallel: every rank holds the whole model; gradients are averaged during backward."""

from __future__ import annotations

import inspect
import weakref
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
from torch.nn.parallel import DistributedDataParallel

from fabriclite.strategies.parallel import ParallelStrategy

# ParallelStrategy's arguments, written once there; DDPStrategy passes the rest to DistributedDataParallel.
_PARALLEL_ARGUMENTS = tuple(inspect.signature(ParallelStrategy.__init__).parameters)[1:]


class DDPStrategy(ParallelStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` on gloo (CPU) or nccl (CUDA).

    Takes ``ParallelStrategy``'s arguments (``process_group_backend``, ``timeout``, ``start_method``,
    ``checkpoint_io``, ``stall_timeout``, ``cluster_environment``, in that order or by name); every other keyword
    argument goes to ``DistributedDataParallel`` (e.g. ``find_unused_parameters=True``).
    Usage: ``Fabric(devices=2, strategy=DDPStrategy(timeout=timedelta(minutes=5)))``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        own = {name: kwargs.pop(name) for name in _PARALLEL_ARGUMENTS if name in kwargs}
        super().__init__(*args, **own)
        self.ddp_kwargs = kwargs

    def _process_state(self) -> dict[str, Any]:
        return {**super()._process_state(), "_wrapped": weakref.WeakSet()}  # every DDP module made here

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_kwargs)
        self._wrapped.add(wrapped)
        return wrapped

    def teardown(self) -> None:
        # A DDP module keeps the process group (and its gloo threads) alive after destroy_process_group; if those
        # threads are still running when the interpreter's C++ objects are destroyed, the process aborts. Drop the
        # references first, so the group really closes.
        for wrapped in list(self._wrapped):
            for name in ("logger", "reducer", "process_group"):
                if name in wrapped.__dict__:
                    wrapped.__dict__[name] = None
        self._wrapped.clear()
        super().teardown()

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise TypeError(
                f"no_backward_sync under DDP expects the model returned by fabric.setup, got {type(module).__name__}."
            )
        return module.no_sync()
