"""An asynchronous save writes the state exactly as it was at the call, however the loop changes it right after."""

import threading
import time

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, assert_passed, run_python
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError


@pytest.fixture
def fabric():
    return Fabric(accelerator="cpu", devices=1)


class Counter:
    """A user object with state_dict whose state_dict hands out its live containers."""

    def __init__(self):
        self.seen = {"steps": [1, 2], "tags": {"a"}}

    def state_dict(self):
        return self.seen

    def load_state_dict(self, state):
        self.seen = state


def setup_training(fabric):
    torch.manual_seed(0)
    # About 32 MB of parameters, so the background copy is still running while the loop goes on.
    model = nn.Sequential(nn.Linear(256, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 2048))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return model, optimizer


def train_step(model, optimizer, fabric):
    loss = model(torch.randn(32, 256)).square().mean()  # in train mode: changes BatchNorm's running statistics
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()


def assert_identical(saved, expected, where="checkpoint"):
    assert type(saved) is type(expected), where
    if isinstance(saved, torch.Tensor):
        assert saved.dtype == expected.dtype and saved.shape == expected.shape, where
        bits = saved.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8)
        assert torch.equal(*bits), f"{where} differs bit for bit"
    elif isinstance(saved, np.ndarray):
        assert np.array_equal(saved, expected), where
    elif isinstance(saved, dict):
        assert list(saved) == list(expected), where
        for key in saved:
            assert_identical(saved[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(expected), where
        for index, (a, b) in enumerate(zip(saved, expected)):
            assert_identical(a, b, f"{where}[{index}]")
    else:
        assert saved == expected, where


def test_an_asynchronous_checkpoint_is_bit_identical_to_a_synchronous_one_while_the_loop_changes_everything(
    fabric, tmp_path
):
    model, optimizer = setup_training(fabric)
    for _ in range(2):
        train_step(model, optimizer, fabric)
    counter = Counter()
    state = {
        "model": model,
        "optimizer": optimizer,
        "counter": counter,
        "ema": torch.ones(1000),
        "array": np.arange(5),
        "history": [0.5, {"best": 1.0}],
        "step": 2,
    }
    fabric.save(tmp_path / "sync.ckpt", state)
    fabric.save(tmp_path / "async.ckpt", state, asynchronous=True)
    # The loop goes on at once: in-place edits, then forward (buffers), backward, step (parameters, optimizer state).
    state["ema"].mul_(3)
    state["array"][0] = 99
    state["history"][1]["best"] = 0.0
    state["history"].append(7)
    counter.seen["steps"].append(3)
    counter.seen["tags"].add("b")
    for _ in range(3):
        train_step(model, optimizer, fabric)
    fabric.load_latest(tmp_path / "none-here", {})  # waits for the write

    expected = fabric.load(tmp_path / "sync.ckpt", weights_only=False)
    saved = fabric.load(tmp_path / "async.ckpt", weights_only=False)
    assert_identical(saved, expected)
    assert saved["counter"] == {"steps": [1, 2], "tags": {"a"}} and saved["array"].tolist() == [0, 1, 2, 3, 4]
    # The loop did change what the checkpoint holds: the comparison above could have failed.
    assert not torch.equal(expected["model"]["0.weight"], model.module[0].weight.detach())
    assert not torch.equal(expected["model"]["1.running_mean"], model.module[1].running_mean)


def test_loading_into_the_same_objects_right_after_an_asynchronous_save_does_not_change_what_it_writes(
    fabric, tmp_path
):
    model, optimizer = setup_training(fabric)
    train_step(model, optimizer, fabric)
    state = {"model": model, "optimizer": optimizer}
    fabric.save(tmp_path / "sync.ckpt", state)
    before = fabric.load(tmp_path / "sync.ckpt")
    train_step(model, optimizer, fabric)
    fabric.save(tmp_path / "later.ckpt", state)
    fabric.load(tmp_path / "sync.ckpt", state)  # back to the first step's state
    fabric.save(tmp_path / "async.ckpt", state, asynchronous=True)
    fabric.load(tmp_path / "later.ckpt", state)  # loads into the parameters the background copy reads
    fabric.load_latest(tmp_path / "none-here", {})
    assert_identical(fabric.load(tmp_path / "async.ckpt")["model"], before["model"])
    assert_identical(fabric.load(tmp_path / "async.ckpt")["optimizer"], before["optimizer"])


def test_a_parameter_changed_in_place_before_the_next_step_fails_that_save_and_writes_nothing(fabric, tmp_path):
    model, optimizer = setup_training(fabric)
    train_step(model, optimizer, fabric)
    state = {"model": model, "optimizer": optimizer}
    fabric.save(tmp_path / "step-1.ckpt", state, asynchronous=True)
    train_step(model, optimizer, fabric)
    fabric.save(tmp_path / "step-2.ckpt", state, asynchronous=True)
    with torch.no_grad():
        model.module[3].weight.clamp_(-0.01, 0.01)  # not the optimizer's step: the copy may have read half of it
    train_step(model, optimizer, fabric)
    with pytest.raises(CheckpointError, match=r"state\['model'\]\['3.weight'\] changed in place") as raised:
        fabric.save(tmp_path / "step-3.ckpt", state, asynchronous=True)
    assert raised.value.reason == "changed"
    fabric.load_latest(tmp_path / "none-here", {})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1.ckpt"]


def test_changes_after_the_optimizer_step_are_not_mistaken_for_changes_during_the_copy(fabric, tmp_path):
    model, optimizer = setup_training(fabric)
    state = {"model": model, "optimizer": optimizer}
    fabric.save(tmp_path / "step-1.ckpt", state, asynchronous=True)
    train_step(model, optimizer, fabric)  # the step waits for the copy and checks it
    with torch.no_grad():
        model.module[3].weight.clamp_(-0.01, 0.01)
    fabric.save(tmp_path / "step-2.ckpt", state, asynchronous=True)
    fabric.load_latest(tmp_path / "none-here", {})
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1.ckpt", "step-2.ckpt"]


def test_an_evaluation_after_an_asynchronous_save_lets_its_write_begin_without_another_step(fabric, tmp_path):
    model, optimizer = setup_training(fabric)
    forward = model._fabric_forward
    path = tmp_path / "step-1.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer}, asynchronous=True)
    model.eval()
    deadline = time.monotonic() + 120
    with torch.no_grad():
        while not path.exists() and time.monotonic() < deadline:  # only forward runs: no step, save or load
            model(torch.randn(4, 256))
            time.sleep(0.01)
    assert path.exists()
    assert model._fabric_forward == forward  # the forward is the plain one again once the copy is checked
    fabric.load_latest(tmp_path, {"model": model})


def test_a_value_that_cannot_be_copied_is_refused_at_the_call_naming_its_key(fabric, tmp_path):
    with pytest.raises(TypeError, match=r"state\['handle'\] \(lock\) cannot be copied"):
        fabric.save(tmp_path / "step-1.ckpt", {"step": 1, "handle": threading.Lock()}, asynchronous=True)
    fabric.save(tmp_path / "step-2.ckpt", {"step": 2}, asynchronous=True)  # nothing left behind
    assert fabric.load_latest(tmp_path, {"step": 0}) == tmp_path / "step-2.ckpt"


def test_on_two_ranks_the_asynchronous_checkpoint_is_the_synchronous_one_and_a_change_fails_on_every_rank(tmp_path):
    """DDP over gloo: only rank 0 copies and writes, while both ranks go on training at once."""
    result = run_python(str(SCRIPTS / "async_save_exact.py"), str(tmp_path), "ddp", timeout=240)
    assert_passed(
        result.stdout,
        [
            "asynchronous equals synchronous bit for bit",
            "a change before the step fails the save on every rank",
            "nothing written for the changed save",
        ],
    )


def test_under_fsdp_with_full_checkpoints_the_asynchronous_checkpoint_is_the_synchronous_one(tmp_path):
    """The sharded tensors are gathered at the call (a collective on both ranks), then copied in the background."""
    result = run_python(str(SCRIPTS / "async_save_exact.py"), str(tmp_path), "fsdp", timeout=240)
    assert_passed(result.stdout, ["asynchronous equals synchronous bit for bit"])
