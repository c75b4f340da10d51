"""What the sharding strategies (``FSDPStrategy`` and ``ModelParallelStrategy``, siblings as in Lightning: neither
is the other) share, by composition (the policies that choose the units are in ``policies.py``; the default units,
``repeated_blocks``, in ``fabriclite._blocks``): building the model on the meta device and giving each rank
storage for its shard only (``meta_init``, ``materialize``), everything around sharding a model in ``setup`` and
pointing its optimizers at the shards (``ShardedSetup``, one per strategy and process), compiling the units, and
skipping the gradient reduction of FSDP units (``no_gradient_sync``).

Usage: ``with meta_init(): model = build()``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from fabriclite.rank_zero import rank_zero_warn
from fabriclite._versions import average_gradients_on_gloo, device_constructors

if TYPE_CHECKING:  # importing FSDP is slow; materialize_meta_tensors is also used without it
    from torch.distributed.fsdp import FSDPModule


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
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, its new tensor)
    for sub in _children_first(module, set()):
        if not any(t.is_meta for t in itertools.chain(sub.parameters(recurse=False), sub.buffers(recurse=False))):
            continue
        _give_storage(sub, device, made)
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if not callable(reset):
            missing.append(type(sub).__name__)
            continue
        with torch.no_grad(), _whole_tensors(sub):
            reset()
    return missing


def _give_storage(module: nn.Module, device: torch.device | str, made: dict) -> None:
    # module.to_empty(recurse=False) for its meta tensors only, giving a tensor shared by several modules (tied
    # weights: an embedding and the output head) one new tensor, so the tie survives, as in a model built normally.
    for store in (module._parameters, module._buffers):
        for name, tensor in list(store.items()):
            if tensor is None or not tensor.is_meta:
                continue
            if id(tensor) not in made:
                new = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    new = nn.Parameter(new, requires_grad=tensor.requires_grad)
                made[id(tensor)] = (tensor, new)  # the meta tensor kept alive, so its id is not reused
            store[name] = made[id(tensor)][1]


def materialize_meta_tensors(module: nn.Module, device: torch.device | str) -> None:
    """``materialize``, refusing a module that holds meta tensors and has no ``reset_parameters()`` (its memory
    would stay uninitialised), with Lightning Fabric's ``TypeError`` (``utilities.init._materialize_meta_tensors``).

    Usage: ``materialize_meta_tensors(block, "cuda:1")``.
    """
    missing = materialize(module, device)
    if missing:
        raise TypeError(
            f"Materialization requires that the `{missing[0]}.reset_parameters` method is implemented. This method "
            "is used to initialize any children parameters or buffers in this module."
        )


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


# ---------------------------------------------------------------------- setup: sharding a model, its optimizers
class ShardedSetup:
    """What both sharding strategies do around their own way of sharding a model (FSDP's units, or the user's
    ``parallelize_fn``): check the model, keep rank 0's weights, shard, give what is still on the meta device its
    storage, give every rank its slice of rank 0's weights, and point optimizers built on the unsharded model at
    the shards. A strategy holds one per process.

    Usage: ``module = self._sharding.setup_module(self, module, self._shard, device)``.
    """

    def __init__(self) -> None:
        # Parameters sharding replaced: id(old) -> (old, new), both weak: the full-size originals go with their
        # optimizer, the shards with the model.
        self.replaced: dict[int, tuple[weakref.ref, weakref.ref]] = {}
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.uninitialized: list[str] = []  # module classes materialize could not fill, during one setup_module

    def setup_module(
        self, strategy: Any, module: nn.Module, shard: Callable[[nn.Module], nn.Module], device: torch.device
    ) -> nn.Module:
        """Shard ``module`` with ``shard`` (which may materialise units itself, adding to ``uninitialized``)."""
        from torch.distributed.fsdp import FSDPModule

        if type(module).__name__ == "OptimizedModule":  # compiled by the user: shard the model inside, keep the wrapper
            self.setup_module(strategy, module._orig_mod, shard, device)
            return module
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError(
                f"{type(module).__name__} already contains fully_shard modules; pass fabric.setup the plain model."
            )
        metas = strategy.all_gather_object(has_meta(module))
        if any(metas) and not all(metas):
            raise ValueError(
                f"The model has parameters or buffers on the meta device on ranks {[r for r, m in enumerate(metas) if m]} "
                "only. Build it the same way on every rank: inside `with fabric.init_module(empty_init=True):` (the meta "
                "device everywhere, each rank's shard initialised in setup), or with real weights everywhere."
            )
        copy = strategy.world_size > 1 and not metas[0]
        # Rank 0's full weights, taken before sharding replaces the parameters (aliases: sharding may move the
        # parameters' data to the device, these stay where the model was built).
        source = {n: t.detach() for n, t in named_tensors(module).items()} if copy and strategy.is_global_zero else {}
        old_params = [(name, weakref.ref(p)) for name, p in module.named_parameters()]
        precision = getattr(strategy, "precision", None)
        if precision is not None:  # fp8's weights became new parameters in its conversion; optimizers hold the old
            old_params += [(name, weakref.ref(p)) for name, p in precision.replaced_parameters().items()]
        self.uninitialized = []
        module = shard(module)
        average_gradients_on_gloo(module)  # FSDP2 units over gloo sum and divide themselves (torch 2.8 summed)
        if has_meta(module):  # what shard left on the meta device (a parallelize_fn's)
            self.uninitialized += materialize(module, device)
        warn_uninitialized(self.uninitialized)
        if copy:
            copy_from_rank_zero(strategy, module, source)
        new_params = dict(module.named_parameters())
        for name, old in old_params:
            if old() is not None:
                self.replaced[id(old())] = (old, weakref.ref(new_params[name]))
        for optimizer in list(self.optimizers):  # set up before this module: point them at the shards now
            self.remap(optimizer)
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the unsharded model at the shards (same groups, order and hyperparameters);
        one over the meta parameters of a model not set up yet is refused, as in Lightning Fabric."""
        self.remap(optimizer)
        refuse_meta_optimizer(optimizer)
        self.optimizers.add(optimizer)
        return optimizer

    def remap(self, optimizer: torch.optim.Optimizer) -> None:
        def sharded(param: torch.Tensor) -> torch.Tensor:
            old, new = self.replaced.get(id(param), (None, None))
            return new() if old is not None and old() is param and new() is not None else param

        groups = [[sharded(p) for p in group["params"]] for group in optimizer.param_groups]
        changed = any(
            a is not b for group, new in zip(optimizer.param_groups, groups) for a, b in zip(group["params"], new)
        )
        if not changed:
            return
        if optimizer.state:
            raise RuntimeError(
                "This optimizer already holds state (it has stepped) for the unsharded parameters, which FSDP "
                "replaced. Call `model = fabric.setup_module(model)`, then build the optimizer on model.parameters(), "
                "then `optimizer = fabric.setup_optimizers(optimizer)`."
            )
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params


