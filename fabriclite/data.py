"""The wrapped data loader: yields exactly the batches of the user's loader, moved to the device, and keeps its
position (epoch, batches already yielded, the random state its shuffling started from) so that a run resumed
from a checkpoint continues with the very next batch. Also each rank's shard of a loader under a distributed
strategy (``distributed_loader``), marking the samples repeated to even out the ranks.
"""

from __future__ import annotations

import copy
import itertools
import os
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fabriclite._collections import move_to_device
from fabriclite._padding import set_padding
from fabriclite._versions_fake import fake_mode_active, real_tensors
from fabriclite.rank_zero import rank_zero_warn
from fabriclite.seed import (
    capture_loader_rng,
    capture_rng_state,
    restore_loader_rng,
    restore_rng_state,
    worker_init_function,
)


def _batch_rows(batch: Any) -> int | None:
    """The number of rows of a batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        rows = _batch_rows(item)
        if rows is not None:
            return rows
    return None


class _RecordRepeats:
    """An index sampler passing on the indices of ``inner`` as plain ints, after queueing for each batch which of its
    samples are repeats (``_Repeat``): a list of bools, ``True`` for an unbatched item, or ``None`` when none is.
    It runs in the main process, also with worker processes, which get their indices from it in order.

    Usage: ``loader.batch_sampler = _RecordRepeats(batch_sampler, queue, batched=True)`` on a copy of the loader.
    """

    def __init__(self, inner: Any, queue: deque, batched: bool) -> None:
        self.inner = inner
        self.queue = queue
        self.batched = batched

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[Any]:
        queue = self.queue
        for indices in self.inner:
            if not self.batched:
                repeated = type(indices) is _Repeat
                queue.append(True if repeated else None)
                yield int(indices) if repeated else indices
            elif any(type(i) is _Repeat for i in indices):
                queue.append([type(i) is _Repeat for i in indices])
                yield [int(i) for i in indices]
            else:
                queue.append(None)
                yield indices


class _SkipFirst:
    """An index sampler that leaves out the first ``skip`` items of ``inner``; used once, for a resumed epoch."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip
        self.last: _SkipIterator | None = None

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> _SkipIterator:
        self.last = _SkipIterator(self.inner, self.skip)
        return self.last


class _SkipIterator:
    """Lazy like a sampler's generator, so the draws for shuffling happen in the same order as in the raw loader
    (the loader draws its worker seed first, the sampler draws on its first item); ``prime`` forces them."""

    def __init__(self, inner: Any, skip: int) -> None:
        self._inner = inner
        self._skip = skip
        self._it: Iterator | None = None

    def prime(self) -> None:
        if self._it is None:
            it = iter(self._inner)
            for _ in itertools.islice(it, self._skip):
                pass
            first = list(itertools.islice(it, 1))  # the sampler draws its seed on its first item
            self._it = itertools.chain(first, it)

    def __iter__(self) -> _SkipIterator:
        return self

    def __next__(self) -> Any:
        self.prime()
        return next(self._it)


def _drawn_outside_fake(loader: Any) -> Iterator[Any]:
    with real_tensors():
        batches = iter(loader)
    while True:
        with real_tensors():
            batch = next(batches, _END)
        if batch is _END:
            return
        yield batch


_END = object()


