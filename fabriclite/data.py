"""The wrapped data loader: yields exactly the batches of the user's loader, moved to the device, and keeps its
position (epoch, batches already yielded, the random state its shuffling started from) so that a run resumed
from a checkpoint continues with the very next batch. Also each rank's shard of a loader under a distributed
strategy (``distributed_loader``), marking the samples repeated to even out the ranks.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
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
from fabriclite.checkpoint import capture_rng_state, restore_rng_state
from fabriclite.seed import worker_init_function


def _loader_generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The torch generators a loader's shuffling may draw from, by where they sit (shared ones named once)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for where, owner in (
        ("loader", loader),
        ("sampler", getattr(loader, "sampler", None)),
        ("batch_sampler", getattr(loader, "batch_sampler", None)),
        ("batch_sampler.sampler", getattr(getattr(loader, "batch_sampler", None), "sampler", None)),
    ):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[where] = generator
    return found


def _capture_loader_rng(loader: DataLoader) -> dict[str, Any]:
    return {
        "global": capture_rng_state(),
        "generators": {where: g.get_state() for where, g in _loader_generators(loader).items()},
    }


def _restore_loader_rng(loader: DataLoader, state: dict[str, Any]) -> None:
    restore_rng_state(state["global"])
    generators = _loader_generators(loader)
    for where, value in state["generators"].items():
        if where in generators:
            generators[where].set_state(value)


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
        if self._resume_from is not None:
            skip, rng = self._resume_from
            self._resume_from = None
            batches = self._resumed_iterator(skip, rng)
        else:
            self._epochs_started += 1
            self._set_sampler_epoch()
            self._epoch_rng = _capture_loader_rng(self._loader)
            batches = iter(self._loader)
            skip = 0
        self._yielded = skip
        self._in_epoch = True
        device = self._device
        padded = self._padding_source()
        try:
            for batch in batches:
                if padded is not None:
                    self._mark_padding(padded, batch)
                # Counted before the body of the user's loop runs, so a save inside it records this batch as used.
                self._yielded += 1
                yield batch if device is None else move_to_device(batch, device)
            self._in_epoch = False
        except GeneratorExit:  # the user left the loop early: the next iteration is a new epoch, as in the raw loop
            self._in_epoch = False
            raise
        finally:
            if padded is not None:
                set_padding(None)

    def _padding_source(self) -> Any:
        """The distributed sampler when this rank's shard has repeated samples, else None (nothing to mark)."""
        sampler = getattr(self._loader, "sampler", None)
        if not callable(getattr(sampler, "padding_mask", None)) or sampler.total_size == sampler.real_size:
            return None
        return sampler

    def _mark_padding(self, sampler: Any, batch: Any) -> None:
        # Tell metrics which rows of this batch repeat samples that another rank also sees (fabriclite._padding).
        # Padding is a property of the sampler's samples: batch k of a BatchSampler holds samples k*B .. k*B+B-1
        # (the last one fewer, drop_last drops it whole); without one (batch_size=None) each sample is a batch of
        # its own, so all of its rows share that sample's mark.
        rows = _batch_rows(batch)
        if rows is None:
            return
        if self._loader.batch_size is None:
            set_padding(sampler.padding_mask(self._yielded, 1).expand(rows))
        else:
            set_padding(sampler.padding_mask(self._yielded * self._loader.batch_size, rows))

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
        _restore_loader_rng(self._loader, epoch_rng)
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
        raise ValueError("This DataLoader was already set up by fabric.setup_dataloaders; pass it only once.")
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"fabric.setup_dataloaders expects torch.utils.data.DataLoader objects, got {type(loader).__name__}."
        )
    loader = strategy.process_dataloader(loader, use_distributed_sampler)
    loader.worker_init_fn = worker_init_function(loader.worker_init_fn, strategy.global_rank)
    return _FabricDataLoader(loader, device)


class FabricDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can say which of this rank's samples are padding (repeated to even out ranks),
    so metrics can drop them. Over a user's own sampler, it shards that sampler's indices, drawn anew each epoch.

    Usage: made by ``fabric.setup_dataloaders``; ``sampler.padding_mask(start, count)``.
    """

    def __init__(self, dataset: Any, source: Sampler | None = None, **kwargs: Any) -> None:
        self.source = source
        super().__init__(dataset if source is None else range(len(source)), **kwargs)
        self.real_size = len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        if self.source is None:
            return super().__iter__()
        # Every rank must draw the same order from the user's sampler, whatever its global random state: draw it
        # from a generator seeded by (seed, epoch), leaving the global stream untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            drawn = list(self.source)
        return (drawn[i] for i in super().__iter__())

    def padding_mask(self, start: int, count: int) -> torch.Tensor:
        """True for this rank's samples ``start .. start+count-1`` that are repeats of other samples."""
        positions = self.rank + self.num_replicas * torch.arange(start, start + count)
        return positions >= self.real_size


def distributed_loader(dataloader: DataLoader, num_replicas: int, rank: int, seed: int) -> DataLoader:
    """This rank's shard of ``dataloader``: a copy with a ``FabricDistributedSampler``, keeping shuffle and seed.
    Loaders over an ``IterableDataset``, or with a distributed sampler already, are returned as they are.

    Usage: ``loader = distributed_loader(loader, num_replicas=2, rank=0, seed=0)``.
    """
    sampler = dataloader.sampler
    if isinstance(dataloader.dataset, IterableDataset) or isinstance(sampler, DistributedSampler):
        return dataloader
    common = {"num_replicas": num_replicas, "rank": rank, "seed": seed, "drop_last": False}
    if type(sampler) in (RandomSampler, SequentialSampler) and getattr(sampler, "generator", None) is None:
        new_sampler = FabricDistributedSampler(dataloader.dataset, shuffle=isinstance(sampler, RandomSampler), **common)
    else:
        new_sampler = FabricDistributedSampler(dataloader.dataset, source=sampler, shuffle=False, **common)
    sharded = copy.copy(dataloader)
    object.__setattr__(sharded, "_iterator", None)
    object.__setattr__(sharded, "sampler", new_sampler)
    batch_sampler = dataloader.batch_sampler
    if batch_sampler is not None:
        if type(batch_sampler) is not BatchSampler:
            raise ValueError(
                f"The DataLoader uses a custom batch_sampler ({type(batch_sampler).__name__}), which fabriclite "
                "cannot shard. Shard it yourself and pass use_distributed_sampler=False."
            )
        object.__setattr__(
            sharded, "batch_sampler", BatchSampler(new_sampler, batch_sampler.batch_size, batch_sampler.drop_last)
        )
    return sharded
