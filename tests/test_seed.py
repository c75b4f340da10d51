"""Seeding DataLoader workers after seed_everything(workers=True): per worker and per rank, reproducibly, with the
seeds Lightning derives."""

import random
from functools import partial
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric, seed_everything
from fabriclite.seed import pl_worker_init_function, reset_seed, worker_init_function
from helpers import SCRIPTS, run_python


class Draws(Dataset):
    """Each item is what the worker's three generators draw next."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return torch.tensor([torch.rand(1).item(), random.random(), float(np.random.rand())])


def worker_draws(seed, rank=0, workers=True):
    seed_everything(seed, workers=workers, verbose=False)
    loader = DataLoader(Draws(), batch_size=1, num_workers=2)  # items 0, 2 from worker 0; 1, 3 from worker 1
    if rank == 0:
        loader = Fabric(accelerator="cpu").setup_dataloaders(loader)
    else:  # what setup_dataloaders does on another rank
        loader.worker_init_fn = worker_init_function(loader.worker_init_fn, rank)
    return torch.cat(list(loader))


def test_setup_dataloaders_installs_the_seeding_function_and_runs_repeat():
    seed_everything(7, workers=True, verbose=False)
    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(Draws(), num_workers=2))
    assert loader.worker_init_fn.func is pl_worker_init_function and loader.worker_init_fn.keywords == {"rank": 0}
    draws = worker_draws(7)
    assert not torch.equal(draws[0], draws[1])  # two workers
    assert torch.equal(worker_draws(7), draws)  # the same seed draws the same numbers again
    assert not torch.equal(worker_draws(8), draws)


def test_ranks_draw_different_numbers_in_their_workers():
    assert not torch.equal(worker_draws(7, rank=0)[:, 1:], worker_draws(7, rank=1)[:, 1:])


def test_without_workers_true_or_with_a_users_function_nothing_is_installed():
    seed_everything(3, workers=False, verbose=False)
    assert worker_init_function(None, 0) is None
    seed_everything(3, workers=True, verbose=False)
    mine = print
    assert worker_init_function(mine, 0) is mine
    installed = worker_init_function(None, 2)
    assert isinstance(installed, partial) and installed.func is pl_worker_init_function and installed.keywords == {
        "rank": 2
    }


def test_reset_seed_seeds_again_from_the_exported_seed():
    seed_everything(11, verbose=False)
    first = torch.rand(2)
    torch.rand(5)
    reset_seed()
    assert torch.equal(torch.rand(2), first)


@pytest.mark.parametrize("package", ["lightning"])
def test_worker_seeds_equal_lightnings(package):
    if find_spec(package) is None:  # not imported here: importing Lightning patches torch.compile process-wide
        pytest.skip(f"{package} is not installed (the 'lightning' extra)")
    out = run_python(str(SCRIPTS / "worker_seeds.py"), package, timeout=120).stdout
    assert "PASS 0 the same seeds as Lightning's" in out, out
