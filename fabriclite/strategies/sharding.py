"""What the sharding strategies (``FSDPStrategy`` and ``ModelParallelStrategy``) share: choosing the units (the
layer-class policies; the default units, ``repeated_blocks``, are in ``fabriclite._blocks``), building the model on
rank 0 alone (``rank_zero_init``), and skipping the gradient reduction of FSDP units (``no_gradient_sync``).

Usage: ``with rank_zero_init(strategy): model = build()``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

# A set of layer classes, or a function telling whether a module is one unit.
ModulePolicy = Union[set, frozenset, list, tuple, type, Callable[[nn.Module], bool], None]


# ---------------------------------------------------------------------- choosing the units
def module_policy(policy: ModulePolicy, what: str) -> Callable[[nn.Module], bool] | None:
    """``policy`` (layer classes or a ``module -> bool`` function; ``what`` names the argument) as a function."""
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"{what}={policy!r} must hold nn.Module subclasses, e.g. {{TransformerBlock}}.")
        return functools.partial(_instance_of, classes)  # picklable, for ddp_spawn's new processes
    if callable(policy):
        return policy
    raise TypeError(f"{what}={policy!r} must be a set of nn.Module classes or a function (module) -> bool.")


def _instance_of(classes: tuple[type, ...], module: nn.Module) -> bool:
    return isinstance(module, classes)


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``module`` by name."""
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def has_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (an empty init's, before sharding)."""
    return any(t.is_meta for t in named_tensors(module).values())


# ---------------------------------------------------------------------- empty init
class _ForceDevice(torch.overrides.TorchFunctionMode):
    """Creates every tensor on ``device``, overriding Fabric's ``torch.device`` context entered inside this one."""

    def __init__(self, device: str) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors

        self.device = torch.device(device)
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.constructors:
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextmanager
def rank_zero_init(strategy: Any) -> Iterator[None]:
    """``init_module(empty_init=True)`` under a sharding strategy: rank 0 builds the model on the CPU, the other ranks
    on the meta device; afterwards every rank's random stream is where an ordinary init on every rank leaves it."""
    if strategy.world_size > 1 and not dist.is_initialized():
        raise RuntimeError(
            "fabric.init_module(empty_init=True) under FSDP needs the processes running: call fabric.launch() first."
        )
    rng_before = torch.get_rng_state()
    with _ForceDevice("cpu" if strategy.is_global_zero else "meta"):
        yield
    if strategy.world_size > 1:
        # Only rank 0 drew its init from the random stream. Ranks that started from the same state continue from
        # where rank 0 ended, exactly as after an ordinary init on every rank.
        zero_before, zero_after = strategy.broadcast((rng_before, torch.get_rng_state()))
        if torch.equal(rng_before, zero_before):
            torch.set_rng_state(zero_after)


# ---------------------------------------------------------------------- the step: gradient sync
@contextmanager
def no_gradient_sync(module: FSDPModule) -> Iterator[None]:
    """Leave ``module``'s gradients unreduced inside the block (``fabric.no_backward_sync`` under FSDP)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
