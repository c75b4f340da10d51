"""The ``Metric`` base class: state declared with ``add_state``, and everything around the math done here once —
caching, resetting, merging, syncing across processes, dropping padded rows, moving between devices, saving.

A subclass writes ``update`` and ``compute`` as in torchmetrics. ``__init_subclass__`` wraps them at class creation
(not per instance, so metrics pickle and deepcopy as plain modules):

- ``update`` checks that tensor inputs sit on the metric's device, drops the rows the data loader marked as padding
  (``fabriclite._padding``), invalidates the cached value and counts the call;
- ``compute`` syncs the states across processes (when there are several), computes, restores the local states,
  and caches the value until the next ``update`` (single process only: see ``_wrap_compute``).

Usage::

    class Hits(Metric):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.add_state("hits", torch.tensor(0), dist_reduce_fx="sum")

        def update(self, preds, target):
            self.hits = self.hits + (preds == target).sum()

        def compute(self):
            return self.hits
"""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
from torch import Tensor, nn

from fabriclite._padding import current_padding
from fabriclite.collectives import is_distributed, metric_group
from fabriclite.metrics._sync import Reduction, State, sync_states

_NAMED_REDUCTIONS = ("sum", "mean", "min", "max", "cat")
# set on every update or compute; see Metric.__setattr__
_BOOKKEEPING = frozenset({"_computed", "_update_count", "_in_update", "_in_compute", "_forwarding", "_local_states"})