class _FabricDataLoader:
    """Iterates the user's loader, moves each batch to the device, and remembers where it is.

    Attribute access passes through to the loader (``.dataset``, ``.batch_size``, ``.sampler``...).
    Usage: returned by ``fabric.setup_dataloaders(loader)``; put it in the ``state`` given to ``fabric.save``.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self._loader = loader
        # Batches from a DataLoader are on the CPU, so a CPU run has nothing to move.
        self._device = device if device is not None and device.type != "cpu" else None
        self._epochs_started = 0
        self._in_epoch = False
        self._yielded = 0
        self._epoch_rng: dict[str, Any] | None = None
        self._resume_from: tuple[int, dict[str, Any]] | None = None
        # Which samples of each batch repeat others (None: none does), queued in the order the loader draws its
        # indices: worker processes prefetch, so the queue runs ahead of the batches yielded. Only for ranks whose
        # shard has a repeated sample; the others iterate the loader as it is.
        self._repeats: deque | None = None
        self._iterated = loader
        # Under `fabriclite plan` (a FakeTensorMode) the sample order is still drawn for real: a fake randperm read
        # index by index would cost a stand-in value per sample.
        self._real_draws = fake_mode_active()
        sampler = getattr(loader, "sampler", None)
        # Batches coming back out of order (in_order=False) cannot be matched with their indices: distributed_loader
        # warned that metrics will count the repeats twice.
        in_order = loader.num_workers == 0 or getattr(loader, "in_order", True)
        if isinstance(sampler, FabricDistributedSampler) and sampler.first_repeat < sampler.num_samples and in_order:
            self._repeats = deque()
            self._iterated = self._with_index_sampler(loader, loader._index_sampler)

    @property
    def loader(self) -> DataLoader:
        """The user's loader (or the distributed copy of it)."""
        return self._loader

    @property
    def device(self) -> torch.device | None:
        return self._device

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_loader"], name)

    def __iter__(self) -> Iterator[Any]:
        repeats = self._repeats
        if repeats is not None:
            repeats.clear()  # what an abandoned epoch drew ahead
        if self._resume_from is not None:
            skip, rng = self._resume_from
            self._resume_from = None
            batches = self._resumed_iterator(skip, rng)
        else:
            self._epochs_started += 1
            self._set_sampler_epoch()
            self._epoch_rng = capture_loader_rng(self._loader)
            batches = _drawn_outside_fake(self._iterated) if self._real_draws else iter(self._iterated)
            skip = 0
        self._yielded = skip
        self._in_epoch = True
        device = self._device
        try:
            for batch in batches:
                if repeats is not None:
                    self._mark_padding(repeats.popleft(), batch)
                # Counted before the body of the user's loop runs, so a save inside it records this batch as used.
                self._yielded += 1
                yield batch if device is None else move_to_device(batch, device)
            self._in_epoch = False
        except GeneratorExit:  # the user left the loop early: the next iteration is a new epoch, as in the raw loop
            self._in_epoch = False
            raise
        finally:
            if repeats is not None:
                set_padding(None)

    def _with_index_sampler(self, loader: DataLoader, index_sampler: Any) -> DataLoader:
        """A copy of ``loader`` drawing its indices from ``index_sampler`` through a ``_RecordRepeats``."""
        recorded = copy.copy(loader)
        object.__setattr__(recorded, "_iterator", None)
        attr = "batch_sampler" if loader._auto_collation else "sampler"  # DataLoader forbids setting these after init
        object.__setattr__(recorded, attr, _RecordRepeats(index_sampler, self._repeats, loader._auto_collation))
        return recorded

    def _mark_padding(self, repeats: Any, batch: Any) -> None:
        # Tell metrics which rows of this batch repeat samples that another rank also sees (fabriclite._padding).
        # A batch of samples has one row per sample; without batching (batch_size=None) the batch is one dataset
        # item, and when that item is a repeat, all of its rows are.
        if repeats is None:
            set_padding(None)
        elif repeats is True:
            set_padding(torch.ones(_batch_rows(batch) or 1, dtype=torch.bool))
        else:
            set_padding(torch.tensor(repeats, dtype=torch.bool))

    def _set_sampler_epoch(self) -> None:
        # A DistributedSampler shuffles by epoch number; Lightning leaves this call to the user, we don't.
        sampler = getattr(self._loader, "sampler", None)
        if callable(getattr(sampler, "set_epoch", None)):
            sampler.set_epoch(self._epochs_started - 1)

    def _resumed_iterator(self, skip: int, epoch_rng: dict[str, Any]) -> Iterator[Any]:
        """Rebuild the interrupted epoch: replay the random state it started from, skip the used batches by index
        (without loading them), then give the global random state back as the checkpoint left it."""
        now = capture_rng_state()
        self._set_sampler_epoch()
        restore_loader_rng(self._loader, epoch_rng)
        self._epoch_rng = epoch_rng
        try:
            if isinstance(self._loader.dataset, IterableDataset):
                # No indices to skip: draw the used batches and drop them.
                it = iter(self._loader)
                for _ in itertools.islice(it, skip):
                    pass
                return it
            replay = copy.copy(self._loader)
            skipper = _SkipFirst(replay._index_sampler, skip)
            if self._repeats is not None:  # record after skipping: the skipped batches are never yielded
                replay = self._with_index_sampler(replay, skipper)
            else:
                attr = "batch_sampler" if replay._auto_collation else "sampler"
                object.__setattr__(replay, attr, skipper)  # DataLoader forbids setting these after init
                object.__setattr__(replay, "_iterator", None)
            it = iter(replay)
            if skipper.last is not None:
                skipper.last.prime()
            return it
        finally:
            restore_rng_state(now)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: epochs started, whether one is under way, batches yielded, its starting random state."""
        return {
            "epochs_started": self._epochs_started,
            "in_epoch": self._in_epoch,
            "yielded": self._yielded,
            "epoch_rng": self._epoch_rng if self._in_epoch else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position; the next iteration continues the saved epoch when it was under way."""
        self._epochs_started = state["epochs_started"]
        self._in_epoch = False
        self._yielded = state["yielded"]
        self._resume_from = (state["yielded"], state["epoch_rng"]) if state["in_epoch"] else None


