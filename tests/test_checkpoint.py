import os
import pickle
import random
import time

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, sigkill, start_python
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError, atomic_save, safe_load


def setup_state(seed=0):
    torch.manual_seed(seed)
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer = fabric.setup(model, optimizer)
    return fabric, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}


def train_step(state):
    state["model"](torch.randn(4, 3)).sum().backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad()
    state["scheduler"].step()
    state["step"] += 1


@pytest.mark.torch_versions
def test_save_and_load_restore_modules_optimizers_schedulers_and_values(tmp_path):
    fabric, state = setup_state(0)
    for _ in range(3):
        train_step(state)
    fabric.save(tmp_path / "c.ckpt", {**state, "extra": "kept"})

    fresh_fabric, fresh = setup_state(1)
    remainder = fresh_fabric.load(tmp_path / "c.ckpt", fresh)
    assert remainder == {"extra": "kept"}
    assert fresh["step"] == 3
    assert torch.equal(fresh["model"].weight, state["model"].weight)
    assert fresh["optimizer"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert fresh["scheduler"].last_epoch == 3
    # Both continue identically from here.
    torch.manual_seed(5)
    train_step(state)
    torch.manual_seed(5)
    train_step(fresh)
    assert torch.equal(fresh["model"].weight, state["model"].weight)


def test_load_restores_the_global_random_streams(tmp_path):
    fabric, state = setup_state()
    fabric.save(tmp_path / "c.ckpt", state)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    fabric.load(tmp_path / "c.ckpt", state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_strict_load_names_the_missing_keys(tmp_path):
    fabric, state = setup_state()
    fabric.save(tmp_path / "c.ckpt", {"model": state["model"]})
    with pytest.raises(KeyError, match="optimizer"):
        fabric.load(tmp_path / "c.ckpt", state)
    remainder = fabric.load(tmp_path / "c.ckpt", state, strict=False)
    assert remainder == {}


def test_load_without_state_returns_the_checkpoint_without_internal_keys(tmp_path):
    fabric, state = setup_state()
    fabric.save(tmp_path / "c.ckpt", state)
    checkpoint = fabric.load(tmp_path / "c.ckpt")
    assert set(checkpoint) == {"model", "optimizer", "scheduler", "step"}
    assert set(checkpoint["model"]) == {"weight", "bias"}


def test_filter_keeps_only_the_chosen_entries(tmp_path):
    fabric, state = setup_state()
    fabric.save(tmp_path / "c.ckpt", {"model": state["model"]}, filter={"model": lambda name, value: "weight" in name})
    assert set(fabric.load(tmp_path / "c.ckpt")["model"]) == {"weight"}
    with pytest.raises(ValueError, match="filter"):
        fabric.save(tmp_path / "c.ckpt", {"model": state["model"]}, filter={"other": lambda n, v: True})


@pytest.mark.torch_versions
def test_load_raw_reads_a_plain_state_dict(tmp_path):
    source = nn.Linear(3, 2)
    torch.save(source.state_dict(), tmp_path / "w.pt")
    fabric = Fabric(accelerator="cpu")
    target = fabric.setup(nn.Linear(3, 2))
    fabric.load_raw(tmp_path / "w.pt", target)
    assert torch.equal(target.weight, source.weight)
    with pytest.raises(TypeError, match="module or an optimizer"):
        fabric.load_raw(tmp_path / "w.pt", {"not": "loadable"})


def test_a_missing_file_gives_one_clear_error_naming_it(tmp_path):
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        fabric.load(tmp_path / "nope.ckpt", {})


@pytest.mark.torch_versions
@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_a_truncated_or_corrupt_file_gives_one_clear_error_naming_it(tmp_path, damage):
    fabric, state = setup_state()
    path = tmp_path / "c.ckpt"
    fabric.save(path, state)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": os.urandom(len(data)), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="c.ckpt"):
        fabric.load(path, state)


class Custom:
    pass


@pytest.mark.torch_versions
def test_weights_only_loading_refuses_arbitrary_objects_unless_trusted(tmp_path):
    torch.save({"obj": Custom()}, tmp_path / "c.ckpt")
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(CheckpointError, match="weights_only=False"):
        fabric.load(tmp_path / "c.ckpt", {"obj": None})
    state = {"obj": None}
    fabric.load(tmp_path / "c.ckpt", state, weights_only=False)
    assert isinstance(state["obj"], Custom)


def test_the_reserved_key_is_refused(tmp_path):
    fabric, _ = setup_state()
    with pytest.raises(ValueError, match="reserved"):
        fabric.save(tmp_path / "c.ckpt", {"__fabriclite__": 1})


def test_save_refuses_a_directory_path(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*is a directory") as caught:
        atomic_save({"a": 1}, tmp_path)
    assert caught.value.reason == "unwritable" and caught.value.path == str(tmp_path)


@pytest.mark.torch_versions
def test_a_failed_save_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "c.ckpt"
    atomic_save({"version": 1}, path)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        atomic_save({"version": 2, "bad": Unpicklable()}, path)
    assert safe_load(path) == {"version": 1}
    assert os.listdir(tmp_path) == ["c.ckpt"]


def test_sigkill_during_save_never_leaves_a_broken_checkpoint(tmp_path):
    """A child saves a ~64 MB checkpoint over and over; we SIGKILL it at varying moments, then load the file."""
    path = tmp_path / "c.ckpt"
    kills_during_write = 0
    for attempt in range(6):
        child = start_python(str(SCRIPTS / "save_forever.py"), str(path))
        try:
            assert child.stdout.readline().strip() == "saved", "the child must finish one save first"
            time.sleep(0.05 + 0.07 * attempt)
            writing = any(name.startswith(".c.ckpt.tmp-") for name in os.listdir(tmp_path))
        finally:
            sigkill(child)
        kills_during_write += writing
        checkpoint = safe_load(path)
        value = checkpoint["version"]
        assert torch.equal(checkpoint["payload"], torch.full_like(checkpoint["payload"], float(value)))
    assert kills_during_write > 0, "no kill landed while a save was being written; the test proved nothing"


def test_loading_into_a_model_of_another_shape_is_a_checkpoint_error_and_a_runtime_error(tmp_path):
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "c.ckpt", {"model": nn.Linear(3, 2)})
    for strict in (True, False):
        with pytest.raises(CheckpointError) as caught:
            fabric.load(tmp_path / "c.ckpt", {"model": nn.Linear(3, 4)}, strict=strict)
        error = caught.value
        assert isinstance(error, RuntimeError) and error.reason == "mismatch" and error.path == str(tmp_path / "c.ckpt")
        assert "weight is [2, 3] in the checkpoint, [4, 3] in the model" in str(error)
        assert "bias is [2] in the checkpoint, [4] in the model" in str(error)
        assert "state['model']" in str(error) and "strict=False" not in str(error)  # strict=False would not help


def test_missing_and_unexpected_parameters_are_listed_with_strict_false_as_the_way_out(tmp_path):
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "c.ckpt", {"model": nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))})
    other = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    with pytest.raises(RuntimeError) as caught:
        fabric.load(tmp_path / "c.ckpt", {"model": other})
    message = str(caught.value)
    assert isinstance(caught.value, CheckpointError) and caught.value.reason == "mismatch"
    assert "missing from the checkpoint: 2.weight, 2.bias" in message
    assert "not in the model: 1.weight, 1.bias" in message and "Pass strict=False" in message
    fabric.load(tmp_path / "c.ckpt", {"model": other}, strict=False)


