"""Metrics under 2 DDP processes over loaders of several layouts equal what they give over the same samples in one
process: the sampler's repeated sample is dropped whole, whatever the loader's batching. Prints "PASS <rank> <name>".

Usage: ``python metric_padding.py`` (fabric.launch() starts the second process).
"""

import torch
from check_report import report
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, TensorDataset

from fabriclite import Fabric
from fabriclite.metrics import Accuracy, MeanMetric, SumMetric


class PreBatched(Dataset):
    """5 items of 8 rows each (values 0..39), as a loader with batch_size=None reads pre-batched files."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        values = torch.arange(8 * i, 8 * i + 8, dtype=torch.float32)
        return values, (values % 3).long(), torch.full((8,), i % 3)


class Uneven(Sampler):
    """Batches of 1, 2, 3, 1, 2, 3... samples, as a batch sampler grouping by length makes batches of varying size."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        batch, size = [], 1
        for index in self.sampler:
            batch.append(index)
            if len(batch) == size:
                yield batch
                batch, size = [], size % 3 + 1
        if batch:
            yield batch


class LongestFirst(Uneven):
    """Draws all of its samples first, then yields them in batches of 4, largest index first (a bucketing sampler
    reorders the samples it draws)."""

    def __iter__(self):
        order = sorted(self.sampler, reverse=True)
        return (order[i : i + 4] for i in range(0, len(order), 4))


def measure(fabric, loader, epochs=1, abandoned=0):
    """The metrics over ``epochs`` full epochs, after ``abandoned`` epochs left after their first batch."""
    loader = fabric.setup_dataloaders(loader)
    for _ in range(abandoned):
        for _ in loader:
            break
    total, mean, accuracy = SumMetric(), MeanMetric(), Accuracy(task="multiclass", num_classes=3)
    for _ in range(epochs):
        for values, preds, target in loader:
            total.update(values)
            mean.update(values)
            accuracy.update(preds, target)
    return total.compute().item(), mean.compute().item(), accuracy.compute().item()


def expected(loader):
    """The same metrics over the samples the loader yields in one process, each once."""
    batches = list(loader) if isinstance(loader, DataLoader) else [loader[i] for i in range(len(loader))]
    values, preds, target = (torch.cat([batch[k] for batch in batches]) for k in range(3))
    return values.sum().item(), values.mean().item(), (preds == target).float().mean().item()


def close(a, b):
    return all(abs(x - y) < 1e-5 for x, y in zip(a, b))


fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
rank = fabric.global_rank

got = measure(fabric, DataLoader(PreBatched(), batch_size=None))
report(rank, "batch_size=None: a repeated item is dropped with all its rows", close(got, expected(PreBatched())))

got = measure(fabric, DataLoader(PreBatched(), batch_size=None, num_workers=1))
report(rank, "batch_size=None with a worker process", close(got, expected(PreBatched())))

values = torch.arange(11, dtype=torch.float32)
flat = TensorDataset(values, (values % 3).long(), (values % 2).long())
got = measure(fabric, DataLoader(flat, batch_size=3, shuffle=True))
report(rank, "batches of 3 over 11 samples, shuffled", close(got, expected(DataLoader(flat, batch_size=11))))

# drop_last drops each rank's incomplete last batch: rank 0 keeps samples 0 2 4 6, rank 1 keeps 1 3 5 7.
got = measure(fabric, DataLoader(flat, batch_size=4, drop_last=True))
report(
    rank,
    "drop_last counts the samples kept, each once",
    close(got, expected(DataLoader(TensorDataset(*flat[:8]), batch_size=8))),
)

whole = expected(DataLoader(flat, batch_size=11))
got = measure(fabric, DataLoader(flat, batch_sampler=Uneven(RandomSampler(flat))))
report(rank, "a custom batch sampler of uneven batches, shuffled", close(got, whole))

got = measure(fabric, DataLoader(flat, batch_sampler=LongestFirst(RandomSampler(flat))))
report(rank, "a batch sampler reordering its samples keeps the mark on the repeated one", close(got, whole))

# The worker prefetches the indices of batches ahead of those yielded, also of an epoch left after one batch.
uneven = DataLoader(flat, batch_sampler=Uneven(RandomSampler(flat)), num_workers=1, persistent_workers=True)
got = measure(fabric, uneven, epochs=2, abandoned=1)
report(
    rank,
    "uneven batches from a worker process, over two epochs after one left early",
    close(got, (2 * whole[0], whole[1], whole[2])),
)

# The user's own DistributedSampler with drop_last leaves out the last sample instead of repeating one.
sampler = DistributedSampler(flat, num_replicas=2, rank=rank, shuffle=False, drop_last=True)
got = measure(fabric, DataLoader(flat, batch_size=2, sampler=sampler))
report(
    rank,
    "drop_last on a DistributedSampler counts the samples kept, each once",
    close(got, expected(DataLoader(TensorDataset(*flat[:10]), batch_size=10))),
)
print(f"DONE {rank}", flush=True)
