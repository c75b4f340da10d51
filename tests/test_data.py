"""The wrapped loader: its position (saved mid-epoch, restored in a fresh loader, continuing with the next batch), and
the padding it marks for metrics under several processes."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from fabriclite import Fabric
from fabriclite._padding import current_padding
from fabriclite.data import _FabricDataLoader, distributed_loader
from helpers import SCRIPTS, assert_passed, run_python


def make_loader(**kwargs):
    data = TensorDataset(torch.arange(40).float().unsqueeze(1))
    return DataLoader(data, batch_size=4, **kwargs)


def ids(batches):
    return [(batch[0] if isinstance(batch, list) else batch).flatten().long().tolist() for batch in batches]


def consume(loader, n):
    """Take n batches of the current epoch and keep the iterator open, as a loop body that saves would."""
    it = iter(loader)
    taken = [next(it) for _ in range(n)]
    return it, taken


@pytest.mark.parametrize(
    "kwargs",
    [
        {"shuffle": True},
        {"shuffle": True, "num_workers": 2},
        {"shuffle": True, "generator": torch.Generator().manual_seed(1)},
        {"sampler": RandomSampler(range(40), generator=torch.Generator().manual_seed(2))},
        {"shuffle": False},
    ],
)
def test_a_fresh_loader_restored_mid_epoch_continues_with_the_next_batch(kwargs):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu")
    loader = fabric.setup_dataloaders(make_loader(**kwargs))
    list(loader)  # one full epoch first, so the position is not just "epoch 0"
    it, _ = consume(loader, 3)
    state = loader.state_dict()
    rng = torch.get_rng_state()
    expected = ids(it) + ids(loader)  # rest of this epoch, then the whole next one

    torch.manual_seed(123)  # a different process would have a different random state...
    fresh = Fabric(accelerator="cpu").setup_dataloaders(make_loader(**kwargs))
    fresh.load_state_dict(state)
    torch.set_rng_state(rng)  # ...until fabric.load restores the checkpoint's streams
    assert ids(fresh) + ids(fresh) == expected


def test_restoring_does_not_disturb_the_global_random_state():
    torch.manual_seed(0)
    loader = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    it, _ = consume(loader, 2)
    state = loader.state_dict()
    assert state["in_epoch"]
    fresh = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    fresh.load_state_dict(state)
    before = torch.get_rng_state()
    next(iter(fresh))
    assert torch.equal(torch.get_rng_state(), before)


def test_a_checkpoint_taken_after_a_finished_epoch_starts_a_new_epoch():
    loader = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    list(loader)
    state = loader.state_dict()
    assert state["in_epoch"] is False and state["epochs_started"] == 1
    fresh = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    fresh.load_state_dict(state)
    assert len(list(fresh)) == 10


def test_a_checkpoint_taken_on_the_last_batch_yields_nothing_more_that_epoch():
    loader = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    it, _ = consume(loader, 10)
    state = loader.state_dict()
    assert state["in_epoch"] is True and state["yielded"] == 10
    fresh = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    fresh.load_state_dict(state)
    assert list(fresh) == []
    assert len(list(fresh)) == 10


def test_leaving_the_loop_early_ends_the_epoch():
    loader = Fabric(accelerator="cpu").setup_dataloaders(make_loader(shuffle=True))
    for i, _ in enumerate(loader):
        if i == 2:
            break
    state = loader.state_dict()
    assert state["in_epoch"] is False
    assert len(list(loader)) == 10


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(20).float().unsqueeze(1).split(1))


def test_an_iterable_dataset_resumes_by_skipping_the_used_batches():
    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(Stream(), batch_size=4))
    it, _ = consume(loader, 2)
    state = loader.state_dict()
    expected = ids(it)
    fresh = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(Stream(), batch_size=4))
    fresh.load_state_dict(state)
    assert ids(fresh) == expected == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]


def test_batches_of_dicts_and_tuples_come_through_unchanged():
    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"x": torch.tensor([float(i)]), "meta": (i, "name")}

    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(Pairs(), batch_size=3))
    first = next(iter(loader))
    assert first["x"].flatten().tolist() == [0.0, 1.0, 2.0]
    assert list(first["meta"][1]) == ["name"] * 3


def shard(loader, rank=1):
    """Rank ``rank`` of 2's shard, wrapped as fabric.setup_dataloaders wraps it (no process group needed)."""
    return _FabricDataLoader(distributed_loader(loader, num_replicas=2, rank=rank, seed=0), None)


def marks(batches):
    """Each batch's samples with the padding it marks (None: nothing to drop), read while it is the current one."""
    out = []
    for (values,) in batches:
        padding = current_padding()
        dropped = padding is not None and bool(padding.any())
        out.append((values.long().tolist(), padding.tolist() if dropped else None))
    return out