def test_a_key_the_checkpoint_lacks_is_a_checkpoint_error_and_a_key_error(tmp_path):
    fabric = Fabric(accelerator="cpu")
    fabric.save(tmp_path / "c.ckpt", {"step": 1})
    with pytest.raises(CheckpointError) as caught:
        fabric.load(tmp_path / "c.ckpt", {"step": 0, "epoch": 0})
    error = caught.value
    assert isinstance(error, KeyError) and error.reason == "mismatch"
    assert str(error).startswith("Checkpoint ") and "['epoch']" in str(error)  # not quoted, as KeyError would
    copy = pickle.loads(pickle.dumps(error))  # travels between processes as what it is
    assert type(copy) is type(error) and copy.path == error.path and str(copy) == str(error)


def test_an_optimizer_of_other_parameter_groups_is_a_checkpoint_error_and_a_value_error(tmp_path):
    fabric = Fabric(accelerator="cpu")
    model = nn.Linear(3, 2)
    fabric.save(tmp_path / "c.ckpt", {"optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    other = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(ValueError) as caught:
        fabric.load(tmp_path / "c.ckpt", {"optimizer": other})
    assert isinstance(caught.value, CheckpointError) and "state['optimizer'] (SGD)" in str(caught.value)


def test_load_raw_failures_are_checkpoint_errors_of_torchs_type_too(tmp_path):
    torch.save(nn.Linear(3, 2).state_dict(), tmp_path / "w.pt")
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(RuntimeError) as caught:
        fabric.load_raw(tmp_path / "w.pt", nn.Linear(3, 5))
    assert isinstance(caught.value, CheckpointError) and "[2, 3] in the checkpoint, [5, 3] in the model" in str(
        caught.value
    )
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")  # not a state dict at all
    with pytest.raises(CheckpointError, match="tensor.pt"):
        fabric.load_raw(tmp_path / "tensor.pt", nn.Linear(3, 5))


@pytest.mark.parametrize(
    "content, what",
    [
        (b"collecting data\nstep 10 loss 0.3\n", "a text file of 33 bytes beginning 'collecting data'"),
        (b"epoch 1 loss 0.3\n", "a text file of 17 bytes beginning 'epoch 1 loss 0.3'"),
        (pickle.dumps({"step": 1}), "a pickle file"),
    ],
)
def test_a_file_that_is_no_checkpoint_is_described_without_advice_to_drop_weights_only(tmp_path, content, what):
    path = tmp_path / "train.log"
    path.write_bytes(content)
    fabric = Fabric(accelerator="cpu")
    for weights_only in (True, False):
        with pytest.raises(CheckpointError, match="is not a checkpoint: it is " + what) as caught:
            fabric.load(path, weights_only=weights_only)
        assert caught.value.reason == "not a checkpoint" and "weights_only" not in str(caught.value)
    assert path.read_bytes() == content