def wrap_loader(
    loader: DataLoader, strategy: Any, use_distributed_sampler: bool, device: torch.device | None
) -> _FabricDataLoader:
    """What ``fabric.setup_dataloaders`` does to one loader: this rank's shard of it (``strategy.process_dataloader``),
    wrapped to move batches to ``device`` and keep its position; after ``seed_everything(workers=True)`` its workers
    are seeded per worker and rank."""
    if isinstance(loader, _FabricDataLoader):
        raise ValueError("A dataloader should be passed only once to the `setup_dataloaders` method.")
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"Only PyTorch DataLoader are currently supported in `setup_dataloaders`: got {type(loader).__name__}; "
            "wrap the dataset in a torch.utils.data.DataLoader."
        )
    loader = strategy.process_dataloader(loader, use_distributed_sampler)
    if (planned := _PLANNED_BATCH.get()) is not None:
        loader = _with_batch_size(loader, *planned)
    loader.worker_init_fn = worker_init_function(loader.worker_init_fn, strategy.global_rank)
    return _FabricDataLoader(loader, device)


_PLANNED_BATCH: ContextVar[tuple[int | None, list[int | None]] | None] = ContextVar("planned_batch", default=None)


@contextmanager
def planned_batch_size(batch_size: int | None) -> Iterator[list[int | None]]:
    """Under ``fabriclite plan``, loaders ``fabric.setup_dataloaders`` sets up in this block batch ``batch_size``
    samples (None: as the script says); yields the batch sizes the script gave them (None for a loader without torch's
    ``BatchSampler``, left as it is). Usage: ``with planned_batch_size(64) as sizes: runpy.run_path(script)``."""
    token = _PLANNED_BATCH.set((batch_size, sizes := []))
    try:
        yield sizes
    finally:
        _PLANNED_BATCH.reset(token)


def _with_batch_size(loader: DataLoader, batch_size: int | None, sizes: list[int | None]) -> DataLoader:
    old = loader.batch_sampler
    sizes.append(old.batch_size if type(old) is BatchSampler else None)
    if batch_size is None or sizes[-1] is None:
        return loader
    return _copy(loader, batch_size=batch_size, batch_sampler=BatchSampler(old.sampler, batch_size, old.drop_last))


def _copy(loader: DataLoader, **attributes: Any) -> DataLoader:
    """A copy of ``loader`` with ``attributes`` replaced (DataLoader refuses to set them once iterated)."""
    copied = copy.copy(loader)
    copied.__dict__.update(_iterator=None, **attributes)
    return copied


