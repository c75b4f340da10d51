"""Each rank's memory, counted on the tensors the script makes: every storage an op creates is counted from its
creation until it is freed (a weak reference on the storage; a view shares its base's storage and counts once), and
the peak is kept with the storages alive at that moment. It counts fake tensors (a plan) and real ones alike.

What a storage is comes from what the script does with it, learnt as the run goes: the model's parameters and
buffers (which FSDP does not shard) at its first forward, the gradients as the optimizer starts a step, the optimizer's state as it ends one,
the tensors a collective sends or receives (FSDP's gathered and reduced buffers, DDP's gradient buckets) when it
runs. A storage takes the first of those kinds that applies, in the order of ``KINDS``; anything else made once the
steps run is an activation or a temporary (saved for backward, an op's scratch, the input batch), anything made
before is "other" (the data set, what the model was built from). Because a kind can be learnt after the peak (a
gradient made in backward is known as one at the optimizer step), the peak keeps the storages, not their kinds.

Usage::

    tracker = MemoryTracker()
    with tracker:
        ...                                   # the script
    tracker.peak_by_kind()                    # {"parameters": ..., "gradients": ..., ...} at the peak of the steps
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from fabriclite._versions_fake import storages, tensors_in, torch_dispatch_mode

KINDS = (
    "parameters",
    "buffers",
    "optimizer state",
    "gradients",
    "collective buffers",
    "activations and temporaries",
    "other",
)
_RANK = {kind: i for i, kind in enumerate(KINDS)}
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional")


class _Storage:
    __slots__ = ("nbytes", "kind", "__weakref__")

    def __init__(self, nbytes: int, kind: str) -> None:
        self.nbytes = nbytes
        self.kind = kind


class MemoryTracker(torch_dispatch_mode()):
    """Counts the bytes of the storages alive, their peak before the steps (building and setting up the model) and
    their peak while the steps run, with what each storage at that peak is (``peak_by_kind``)."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: dict[int, _Storage] = {}  # id of the storage object (torch keeps one per storage) -> its record
        self._refs: dict[int, weakref.ref] = {}
        self.bytes = 0
        self.setup_peak = 0
        self.step_peak = 0
        self._at_step_peak: list[_Storage] = []
        self.stepping = False

    # ------------------------------------------------------------------ counting
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A storage first seen as the output of a view op was not allocated here: its memory belongs to a buffer
        # torch never allocated (``torch.frombuffer``, ``from_numpy``) or to a real tensor turned fake; the
        # allocator does not count it, and neither does this.
        counted = not func.is_view
        for tensor in tensors_in(out):
            self._count(tensor, counted)
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.mark(tensors_in((args, kwargs)), "collective buffers")
        return out

    def _count(self, tensor: torch.Tensor, counted: bool = True) -> list[_Storage]:
        records = []
        try:
            held = storages(tensor)
        except (RuntimeError, NotImplementedError):  # a sparse or nested tensor: no one storage to count
            return records
        for storage in held:
            key = id(storage)
            record = self.alive.get(key)
            if record is None:
                record = self._add(storage, key, counted)
            records.append(record)
        return records

    def _add(self, storage: Any, key: int, counted: bool) -> _Storage:
        nbytes = storage.nbytes() if counted else 0
        # Made while the steps run: an activation or a temporary, real or fake (the batch a real data set gives).
        record = _Storage(nbytes, "activations and temporaries" if self.stepping else "other")
        self.alive[key] = record
        self._refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
        self.bytes += record.nbytes
        if self.stepping:
            if self.bytes > self.step_peak:
                self.step_peak = self.bytes
                self._at_step_peak = list(self.alive.values())
        elif self.bytes > self.setup_peak:
            self.setup_peak = self.bytes
        return record

    def _free(self, key: int) -> None:
        record = self.alive.pop(key, None)
        self._refs.pop(key, None)
        if record is not None:
            self.bytes -= record.nbytes

    def mark(self, tensors: list[torch.Tensor], kind: str) -> None:
        """Learn that ``tensors`` are of ``kind`` (unless they are of a kind earlier in ``KINDS`` already)."""
        for tensor in tensors:
            if tensor is None:
                continue
            for record in self._count(tensor):
                if _RANK[kind] < _RANK[record.kind]:
                    record.kind = kind

    # ------------------------------------------------------------------ what the script does (FakeWorld's hooks)
    def on_first_forward(self, module: Any) -> None:
        """A model ``fabric.setup`` returned runs its first forward: its parameters and buffers are known, and the
        steps begin."""
        self.mark(list(module.parameters()), "parameters")
        self.mark(list(module.buffers()), "buffers")
        if not self.stepping:
            self.stepping = True
            self.step_peak = self.bytes
            self._at_step_peak = list(self.alive.values())

    def on_step_start(self, optimizer: torch.optim.Optimizer, modules: list[Any]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.mark(params, "parameters")
        self.mark([p.grad for p in params], "gradients")

    def on_step_end(self, optimizer: torch.optim.Optimizer) -> None:
        self.mark(tensors_in(list(optimizer.state.values())), "optimizer state")

    # ------------------------------------------------------------------ results
    def peak_by_kind(self) -> dict[str, int]:
        """The bytes of each kind among the storages alive at the peak of the steps (every kind, zeros included)."""
        totals = dict.fromkeys(KINDS, 0)
        for record in self._at_step_peak:
            totals[record.kind] += record.nbytes
        return totals
