"""seed_everything and reset_seed, and the seeding of DataLoader workers after seed_everything(workers=True): each
worker of each rank draws numbers of its own, the same ones again for the same seed, and the ones Lightning's
pl_worker_init_function gives them."""

import json
import logging
import os
import pickle
import random
import warnings
from functools import partial
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from fabriclite import Fabric, seed_everything
from fabriclite.seed import pl_worker_init_function, reset_seed, worker_init_function
from helpers import run_python

_SEED_VARIABLES = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def restore_seed_state():
    """Each test starts with no exported seed; the variables and generators it changes are put back afterwards, so
    PL_SEED_WORKERS=1 never reaches another test's loaders."""
    saved = {name: os.environ.pop(name, None) for name in _SEED_VARIABLES}
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


class WorkerDraws(Dataset):
    """Item i: the worker that made it, the seed the DataLoader gave that worker, and one draw each from torch,
    random and NumPy."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        info = get_worker_info()
        return info.id, info.seed, (torch.rand(1).item(), random.random(), float(np.random.rand()))


def first_draws(seed, rank, workers=True):
    """``[(worker_id, worker_seed, draws)]`` for the first item of each of the two workers of a loader set up on
    global rank ``rank``, as fabric.setup_dataloaders sets it up."""
    seed_everything(seed, workers=workers, verbose=False)
    loader = DataLoader(WorkerDraws(), batch_size=None, num_workers=2)
    loader.worker_init_fn = worker_init_function(loader.worker_init_fn, rank)
    items = list(loader)  # in order: items 0 and 2 come from worker 0, items 1 and 3 from worker 1
    assert [item[0] for item in items] == [0, 1, 0, 1]
    return [(worker_id, worker_seed, tuple(draws)) for worker_id, worker_seed, draws in items[:2]]


def draws_after_our_init(worker_seed, worker_id, rank):
    """What a worker draws first after the DataLoader's seeding and pl_worker_init_function, in this process."""
    torch.manual_seed(worker_seed)  # what the DataLoader does in the worker before its worker_init_fn
    pl_worker_init_function(worker_id, rank=rank)
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def lightnings_documented_draws(worker_seed, worker_id, rank):
    """The first torch, random and NumPy draws of a worker seeded by Lightning's pl_worker_init_function (2.6.1 on),
    written out from its algorithm: base = the worker's seed minus its id; base << 32 | worker_id << 16 | rank is
    mixed by MurmurHash3's 64-bit finalizer and then stepped through Knuth's MMIX linear congruential generator;
    step 1 seeds torch, steps 2 and 3 (high and low 64 bits) seed random; NumPy gets 4 words of
    SeedSequence([base, worker_id, rank])."""
    base = worker_seed - worker_id
    mask = 2**64 - 1

    def fmix64(x):
        x ^= x >> 33
        x = (x * 0xFF51AFD7ED558CCD) & mask
        x ^= x >> 33
        x = (x * 0xC4CEB9FE1A85EC53) & mask
        return x ^ (x >> 33)

    state, steps = fmix64((base << 32) | (worker_id << 16) | rank), []
    for _ in range(3):
        state = (6364136223846793005 * state + 1) & mask
        steps.append(state)
    numpy_seed = np.random.SeedSequence([base, worker_id, rank]).generate_state(4)
    return (
        torch.rand(1, generator=torch.Generator().manual_seed(steps[0])).item(),
        random.Random((steps[1] << 32) | steps[2]).random(),
        float(np.random.RandomState(numpy_seed).rand()),
    )


# (worker_seed, worker_id, rank) beyond what a loader happens to give: the smallest base seed, the largest seeds.
EDGE_CASES = [(0, 0, 0), (1, 1, 0), (2**63 - 1, 0, 1), (2**63 + 2, 3, 7), (123456789, 7, 15)]


def test_each_worker_draws_its_own_numbers_and_the_same_again_for_the_same_seed():
    (_, _, worker_0), (_, _, worker_1) = first_draws(7, rank=0)
    assert all(a != b for a, b in zip(worker_0, worker_1))
    assert first_draws(7, rank=0) == first_draws(7, rank=0)
    assert all(a != b for a, b in zip(worker_0, first_draws(8, rank=0)[0][2]))


def test_ranks_draw_different_numbers_where_without_workers_true_they_draw_the_same():
    # Every rank seeds the same: its loaders give workers the same seeds, and only the rank can tell them apart.
    assert first_draws(7, rank=0, workers=False) == first_draws(7, rank=1, workers=False)
    on_rank_0, on_rank_1 = first_draws(7, rank=0), first_draws(7, rank=1)
    for (_, seed_0, draws_0), (_, seed_1, draws_1) in zip(on_rank_0, on_rank_1):
        assert seed_0 == seed_1 and all(a != b for a, b in zip(draws_0, draws_1))