class _Repeat(int):
    """A sample index that a ``FabricDistributedSampler`` repeated to even out the ranks. Still an int, so batch
    samplers sort and group it as any index; the loader reads the mark off each batch's indices (``_RecordRepeats``)
    and hands plain ints on to the dataset."""

    __slots__ = ()


class FabricDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that marks the indices it repeats to even out the ranks (as ``_Repeat`` ints), so the
    loader can tell metrics which samples to drop. Over a user's own sampler (``source``) it is Lightning's
    ``DistributedSamplerWrapper``: each epoch the user's sampler draws its order as it would in one process (from
    its own generator, or the global random stream, which ``seed_everything`` makes the same on every rank), and
    each rank takes every ``num_replicas``-th index of it; ``set_epoch`` reaches the user's sampler too.

    Usage: made by ``fabric.setup_dataloaders``; ``sampler.first_repeat < sampler.num_samples`` when this rank has one.
    """

    def __init__(self, dataset: Any, source: Sampler | None = None, **kwargs: Any) -> None:
        self.source = source
        super().__init__(dataset if source is None else range(len(source)), **kwargs)
        self.real_size = len(self.dataset)
        # Sample i of this rank sits at position rank + i * num_replicas of the padded order; positions from
        # real_size on repeat the first ones. With drop_last the order is cut instead, and nothing repeats.
        self.first_repeat = max(0, -(-(self.real_size - self.rank) // self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        if self.source is None:
            indices = super().__iter__()
        else:
            # The user's randomness, drawn where it would be drawn without fabriclite (so a seeded run gives the
            # numbers it gives under Lightning); this rank's positions of it.
            drawn = list(self.source)
            indices = (drawn[i] for i in super().__iter__())
        if self.first_repeat >= self.num_samples:
            return indices
        return itertools.chain(itertools.islice(indices, self.first_repeat), map(_Repeat, indices))

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if callable(getattr(self.source, "set_epoch", None)):
            self.source.set_epoch(epoch)


def _shard_sampler(dataset: Any, sampler: Sampler, common: dict[str, Any]) -> FabricDistributedSampler:
    # A plain shuffle or sequence over the whole dataset is DistributedSampler's own; any other sampler (its own
    # generator, a subset, drawing with replacement) is drawn from and its draws are sharded.
    plain = (
        type(sampler) in (RandomSampler, SequentialSampler)
        and getattr(sampler, "generator", None) is None
        and sampler.data_source is dataset
        and not getattr(sampler, "replacement", False)
        and len(sampler) == len(dataset)
    )
    if plain:
        return FabricDistributedSampler(dataset, shuffle=isinstance(sampler, RandomSampler), **common)
    if getattr(sampler, "generator", False) is None:  # torch's random samplers, drawing from the global stream
        _warn_unless_seeded(sampler)
    return FabricDistributedSampler(dataset, source=sampler, shuffle=False, **common)


def _warn_unless_seeded(sampler: Sampler) -> None:
    # Each rank draws the order of a user's sampler itself; ranks that were not seeded alike draw different orders,
    # and their shards overlap and miss samples without any error. Lightning does not warn.
    if "PL_GLOBAL_SEED" not in os.environ:
        rank_zero_warn(
            f"Your {type(sampler).__name__} is sharded across processes by drawing its order on every rank (as "
            "Lightning's DistributedSamplerWrapper does) from the global random stream, but no seed was set: each "
            "rank draws a different order and the shards overlap. Call fabric.seed_everything(seed) before "
            "iterating, or give the sampler a torch.Generator seeded alike on every rank."
        )


def distributed_loader(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """This rank's shard of ``dataloader``: a copy with a ``FabricDistributedSampler``, keeping shuffle and seed.
    A custom ``batch_sampler`` is copied with its ``.sampler`` (the samples it groups into batches) sharded, so it
    must draw its samples from that attribute, as ``BatchSampler`` does, and pass the indices on unchanged (sorted or
    grouped as it likes) for the repeated one to stay marked. Loaders over an ``IterableDataset``, or with
    a distributed sampler already, are returned as they are.

    Usage: ``loader = distributed_loader(loader, num_replicas=2, rank=0, seed=0)``.
    """
    batch_sampler = dataloader.batch_sampler
    custom = batch_sampler is not None and type(batch_sampler) is not BatchSampler
    if custom and not hasattr(getattr(batch_sampler, "sampler", None), "__len__"):
        raise ValueError(
            f"The DataLoader uses a custom batch_sampler ({type(batch_sampler).__name__}) without a `.sampler` "
            "attribute holding the sampler (with a length) whose indices it groups into batches, so fabriclite "
            "cannot shard it. Give it one, as torch's BatchSampler has, or shard it yourself and pass "
            "use_distributed_sampler=False."
        )
    sampler = batch_sampler.sampler if custom else dataloader.sampler
    if isinstance(dataloader.dataset, IterableDataset) or isinstance(sampler, DistributedSampler):
        return dataloader
    common = {"num_replicas": num_replicas, "rank": rank, "seed": seed, "drop_last": False}
    new_sampler = _shard_sampler(dataloader.dataset, sampler, common)
    if (
        new_sampler.total_size > new_sampler.real_size
        and dataloader.num_workers > 0
        and not getattr(dataloader, "in_order", True)
    ):
        warnings.warn(
            f"The DataLoader has in_order=False, so fabriclite cannot tell which of its batches holds the "
            f"{new_sampler.total_size - new_sampler.real_size} sample(s) DistributedSampler repeats to even out the "
            f"ranks ({new_sampler.real_size} samples over {num_replicas}); metrics will count them twice. Set "
            "in_order=True, or make the dataset's length a multiple of the number of processes.",
            stacklevel=3,
        )
    if custom:
        new_batch_sampler = copy.copy(batch_sampler)
        new_batch_sampler.sampler = new_sampler
        return _copy(dataloader, sampler=new_sampler, batch_sampler=new_batch_sampler)
    if batch_sampler is not None:
        new_batch_sampler = BatchSampler(new_sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        return _copy(dataloader, sampler=new_sampler, batch_sampler=new_batch_sampler)
    return _copy(dataloader, sampler=new_sampler)


def has_iterable_dataset(dataloader: object) -> bool:
    """Whether ``dataloader`` reads an ``IterableDataset`` (no sampler, no shuffling, its length a guess).

    Usage: ``if has_iterable_dataset(loader): ...``.
    """
    return isinstance(getattr(dataloader, "dataset", None), IterableDataset)


def has_len(dataloader: object) -> bool:
    """Whether ``len(dataloader)`` works; warns (as Lightning) when the length is 0, or comes from an
    ``IterableDataset``, where each worker must be sharded by hand for it to be true.

    Usage: ``steps = len(loader) if has_len(loader) else None``.
    """
    try:
        length = len(dataloader)  # type: ignore[arg-type]
    except (TypeError, NotImplementedError):
        return False
    if length == 0:
        rank_zero_warn(f"`{type(dataloader).__name__}` returned 0 length. Please make sure this was your intention.")
    if has_iterable_dataset(dataloader):
        rank_zero_warn(
            "Your `IterableDataset` has `__len__` defined. With num_workers > 1 it is only right if each worker "
            "reads its own part of the data (torch.utils.data.get_worker_info()), not duplicates."
        )
    return True


def suggested_max_num_workers(local_world_size: int) -> int:
    """The most DataLoader workers each of ``local_world_size`` processes on this machine should start: the CPUs
    this process may run on, shared out, less one for the process itself (at least 1).

    Usage: ``DataLoader(dataset, num_workers=suggested_max_num_workers(devices_per_node))``.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r} should be >= 1 (an int: processes on this machine).")
    try:
        cpus = len(os.sched_getaffinity(0))  # honours taskset and cgroup CPU sets; os.cpu_count() does not
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, cpus // local_world_size - 1)
