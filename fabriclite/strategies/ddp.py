"""DistributedDataParallel: every rank holds the whole model; gradients are averaged during backward."""

from __future__ import annotations

import inspect
import warnings
import weakref
from contextlib import nullcontext
from typing import Any, ContextManager

import torch
import torch.distributed as dist
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
        fake = dist.get_backend() == "fake"  # `fabriclite plan`: fake tensors on torch's fake process group
        kwargs = {"init_sync": False, **self.ddp_kwargs} if fake else self.ddp_kwargs
        wrapped = DistributedDataParallel(module, device_ids=device_ids, **kwargs)
        if fake:
            _run_on_fake_tensors(wrapped)
        self._wrapped.add(wrapped)
        return wrapped

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self._check_set_up(params, f"This {type(optimizer).__name__} optimizer updates", ValueError)
        return optimizer

    loss_unchecked = True  # the first backward checks where its loss came from, once

    def check_loss(self, loss: torch.Tensor) -> None:
        self.loss_unchecked = False
        self._check_set_up(_parameters_behind(loss), "This loss comes from", RuntimeError)

    def _check_set_up(self, params: list[torch.Tensor], what: str, error: type[Exception]) -> None:
        # Refuse when none of `params` belongs to a set-up model (the model was forgotten); warn when some do not (a
        # loose parameter, perhaps on purpose). Either way their gradients are not averaged across processes.
        known = {id(p) for wrapped in self._wrapped for p in wrapped.module.parameters()}
        outside = [p for p in params if id(p) not in known]
        if not outside:
            return
        shapes = ", ".join(str(list(p.shape)) for p in outside[:5]) + (", ..." if len(outside) > 5 else "")
        message = (
            f"{what} {len(outside)} parameter(s) of shapes {shapes} that belong to no model set up with "
            f"fabric.setup: under DDP only a set-up model averages its gradients across the {self.world_size} "
            "processes, so each process would train its own copy. Set the model up first "
            "(`model, optimizer = fabric.setup(model, optimizer)`) and compute the loss with the model it returns."
        )
        if len(outside) == len(params):
            raise error(message)
        warnings.warn(message, stacklevel=4)

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


def _run_on_fake_tensors(wrapped: DistributedDataParallel) -> None:
    """Let DDP run on the fake tensors of `fabriclite plan`, where three of its steps read values that fake tensors
    do not have: its check that every rank holds the same shapes (skipped by ``init_sync=False``: every pretend rank
    runs this very model), the futures of its all-reduce (which carry no tensors on the fake group: the all-reduce
    runs in a hook instead) and the rebuild of its buckets in the second iteration (skipped: the rebuilt buckets
    regroup the same gradients, so they hold the same bytes)."""
    wrapped.register_comm_hook(None, _all_reduce_bucket)
    wrapped.reducer = _WithoutRebuild(wrapped.reducer)


class _WithoutRebuild:
    def __init__(self, reducer: Any) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def _all_reduce_bucket(state, bucket):  # noqa: ANN001, ANN201 - DDP refuses any annotation but its own classes
    """DDP's own all-reduce (the average of a gradient bucket, in place), as a comm hook whose future holds the
    bucket: what DDP's reducer expects back, which the fake process group's futures do not give."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    dist.all_reduce(buffer)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)
    return done


def _parameters_behind(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that require grad which ``loss`` was computed from, found by walking its autograd graph."""
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it accumulates into
        if isinstance(variable, torch.Tensor):
            found.append(variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return found