def test_a_shard_resumed_mid_epoch_marks_the_same_repeated_sample():
    # Rank 1 of 2 over 11 samples draws 1 3 5 7 9, then sample 0 again to match rank 0's six.
    data = TensorDataset(torch.arange(11).float())
    loader = shard(DataLoader(data, batch_size=2))
    assert marks(loader) == [([1, 3], None), ([5, 7], None), ([9, 0], [False, True])]
    it, _ = consume(loader, 1)  # kept open: a save inside the loop
    fresh = shard(DataLoader(data, batch_size=2))
    fresh.load_state_dict(loader.state_dict())
    it.close()
    assert marks(fresh) == [([5, 7], None), ([9, 0], [False, True])]
    assert current_padding() is None


def test_a_shard_without_repeats_marks_nothing():
    assert marks(shard(DataLoader(TensorDataset(torch.arange(11).float()), batch_size=4), rank=0)) == [
        ([0, 2, 4, 6], None),
        ([8, 10], None),
    ]


def test_a_custom_batch_sampler_without_a_sampler_attribute_cannot_be_sharded():
    class Fixed(torch.utils.data.Sampler):
        def __iter__(self):
            return iter([[0, 1], [2]])

    with pytest.raises(ValueError, match=r"custom batch_sampler \(Fixed\) without a `\.sampler`"):
        shard(DataLoader(TensorDataset(torch.arange(3).float()), batch_sampler=Fixed()))


class EpochOrder(torch.utils.data.Sampler):
    """A user's sampler that shuffles by its own generator, seeded by the epoch it is told."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(100 + self.epoch)).tolist())


def test_a_users_sampler_is_sharded_from_its_own_order_and_hears_each_epoch():
    # Without a `generator` attribute there is no telling whether it is random: no warning about seeds.
    data = TensorDataset(torch.arange(10).float())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shards = [shard(DataLoader(data, batch_size=3, sampler=EpochOrder(10)), rank) for rank in (0, 1)]
    for epoch in range(2):
        alone = EpochOrder(10)
        alone.set_epoch(epoch)
        order = list(alone)
        got = [sum(ids(loader), []) for loader in shards]
        assert got == [order[0::2], order[1::2]]


def test_an_unseeded_random_sampler_of_the_users_warns_that_ranks_would_draw_different_orders(monkeypatch):
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    data = TensorDataset(torch.arange(10).float())
    with pytest.warns(UserWarning, match="SubsetRandomSampler is sharded .* no seed was set"):
        shard(DataLoader(data, sampler=torch.utils.data.SubsetRandomSampler(range(6))))
    monkeypatch.setenv("PL_GLOBAL_SEED", "4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shard(DataLoader(data, sampler=torch.utils.data.SubsetRandomSampler(range(6))))


def test_out_of_order_workers_with_a_repeated_sample_warn_that_metrics_count_it_twice():
    loader = DataLoader(TensorDataset(torch.arange(11).float()), batch_size=2, num_workers=1, in_order=False)
    with pytest.warns(UserWarning, match=r"in_order=False.*1 sample\(s\).*count them twice"):
        distributed_loader(loader, num_replicas=2, rank=1, seed=0)


PADDING_CHECKS = [
    "batch_size=None: a repeated item is dropped with all its rows",
    "batch_size=None with a worker process",
    "batches of 3 over 11 samples, shuffled",
    "drop_last counts the samples kept, each once",
    "a custom batch sampler of uneven batches, shuffled",
    "a batch sampler reordering its samples keeps the mark on the repeated one",
    "uneven batches from a worker process, over two epochs after one left early",
    "drop_last on a DistributedSampler counts the samples kept, each once",
]


def test_metrics_under_two_processes_drop_the_repeated_sample_whatever_the_batching():
    output = run_python(str(SCRIPTS / "metric_padding.py"), timeout=300).stdout
    assert_passed(output, PADDING_CHECKS)


def test_under_a_planned_batch_size_loaders_batch_that_many_and_the_scripts_sizes_are_told():
    from fabriclite.data import planned_batch_size

    fabric = Fabric(accelerator="cpu", devices=1)
    data = TensorDataset(torch.arange(100))
    with planned_batch_size(7) as script_sizes:
        batched, unbatched = fabric.setup_dataloaders(DataLoader(data, batch_size=4), DataLoader(data, batch_size=None))
    assert script_sizes == [4, None]
    assert [len(x) for (x,) in batched][:2] == [7, 7] and batched.batch_size == 7
    with planned_batch_size(None) as script_sizes:
        same = fabric.setup_dataloaders(DataLoader(data, batch_size=4))
    assert script_sizes == [4] and len(next(iter(same))[0]) == 4