@torch.no_grad()
def copy_from_rank_zero(strategy: Any, module: nn.Module, source: dict[str, torch.Tensor]) -> None:
    """Give every rank its slice of rank 0's weights (``source``, rank 0's full tensors by name; empty elsewhere).

    Rank 0 scatters each parameter's slices and broadcasts each buffer: one full tensor in flight at a time. A
    DTensor on a 2-D mesh, or on a sub-mesh without global rank 0 (tensor parallel x FSDP: the FSDP-only layers of
    the other tensor-parallel ranks), gets the whole tensor by broadcast and keeps its own slice."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, tensor in named_tensors(module).items():
        if isinstance(tensor, DTensor):
            full = source[name] if strategy.is_global_zero else torch.empty(tensor.shape, dtype=tensor.dtype)
            mesh = tensor.device_mesh
            full = full.to(mesh.device_type)
            scatter = mesh.ndim == 1 and mesh.size() == strategy.world_size
            if not scatter:
                dist.broadcast(full, src=0)
            shard = distribute_tensor(full, mesh, tensor.placements, src_data_rank=0 if scatter else None)
            tensor.to_local().copy_(shard.to_local())
        else:
            full = source[name].to(tensor.device) if strategy.is_global_zero else tensor
            dist.broadcast(full, src=0)
            tensor.copy_(full)


def compile_units(module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
    """Compile each FSDP unit of a sharded model, then the root, in place (``nn.Module.compile``): the modules FSDP
    hooked stay the same objects, and the units' graphs sit between FSDP's all-gathers."""
    from torch.distributed.fsdp import FSDPModule

    inner = module._orig_mod if type(module).__name__ == "OptimizedModule" else module
    for unit in [m for m in inner.modules() if m is not inner and isinstance(m, FSDPModule)]:
        unit.compile(**kwargs)
    module.compile(**kwargs)
    return module


# ---------------------------------------------------------------------- the step: gradient sync
@contextmanager
def no_gradient_sync(module: FSDPModule) -> Iterator[None]:
    """Leave ``module``'s gradients unreduced inside the block (``fabric.no_backward_sync`` under FSDP)."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