class Metric(nn.Module):
    """Base class of every metric: declare states with ``add_state``, fill in ``update`` and ``compute``.

    Usage: ``acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device); acc(preds, target); acc.compute()``.

    Args:
        sync_on_compute: sync the states across processes in ``compute()`` when ``torch.distributed`` is initialized
            with more than one process. Every rank must then call ``compute()``: it runs collectives.
        compute_with_cache: return the cached value from ``compute()`` until the next ``update`` (single process).
        process_group: the group to sync over (default: the whole world; under ModelParallelStrategy the
            data-parallel ranks, since the ranks of one tensor-parallel group see the same batch).
        drop_padding: drop the rows the data loader marked as padding (duplicates added by ``DistributedSampler``).
            Rows are dropped from every tensor argument whose first dimension equals the batch size; when none
            does (a per-token metric fed ``(batch * tokens)`` rows, say), nothing is dropped.
    """

    is_differentiable: bool | None = None
    higher_is_better: bool | None = None
    full_state_update: bool = False  # torchmetrics' flag; forward here always updates once and merges

    def __init__(
        self,
        *,
        sync_on_compute: bool = True,
        compute_with_cache: bool = True,
        process_group: Any = None,
        drop_padding: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            raise TypeError(
                f"{type(self).__name__} got unexpected keyword arguments {sorted(kwargs)}. The options every metric "
                "takes are sync_on_compute, compute_with_cache, process_group and drop_padding; torchmetrics' "
                "dist_sync_on_step, compute_on_cpu, dist_sync_fn and multidim_average are not supported."
            )
        self.sync_on_compute = sync_on_compute
        self.compute_with_cache = compute_with_cache
        self.process_group = process_group
        self.drop_padding = drop_padding
        self._defaults: dict[str, State] = {}
        self._reductions: dict[str, Reduction] = {}
        self._persistent: dict[str, bool] = {}
        self._device = torch.device("cpu")
        self._update_count = 0
        self._computed: Any = None
        self._local_states: dict[str, State] | None = None  # set while synced, so that unsync can restore them
        self._in_update = False
        self._in_compute = False
        self._forwarding = False

    def __setattr__(self, name: str, value: Any) -> None:
        # States and bookkeeping are plain attributes written on every update. nn.Module.__setattr__ first checks
        # whether a value is a parameter, buffer or submodule, which costs more than counting a small batch.
        if name in _BOOKKEEPING or name in self.__dict__.get("_defaults", ()):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "update" in cls.__dict__:
            cls.update = _wrap_update(cls.__dict__["update"])
        if "compute" in cls.__dict__:
            cls.compute = _wrap_compute(cls.__dict__["compute"])

    # ----------------------------------------------------------------------------------------------- declaring

    def add_state(
        self, name: str, default: Tensor | list, dist_reduce_fx: Reduction = "sum", persistent: bool = False
    ) -> None:
        """Declare a state: its default (a tensor, or ``[]`` for a list of tensors) and how ranks combine it.

        Usage: ``self.add_state("total", torch.tensor(0), dist_reduce_fx="sum")``.
        ``dist_reduce_fx`` is ``"sum"``, ``"mean"``, ``"min"``, ``"max"``, ``"cat"`` (rows of every rank), ``None``
        (gather without reducing) or a callable given the per-rank values stacked. ``persistent`` states go into
        ``state_dict``.
        """
        if not (isinstance(default, Tensor) or (isinstance(default, list) and not default)):
            raise ValueError(
                f"A state's default must be a tensor or an empty list, got {type(default).__name__} for {name!r}"
            )
        if not (dist_reduce_fx is None or dist_reduce_fx in _NAMED_REDUCTIONS or callable(dist_reduce_fx)):
            raise ValueError(
                f"dist_reduce_fx for {name!r} must be one of {_NAMED_REDUCTIONS}, None or a callable, got {dist_reduce_fx!r}"
            )
        if isinstance(dist_reduce_fx, str) and dist_reduce_fx != "cat" and isinstance(default, list):
            raise ValueError(f"A list state ({name!r}) can only be reduced with 'cat', None or a callable")
        if isinstance(default, Tensor):
            default = default.detach().to(self._device)
        self._defaults[name] = default
        self._reductions[name] = dist_reduce_fx
        self._persistent[name] = persistent
        setattr(self, name, default.clone() if isinstance(default, Tensor) else [])

    # --------------------------------------------------------------------------------------- to be filled in

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a batch to the states."""
        raise NotImplementedError(f"{type(self).__name__} must implement update()")

    def compute(self) -> Any:
        """The metric's value from the (synced) states."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute()")

    # ------------------------------------------------------------------------------------------------ using

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Accumulate the batch and return the metric on this batch alone (not synced across processes).

        One ``update``: the batch goes into fresh default states, its value is computed from them, then they are
        merged into the accumulated states.
        """
        if self._local_states is not None:
            raise RuntimeError(f"{type(self).__name__} is synced; call unsync() before forward()")
        accumulated, count = self.metric_state, self._update_count
        self._reset_states()
        self._update_count = 0
        self._forwarding = True
        try:
            self.update(*args, **kwargs)
            batch_value = self.compute()
        except BaseException:
            self._restore(accumulated, count)  # a bad batch must not cost the user what was accumulated
            raise
        finally:
            self._forwarding = False
        with torch.no_grad():
            self._merge(accumulated, count)
        self._update_count = count + 1
        self._computed = None
        return batch_value

    def reset(self) -> None:
        """Back to the default states, as after construction.

        Usage: ``metric.reset()`` at the end of an epoch.
        """
        self._reset_states()
        self._update_count = 0
        self._computed = None
        self._local_states = None

    def merge_state(self, incoming: Metric | dict[str, State]) -> None:
        """Fold another metric's states (or a dict of states) into this one's, by each state's reduction.

        Usage: ``total.merge_state(metric_of_shard)``.
        """
        if isinstance(incoming, Metric):
            if type(incoming) is not type(self):
                raise ValueError(f"Cannot merge a {type(incoming).__name__} into a {type(self).__name__}")
            states, count = incoming.metric_state, incoming._update_count
        elif isinstance(incoming, dict):
            missing = set(self._defaults) - set(incoming)
            if missing:
                raise ValueError(
                    f"The dict to merge lacks the states {sorted(missing)}; expected {sorted(self._defaults)}"
                )
            states, count = incoming, 1
        else:
            raise TypeError(
                f"merge_state expects a {type(self).__name__} or a dict of states, got {type(incoming).__name__}"
            )
        with torch.no_grad():
            self._merge(states, count)
        self._update_count += count
        self._computed = None

    def clone(self) -> Metric:
        """A deep copy, states included.

        Usage: ``val_acc = train_acc.clone()``.
        """
        return copy.deepcopy(self)

    def persistent(self, mode: bool = False) -> None:
        """Make every state persistent (saved in ``state_dict``) or not."""
        for name in self._persistent:
            self._persistent[name] = mode

    # ------------------------------------------------------------------------------------------------ syncing

    def sync(self, process_group: Any = None, should_sync: bool = True) -> None:
        """Replace the local states by the states reduced over all processes (a no-op with one process).

        Usage: ``metric.sync(); ...; metric.unsync()``, or ``with metric.sync_context(): ...``.
        """
        if not should_sync:
            return
        if self._local_states is not None:
            raise RuntimeError(f"{type(self).__name__} is already synced; call unsync() first")
        group = next((g for g in (process_group, self.process_group, metric_group()) if g is not None), None)
        if not is_distributed(group):
            return
        self._local_states = self.metric_state
        for name, value in sync_states(self._local_states, self._reductions, group, self._device).items():
            setattr(self, name, value)
        self._computed = None  # a cached value belongs to the states it was computed from

    def unsync(self, should_unsync: bool = True) -> None:
        """Restore the local states that ``sync()`` replaced."""
        if not should_unsync:
            return
        if self._local_states is None:
            raise RuntimeError(f"{type(self).__name__} is not synced; there is nothing to unsync")
        for name, value in self._local_states.items():
            setattr(self, name, value)
        self._local_states = None
        self._computed = None

    @contextmanager
    def sync_context(self, process_group: Any = None, should_sync: bool = True) -> Iterator[None]:
        """Synced states inside the block, local ones after it.

        Usage: ``with metric.sync_context(): torch.save(metric.metric_state, path)``.
        """
        self.sync(process_group, should_sync)
        synced = self._local_states is not None
        try:
            yield
        finally:
            if synced:
                self.unsync()

    # ---------------------------------------------------------------------------------------------- properties

    @property
    def device(self) -> torch.device:
        """Where the states live (moved by ``.to(device)``)."""
        return self._device

    @property
    def metric_state(self) -> dict[str, State]:
        """The current states by name (lists are copied, tensors shared)."""
        return {name: _shallow_copy(getattr(self, name)) for name in self._defaults}

    @property
    def update_count(self) -> int:
        """How many batches went in since the last reset."""
        return self._update_count

    @property
    def update_called(self) -> bool:
        return self._update_count > 0

    # ---------------------------------------------------------------------------------------------- internals

    def _reset_states(self) -> None:
        for name, default in self._defaults.items():
            setattr(self, name, default.clone() if isinstance(default, Tensor) else [])

    def _restore(self, states: dict[str, State], count: int) -> None:
        for name, value in states.items():
            setattr(self, name, value)
        self._update_count = count

    def _merge(self, incoming: dict[str, State], incoming_count: int) -> None:
        """Fold ``incoming`` (counted as ``incoming_count`` updates) into the current states, incoming first."""
        own_count = self._update_count
        for name, fx in self._reductions.items():
            theirs, mine = incoming[name], getattr(self, name)
            if fx == "sum":
                merged = theirs + mine
            elif fx == "mean":
                total = incoming_count + own_count
                merged = (theirs * incoming_count + mine * own_count) / total if total else mine
            elif fx == "min":
                merged = torch.minimum(theirs, mine)
            elif fx == "max":
                merged = torch.maximum(theirs, mine)
            elif isinstance(mine, list):
                merged = list(theirs) + mine
            elif fx == "cat":
                merged = torch.cat([theirs, mine])
            elif fx is None:
                merged = torch.stack([theirs, mine])
            else:
                merged = fx(torch.stack([theirs, mine]))
            setattr(self, name, merged)

    def _check_devices(self, names: list[str], args: tuple, kwargs: dict) -> None:
        for i, value in enumerate(args):
            if isinstance(value, Tensor) and value.device != self._device:
                self._raise_device_mismatch(names[i] if i < len(names) else f"args[{i}]", value)
        for name, value in kwargs.items():
            if isinstance(value, Tensor) and value.device != self._device:
                self._raise_device_mismatch(name, value)

    def _raise_device_mismatch(self, name: str, value: Tensor) -> None:
        raise ValueError(
            f"{type(self).__name__}: argument {name!r} is on {value.device} but the metric's states are on "
            f"{self._device}; move the metric with `.to({str(value.device)!r})` (or `.to(fabric.device)`)."
        )

    def _drop_padding(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        mask = current_padding() if self.drop_padding else None
        if mask is None or not bool(mask.any()):
            return args, kwargs
        rows = mask.shape[0]
        keep = (~mask).nonzero().squeeze(1)

        def drop(value: Any) -> Any:
            if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == rows:
                return value.index_select(0, keep.to(value.device))
            return value

        return tuple(drop(a) for a in args), {k: drop(v) for k, v in kwargs.items()}

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> Metric:
        # Modules move their parameters and buffers; states are plain attributes (lists among them), so move them
        # here. Only the device follows `fn`: a `.half()` or `.to(torch.bfloat16)` of the model a metric sits in
        # must not turn exact counts and sums into low-precision ones.
        module = super()._apply(fn, *args, **kwargs)
        device = fn(torch.zeros((), device=self._device)).device
        if device != self._device:
            self._device = device
            for name, default in self._defaults.items():
                if isinstance(default, Tensor):
                    self._defaults[name] = default.to(device)
                value = getattr(self, name)
                setattr(self, name, [v.to(device) for v in value] if isinstance(value, list) else value.to(device))
            self._computed = None
        return module

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name, persistent in self._persistent.items():
            if persistent:
                value = getattr(self, name)
                if not keep_vars:
                    value = [v.detach() for v in value] if isinstance(value, list) else value.detach()
                destination[prefix + name] = value

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        for name, persistent in self._persistent.items():
            key = prefix + name
            if key in state_dict:
                # popped so that nn.Module does not report it as unexpected (load_state_dict passes a copy)
                value = state_dict.pop(key)
                setattr(
                    self,
                    name,
                    [v.to(self._device) for v in value] if isinstance(value, list) else value.to(self._device),
                )
                self._computed = None
            elif persistent and strict:
                missing_keys.append(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        return f"states={list(self._defaults)}"


def _shallow_copy(value: State) -> State:
    return list(value) if isinstance(value, list) else value


def _positional_names(function: Callable) -> list[str]:
    parameters = list(inspect.signature(function).parameters.values())[1:]  # after self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]


def _wrap_update(update: Callable) -> Callable:
    names = _positional_names(update)

    @functools.wraps(update)
    def wrapped_update(self: Metric, *args: Any, **kwargs: Any) -> None:
        if self._in_update:  # a subclass's update calling super().update(): the outer call did the bookkeeping
            return update(self, *args, **kwargs)
        if self._local_states is not None:
            raise RuntimeError(f"{type(self).__name__} is synced; call unsync() before update()")
        self._check_devices(names, args, kwargs)
        args, kwargs = self._drop_padding(args, kwargs)
        self._computed = None
        self._in_update = True
        try:
            # States never hold a graph; only forward's batch value of a differentiable metric may.
            with torch.set_grad_enabled(self._forwarding and bool(self.is_differentiable) and torch.is_grad_enabled()):
                update(self, *args, **kwargs)
        finally:
            self._in_update = False
        self._update_count += 1
        return None

    return wrapped_update


def _wrap_compute(compute: Callable) -> Callable:
    @functools.wraps(compute)
    def wrapped_compute(self: Metric) -> Any:
        if self._in_compute:  # super().compute() from a subclass
            return compute(self)
        syncing = (
            self.sync_on_compute
            and not self._forwarding
            and self._local_states is None
            and is_distributed(self.process_group if self.process_group is not None else metric_group())
        )
        # The cache serves one process only. Across processes it would be wrong (another rank may have updated
        # since) and could deadlock (a rank answering from its cache skips the collectives the others wait in).
        caching = self.compute_with_cache and not syncing and not self._forwarding
        if caching and self._computed is not None:
            return self._computed
        if self._update_count == 0 and not syncing:
            warnings.warn(
                f"{type(self).__name__}.compute() was called before any update(); it returns the value of the "
                "default states.",
                UserWarning,
                stacklevel=2,
            )
        if syncing:
            self.sync()
        self._in_compute = True
        try:
            with torch.set_grad_enabled(self._forwarding and bool(self.is_differentiable) and torch.is_grad_enabled()):
                value = compute(self)
        finally:
            self._in_compute = False
            if syncing:
                self.unsync()
        if caching:
            self._computed = value
        return value

    return wrapped_compute