def test_workers_draw_what_lightnings_documented_derivation_gives(monkeypatch):
    for rank in (0, 5):
        for worker_id, worker_seed, draws in first_draws(3, rank):
            assert draws == lightnings_documented_draws(worker_seed, worker_id, rank)
    for case in EDGE_CASES:
        assert draws_after_our_init(*case) == lightnings_documented_draws(*case)
    monkeypatch.setenv("RANK", "3")  # without a rank argument, the process's own
    torch.manual_seed(1000)
    pl_worker_init_function(1)
    assert (torch.rand(1).item(), random.random(), float(np.random.rand())) == lightnings_documented_draws(1000, 1, 3)


# In its own process: importing Lightning replaces torch.compile process-wide.
_LIGHTNINGS_DRAWS = """
import json, random, sys
import numpy as np, torch
from lightning.fabric.utilities.seed import pl_worker_init_function
draws = []
for worker_seed, worker_id, rank in json.loads(sys.argv[1]):
    torch.manual_seed(worker_seed)
    pl_worker_init_function(worker_id, rank=rank)
    draws.append([torch.rand(1).item(), random.random(), float(np.random.rand())])
print(json.dumps(draws))
"""


def test_workers_draw_what_lightnings_own_function_gives():
    if find_spec("lightning") is None:
        pytest.skip("lightning is not installed; the documented derivation is checked without it")
    cases, ours = [], []
    for rank in (0, 5):
        for worker_id, worker_seed, draws in first_draws(3, rank):
            cases.append((worker_seed, worker_id, rank))
            ours.append(draws)
    for case in EDGE_CASES:
        cases.append(case)
        ours.append(draws_after_our_init(*case))
    out = run_python("-c", _LIGHTNINGS_DRAWS, json.dumps(cases), timeout=120).stdout
    assert [tuple(draws) for draws in json.loads(out.strip().splitlines()[-1])] == ours


def test_setup_dataloaders_gives_a_loader_without_its_own_function_the_seeding_one():
    seed_everything(7, workers=True, verbose=False)
    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(WorkerDraws(), batch_size=None, num_workers=2))
    assert (loader.worker_init_fn.func, loader.worker_init_fn.keywords) == (pl_worker_init_function, {"rank": 0})
    assert [(worker_id, seed, tuple(draws)) for worker_id, seed, draws in list(loader)[:2]] == first_draws(7, rank=0)


def test_the_installed_function_is_bound_to_the_rank_and_pickles_for_worker_processes():
    seed_everything(3, workers=True, verbose=False)
    installed = worker_init_function(None, 2)
    assert isinstance(installed, partial)
    assert (installed.func, installed.args, installed.keywords) == (pl_worker_init_function, (), {"rank": 2})
    copy = pickle.loads(pickle.dumps(installed))
    assert (copy.func, copy.keywords) == (pl_worker_init_function, {"rank": 2})


def test_nothing_is_installed_without_workers_true_nor_over_the_loaders_own_function():
    assert worker_init_function(None, 0) is None  # seed_everything never called
    seed_everything(3, workers=False, verbose=False)
    assert worker_init_function(None, 0) is None
    seed_everything(3, workers=True, verbose=False)

    def users_own(worker_id):
        pass

    assert worker_init_function(users_own, 0) is users_own


def test_reset_seed_seeds_again_with_the_exported_seed_and_workers_choice():
    reset_seed()  # nothing exported: nothing happens
    assert "PL_GLOBAL_SEED" not in os.environ
    seed_everything(11, workers=True, verbose=False)
    first = torch.rand(2), random.random(), np.random.rand()
    reset_seed()
    again = torch.rand(2), random.random(), np.random.rand()
    assert torch.equal(again[0], first[0]) and again[1:] == first[1:]
    assert os.environ["PL_SEED_WORKERS"] == "1"


def test_seed_set_names_the_rank_only_when_several_processes_log_it(monkeypatch, caplog):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.INFO, logger="fabriclite.utilities.seed"):
        seed_everything(5)
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        seed_everything(5)
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert records == [
        ("fabriclite.utilities.seed", logging.INFO, "Seed set to 5"),
        ("fabriclite.utilities.seed", logging.INFO, "[rank: 1] Seed set to 5"),
    ]


_SEED_SET = "from fabriclite import seed_everything\nimport logging, sys\n{}\nseed_everything(5)\n"


def test_seed_set_reaches_stderr_without_logging_configured_and_the_applications_handlers_once_configured():
    quiet = run_python("-c", _SEED_SET.format(""), timeout=120)
    assert quiet.stderr == "Seed set to 5\n"
    configured = "logging.basicConfig(stream=sys.stdout, format='%(name)s %(levelname)s %(message)s')"
    loud = run_python("-c", _SEED_SET.format(configured), timeout=120)
    assert (loud.stdout, loud.stderr) == ("fabriclite.utilities.seed INFO Seed set to 5\n", "")


