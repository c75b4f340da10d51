"""Errors user code catches: each mistake raises Lightning Fabric's exception type, and its message contains Lightning's
phrase (its own tests match them with ``re.search``), so ``except`` clauses and ``pytest.raises(match=...)`` written for
Lightning keep working; fabriclite's message may say more. Each case runs against lightning.fabric too where it is
installed, so the table states Lightning's behaviour, not a guess."""

import importlib
from importlib.util import find_spec

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

IMPLEMENTATIONS = ["fabriclite"] + (["lightning.fabric"] if find_spec("lightning") else [])


class Net(nn.Linear):
    def __init__(self):
        super().__init__(2, 2)


def plain_function(x):
    return x


def takes_no_argument():
    pass


def fabric_of(root, **options):
    return importlib.import_module(root).Fabric(**{"accelerator": "cpu", "devices": 1, **options})


def spawning(root):
    return fabric_of(root, devices=2, strategy="ddp_spawn")


def setup_twice(root):
    fabric = fabric_of(root)
    fabric.setup(fabric.setup(Net()))


def setup_module_twice(root):
    fabric = fabric_of(root)
    fabric.setup_module(fabric.setup_module(Net()))


def optimizer_twice(root):
    fabric = fabric_of(root)
    net = Net()
    _, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    fabric.setup_optimizers(optimizer)


def dataloader_twice(root):
    fabric = fabric_of(root)
    fabric.setup_dataloaders(fabric.setup_dataloaders(DataLoader(range(4))))


def mark_plain_function(root):
    fabric_of(root).setup(Net()).mark_forward_method(plain_function)


def mark_missing_method(root):
    fabric_of(root).setup(Net()).mark_forward_method("missing")


def delete_missing_key(root):
    state = importlib.import_module(f"{root}.utilities.data").AttributeDict(lr=0.1)
    del state.missing


def read_missing_key(root):
    importlib.import_module(f"{root}.utilities.data").AttributeDict(lr=0.1).missing  # noqa: B018


def throughput(root, *updates):
    meter = importlib.import_module(f"{root}.utilities.throughput").Throughput(window_size=2)
    for update in updates:
        meter.update(**update)


CASES = {
    "setting a model up twice": (setup_twice, ValueError, "A model should be passed only once to the"),
    "setup_module twice": (setup_module_twice, ValueError, "A model should be passed only once to the"),
    "an optimizer twice": (optimizer_twice, ValueError, "An optimizer should be passed only once to the"),
    "a dataloader twice": (dataloader_twice, ValueError, "A dataloader should be passed only once to the"),
    "setup_dataloaders() with nothing": (
        lambda root: fabric_of(root).setup_dataloaders(),
        ValueError,
        "`setup_dataloaders` requires at least one dataloader",
    ),
    "setup_optimizers() with nothing": (
        lambda root: fabric_of(root).setup_optimizers(),
        ValueError,
        "`setup_optimizers` requires at least one optimizer",
    ),
    "setup_dataloaders with a list": (
        lambda root: fabric_of(root).setup_dataloaders([1, 2]),
        TypeError,
        "Only PyTorch DataLoader are currently supported",
    ),
    "mark_forward_method with a plain function": (mark_plain_function, TypeError, "Expected a method or a string"),
    "mark_forward_method of a missing method": (
        mark_missing_method,
        AttributeError,
        "`Net.missing` does not exist or is not a method",
    ),
    "del state.missing": (delete_missing_key, KeyError, "missing"),
    "state.missing": (read_missing_key, AttributeError, "has no attribute 'missing'"),
    "suggested_max_num_workers(0)": (
        lambda root: importlib.import_module(f"{root}.utilities.data").suggested_max_num_workers(0),
        ValueError,
        "should be >= 1",
    ),
    "suggested_max_num_workers(-1)": (
        lambda root: importlib.import_module(f"{root}.utilities.data").suggested_max_num_workers(-1),
        ValueError,
        "should be >= 1",
    ),
    "Throughput: time that does not grow": (
        lambda root: throughput(root, {"time": 2, "batches": 1, "samples": 2}, {"time": 2, "batches": 3, "samples": 2}),
        ValueError,
        "Expected the value to increase",
    ),
    "Throughput: fewer samples than batches": (
        lambda root: throughput(root, {"time": 0, "batches": 2, "samples": 1}),
        ValueError,
        r"samples.*to be greater or equal than batches",
    ),
    "Throughput: fewer lengths than samples": (
        lambda root: throughput(root, {"time": 0, "batches": 2, "samples": 2, "lengths": 1}),
        ValueError,
        r"lengths.*to be greater or equal than samples",
    ),
    "Throughput: lengths passed after updates without": (
        lambda root: throughput(
            root, {"time": 2.0, "batches": 1, "samples": 2}, {"time": 2.1, "batches": 2, "samples": 3, "lengths": 4}
        ),
        RuntimeError,
        "same number of samples",
    ),
    "launch(train(fabric)): the function's result instead of the function": (
        lambda root: fabric_of(root).launch(None),
        TypeError,
        r"needs to be a callable, but got None",
    ),
    "launch(a function taking no argument)": (
        lambda root: fabric_of(root).launch(takes_no_argument),
        TypeError,
        "needs to take at least one argument",
    ),
    "launch(a function taking no argument) under ddp_spawn": (
        lambda root: spawning(root).launch(takes_no_argument),
        TypeError,
        "needs to take at least one argument",
    ),
    "launch() under ddp_spawn": (
        lambda root: spawning(root).launch(),
        TypeError,
        r"launch\(\)` needs to be called with a function",
    ),
}


@pytest.mark.parametrize("root", IMPLEMENTATIONS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_raises_lightnings_type_with_lightnings_phrase(case, root):
    action, error, phrase = CASES[case]
    with pytest.raises(error, match=phrase) as raised:
        action(root)
    assert type(raised.value) is error or root != "fabriclite"  # not a subclass that other except clauses miss


def test_a_launch_that_cannot_run_is_refused_before_any_process_starts():
    import multiprocessing

    fabric = spawning("fabriclite")
    for function in (None, takes_no_argument, 3):
        with pytest.raises(TypeError, match=repr(function) if function == 3 else "launch"):
            fabric.launch(function)
    assert multiprocessing.active_children() == [] and not fabric._launched
