"""What the sharding strategies (``FSDPStrategy`` and ``ModelParallelStrategy``) share: choosing the units (the
layer-class policies; the default units, ``repeated_blocks``, are in ``fabriclite._blocks``), building the model on
the meta device and giving each rank storage for its shard only (``meta_init``, ``materialize``), and skipping the
gradient reduction of FSDP units (``no_gradient_sync``).

Usage: ``with meta_init(): model = build()``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable, Union

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fabriclite.rank_zero import rank_zero_warn
from fabriclite.utilities.imports import device_constructors

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
        self.device = torch.device(device)
        self.constructors = device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.constructors:
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextmanager
def meta_init() -> Iterator[None]:
    """``init_module(empty_init=True)`` under a sharding strategy: every rank builds the model on the meta device,
    which takes no memory; ``setup_module`` then gives each rank storage for its shard only (``materialize``)."""
    with _ForceDevice("meta"):
        yield


def materialize(module: nn.Module, device: torch.device | str) -> list[str]:
    """Give the meta tensors of ``module`` and its submodules storage on ``device`` and fill them with each owning
    module's ``reset_parameters()`` (torch's own modules have one; ``_reset_parameters`` too, as in
    ``nn.MultiheadAttention``), in the order a constructor runs them: children first, in order, then the parent.

    A DTensor (already sharded by a ``parallelize_fn``) is initialised whole, the same on every rank, and each rank
    keeps its slice: DTensor's own random ops give every rank the same slice on a CPU. So one module at a time is
    whole. Returns the class names of the modules that hold meta tensors and have no reset method: their memory is
    uninitialised until a checkpoint is loaded into it. Usage: ``missing = materialize(block, "cpu")``.
    """
    missing: list[str] = []
    for sub in _children_first(module, set()):
        if not any(t.is_meta for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            continue
        sub.to_empty(device=device, recurse=False)
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if not callable(reset):
            missing.append(type(sub).__name__)
            continue
        with torch.no_grad(), _whole_tensors(sub):
            reset()
    return missing


def _children_first(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    if id(module) in seen:
        return
    seen.add(id(module))
    for child in module.children():
        yield from _children_first(child, seen)
    yield module


@contextmanager
def _whole_tensors(module: nn.Module) -> Iterator[None]:
    """Inside the block, ``module``'s own DTensors are plain full-size tensors; afterwards each DTensor takes its
    slice of what the block wrote (no communication: every rank computed the same full tensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    swapped = []
    for store in (module._parameters, module._buffers):
        for name, tensor in store.items():
            if isinstance(tensor, DTensor):
                whole = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.to_local().device)
                is_param = isinstance(tensor, nn.Parameter)
                store[name] = nn.Parameter(whole, requires_grad=tensor.requires_grad) if is_param else whole
                swapped.append((store, name, tensor))
    try:
        yield
    finally:
        for store, name, tensor in swapped:
            whole = store[name].detach()
            store[name] = tensor
            local = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
            tensor.to_local().copy_(local)


def warn_uninitialized(missing: list[str]) -> None:
    """Warn (rank 0) in Lightning Fabric's words which module classes kept uninitialised memory after ``materialize``."""
    if missing:
        rank_zero_warn(
            "Parameter initialization incomplete. The following modules have parameters or buffers with uninitialized "
            f"memory because they don't define a `reset_parameters()` method for re-initialization: "
            f"{', '.join(sorted(set(missing)))}. Load a checkpoint into the model (fabric.load) before training, or "
            "give those modules a reset_parameters() that initialises their own parameters and buffers.",
            stacklevel=6,
        )


def refuse_meta_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise (Lightning Fabric's error) when ``optimizer`` still holds meta parameters no set-up model replaced."""
    if any(p.is_meta for group in optimizer.param_groups for p in group["params"]):
        raise RuntimeError(
            "The optimizer has references to the model's meta-device parameters (built under "
            "fabric.init_module(empty_init=True)), which no model set up with this Fabric replaced. Set up the model "
            "first, `model = fabric.setup_module(model)`, then create the optimizer over `model.parameters()` and "
            "call `optimizer = fabric.setup_optimizers(optimizer)`; or pass both to `fabric.setup(model, optimizer)`."
        )


# ---------------------------------------------------------------------- the step: gradient sync
@contextmanager
def no_gradient_sync(module: FSDPModule) -> Iterator[None]:
    """Leave ``module``'s gradients unreduced inside the block (``fabric.no_backward_sync`` under FSDP)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