def test_fabric_seed_everything_seeds_the_loader_workers_unless_told_not_to():
    assert Fabric.seed_everything(7, verbose=False) == 7
    assert os.environ["PL_SEED_WORKERS"] == "1"
    loader = Fabric(accelerator="cpu").setup_dataloaders(DataLoader(WorkerDraws(), batch_size=None, num_workers=2))
    (_, _, worker_0), (_, _, worker_1) = [item for item in list(loader)[:2]]
    assert all(a != b for a, b in zip(worker_0, worker_1))  # NumPy too: without the seeding its draws repeat
    Fabric.seed_everything(7, workers=False, verbose=False)
    assert os.environ["PL_SEED_WORKERS"] == "0"
    seed_everything(7, verbose=False)  # the function keeps Lightning's default, False
    assert os.environ["PL_SEED_WORKERS"] == "0"


@pytest.mark.parametrize("seed", [np.int64(3), np.uint32(3), 3.7, "3", torch.tensor(3)])
def test_a_seed_int_takes_is_converted_as_lightning_does(seed):
    assert seed_everything(seed, verbose=False) == 3
    assert os.environ["PL_GLOBAL_SEED"] == "3" and torch.initial_seed() == 3


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [
        (2**32, ValueError, "seed=4294967296 is not in bounds: NumPy accepts seeds from 0 to 4294967295"),
        (-1, ValueError, "seed=-1 is not in bounds"),
        (10e9, ValueError, "seed=10000000000 is not in bounds"),
        ("forty-two", ValueError, "seed='forty-two' is not valid: expected an int between 0 and 4294967295"),
        ([3], TypeError, "seed=\\[3\\] is not valid"),
        (True, ValueError, "seed=True is not valid: .*workers=True"),
    ],
)
def test_an_invalid_seed_raises_lightnings_error_type_naming_the_value(seed, error, match):
    with pytest.raises(error, match=match):
        seed_everything(seed, verbose=False)


def test_an_invalid_seed_in_the_environment_is_named_with_its_variable(monkeypatch):
    monkeypatch.setenv("PL_GLOBAL_SEED", "invalid")
    with pytest.raises(ValueError, match="Invalid seed specified via PL_GLOBAL_SEED: 'invalid'"):
        seed_everything()


def test_no_seed_anywhere_warns_and_uses_0_unless_quiet():
    with pytest.warns(UserWarning, match="No seed found, seed set to 0"):
        assert seed_everything() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert seed_everything() == 0  # exported now: found in the environment
        os.environ.pop("PL_GLOBAL_SEED")
        assert seed_everything(verbose=False) == 0


# Run under either implementation, in a process of its own (importing Lightning patches torch.compile).
_SEEDING = """
import json, logging, os, sys, warnings
import numpy as np
if sys.argv[1] == "lightning":
    from lightning.fabric import Fabric, seed_everything
else:
    from fabriclite import Fabric, seed_everything
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger(sys.argv[1].replace("lightning", "lightning.fabric") + ".utilities.seed").addHandler(handler)
result = {"converted": [seed_everything(s) for s in (np.int64(3), 3.7, "3")], "logged": records[:1]}
for bad in (2**32, -1, "forty-two", [3]):
    try:
        seed_everything(bad)
    except Exception as error:
        result.setdefault("errors", []).append([type(error).__name__, "is not in bounds" in str(error)])
os.environ.pop("PL_GLOBAL_SEED")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    seed_everything()
result["no seed"] = [str(w.message) for w in caught]
Fabric.seed_everything(5)
result["workers"] = os.environ["PL_SEED_WORKERS"]
print(json.dumps(result))
"""


@pytest.mark.parametrize("implementation", ["fabriclite", "lightning"])
def test_seeding_converts_refuses_logs_warns_and_seeds_workers_as_lightning_does(implementation):
    if implementation == "lightning" and find_spec("lightning") is None:
        pytest.skip("lightning is not installed; the fabriclite run states the same expectations")
    out = run_python("-c", _SEEDING, implementation, timeout=180).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        "converted": [3, 3, 3],
        "logged": ["Seed set to 3"],
        "errors": [["ValueError", True], ["ValueError", True], ["ValueError", False], ["TypeError", False]],
        "no seed": ["No seed found, seed set to 0"],
        "workers": "1",
    }


def test_seed_everything_exports_lightnings_two_variables_and_nothing_else(monkeypatch):
    before = dict(os.environ)
    seed_everything(7, workers=True, verbose=False)
    added = {name: value for name, value in os.environ.items() if before.get(name) != value}
    assert added == {"PL_GLOBAL_SEED": "7", "PL_SEED_WORKERS": "1"}
