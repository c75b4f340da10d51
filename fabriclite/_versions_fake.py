"""What ``fabriclite plan`` uses of torch's pretend parts, in every supported torch (2.8 to 2.15): fake tensors
(``FakeTensorMode``: shape, dtype and device, no memory), the fake process group (no peers, every collective
returns at once) and the dispatch-mode base class its trackers build on.

The version module's rule holds here too: these private torch names are used here and nowhere else (kept apart
from ``_versions.py``, which reached the 500 lines a module may have). Imports nothing of fabriclite.
Usage: ``from fabriclite._versions_fake import real_tensors``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fabriclite._versions import inner_tensor

# The op every read of a tensor's value goes through (``.item()``, ``bool()``, ``.tolist()``).
READ_VALUE = torch.ops.aten._local_scalar_dense.default


def real_tensors() -> Any:
    """A context leaving any FakeTensorMode for its block (``fabriclite plan`` runs scripts under one): a device
    mesh's rank numbers and pickled objects must stay real. Usage: ``with real_tensors(): init_device_mesh(...)``."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def fake_mode_active() -> bool:
    """Whether a FakeTensorMode is active here (``fabriclite plan`` runs the script under one). Usage: in setup."""
    from torch._guards import active_fake_mode

    return active_fake_mode() is not None


def is_fake_limit(error: BaseException) -> bool:
    """Whether ``error`` is what fake tensors cannot do (an op whose output shape or result depends on values, an
    op with no fake implementation, code reading a fake tensor's memory), not an error of the code itself.
    Usage: ``if is_fake_limit(error): say_the_plan_stopped_here()``."""
    from torch._subclasses import fake_tensor

    limits = (
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.DataDependentOutputException,
        fake_tensor.UnsupportedFakeTensorException,
        fake_tensor.UnsupportedOperatorException,
    )
    memory = ("data is not allocated yet", "not supported for tensor subclasses", "Cannot access data pointer")
    return isinstance(error, limits) or (isinstance(error, RuntimeError) and any(m in str(error) for m in memory))


def fake_tensor_mode() -> Any:
    """torch's ``FakeTensorMode``, taking real tensors in too, whose tensors ``module.to()`` can swap: by default
    it keeps a weak reference to each op's output, and ``torch.utils.swap_tensors`` (which ``module.to`` uses on
    fake parameters) refuses a tensor that has one. Usage: ``with fake_tensor_mode(): model = GPT(config)``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    mode.fake_tensor_converter.set_tensor_memo = lambda tensor, fake: None
    return mode


def is_fake(tensor: Any) -> bool:
    """Whether ``tensor`` (or the tensor inside a DTensor) is a fake tensor. Usage: ``is_fake(param)``."""
    return isinstance(tensor, torch.Tensor) and isinstance(inner_tensor(tensor), FakeTensor)


def unknown_value(tensor: Any) -> bool:
    """Whether ``tensor`` is fake and does not know its value (FakeTensorMode keeps the values of small constants,
    such as an optimizer's step count, and reads them as usual). Usage: ``if unknown_value(t): stand_in(t)``."""
    return is_fake(tensor) and inner_tensor(tensor).constant is None


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """Join torch's fake process group as ``rank`` of ``world_size`` (no store, no peers; an all-gather hands every
    slot this rank's data, so object collectives see this rank's object everywhere).
    Usage: ``fake_process_group(1024, rank=1023)``."""
    import importlib.util

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend on 2.8-2.15

    if importlib.util.find_spec("torch.distributed._meta_registrations") is None:
        # torch 2.8 gives c10d's collectives (allreduce_, scatter_, ...) no fake kernels at import: its memory tools'
        # module registers them. Later torch registers them itself, and twice would be refused.
        import torch.distributed._tools.fake_collectives  # noqa: F401

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def forget_sharding_specs() -> None:
    """Empty DTensor's caches of output specs. They are keyed by device meshes, which compare equal whatever rank
    made them, so the specs of one plan (one rank) would hand its mesh, and its rank's coordinate, to the next plan
    in the same process. Usage: before planning another rank."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache.cache_clear()  # an lru_cache inside
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # its C++ copy (2.13+)
    if clear_fast_path is not None:
        clear_fast_path()


def local_shape(global_shape: Any, mesh_shape: Any, coordinate: list[int], placements: Any) -> tuple[int, ...]:
    """The shape of the shard a DTensor of ``global_shape`` has at ``coordinate`` of a mesh of ``mesh_shape``
    under ``placements``, as DTensor computes it for its own rank (torch's private helper, the same four leading
    arguments in 2.8 to 2.15). Usage: ``local_shape((10, 4), (4,), [3], [Shard(0)])`` -> ``(1, 4)``."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    return tuple(_compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)[0])


def torch_dispatch_mode() -> type:
    """torch's ``TorchDispatchMode`` base class. Usage: ``class Tracker(torch_dispatch_mode()): ...``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def storages(tensor: torch.Tensor) -> list[Any]:
    """The storages holding ``tensor``'s memory: its own, or those of the tensors inside a wrapper subclass (a
    DTensor's local shard); none for a tensor on the meta device, which holds no memory (a fake tensor names the
    device it pretends to be on). Usage: ``sum(s.nbytes() for s in storages(param))``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(tensor):
        return [] if tensor.device.type == "meta" else [tensor.untyped_storage()]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [storage for t in inner if isinstance(t, torch.Tensor) for storage in storages(t)]


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nest of lists, tuples and dicts (torch's pytree). Usage: ``tensors_in((args, kwargs))``."""
    from torch.utils._pytree import tree_leaves

    return [leaf for leaf in tree_leaves(obj) if isinstance(leaf, torch.Tensor)]


def group_size_of(op: Any, args: tuple) -> int:
    """The size of the process group a collective ``op`` runs on, from its arguments: a ``c10d`` op names the
    group object, a ``_c10d_functional`` one its registered name (and sometimes its size). Usage: in a dispatch mode,
    ``group_size_of(func, args)``; 0 where none is found."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):  # the group, boxed as the dispatcher passes it
            try:
                return dist.ProcessGroup.unbox(arg).size()
            except RuntimeError:  # another boxed class (a ReduceOp)
                continue
    schema = op._schema
    for argument, value in zip(schema.arguments, args):
        if argument.name == "group_size" and isinstance(value, int):
            return value
        if argument.name == "group_name" and isinstance(value, str):
            return _resolve_process_group(value).size()
    return 0


def op_name(op: Any) -> str:
    """An op's name without its namespace and overload: ``torch.ops.c10d.allreduce_.default`` -> ``"allreduce_"``.
    Usage: in a dispatch mode, ``op_name(func)``."""
    return op._opname
