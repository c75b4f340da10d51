"""An asynchronous save writes the state exactly as it was at the call, however the loop changes it right after."""

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import SCRIPTS, assert_passed, run_python, start_python
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError, TorchCheckpointIO


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


def test_changes_right_after_the_call_by_any_means_never_reach_the_checkpoint(fabric, tmp_path):
    # In place outside the optimizer, through .data (no version counter moves), and a fused step outside the wrapper.
    model, optimizer = setup_training(fabric)
    train_step(model, optimizer, fabric)
    state = {"model": model, "optimizer": optimizer}
    fabric.save(tmp_path / "sync.ckpt", state)
    fabric.save(tmp_path / "async.ckpt", state, asynchronous=True)
    with torch.no_grad():
        model.module[3].weight.clamp_(-0.01, 0.01)
    model.module[0].weight.data.mul_(0)  # weight clipping, masks, an EMA, a re-init: often written so
    optimizer.state[model.module[3].bias]["exp_avg"].data.add_(1)
    fabric.load_latest(tmp_path / "none-here", {})  # waits for the write
    assert_identical(fabric.load(tmp_path / "async.ckpt"), fabric.load(tmp_path / "sync.ckpt"))
    assert not torch.equal(fabric.load(tmp_path / "sync.ckpt")["model"]["0.weight"], model.module[0].weight.detach())


def test_tied_weights_are_written_once_and_load_tied_as_in_a_synchronous_save(fabric, tmp_path):
    torch.manual_seed(0)
    embedding, head = nn.Embedding(512, 256), nn.Linear(256, 512, bias=False)
    head.weight = embedding.weight
    model = fabric.setup(nn.Sequential(embedding, nn.Linear(256, 256), head))
    fabric.save(tmp_path / "sync.ckpt", {"model": model})
    fabric.save(tmp_path / "async.ckpt", {"model": model}, asynchronous=True)
    fabric.load_latest(tmp_path / "none-here", {})
    saved = torch.load(tmp_path / "async.ckpt", weights_only=True)["model"]
    assert saved["0.weight"].untyped_storage().data_ptr() == saved["2.weight"].untyped_storage().data_ptr()
    assert (tmp_path / "async.ckpt").stat().st_size == (tmp_path / "sync.ckpt").stat().st_size
    assert_identical(fabric.load(tmp_path / "async.ckpt"), fabric.load(tmp_path / "sync.ckpt"))


def test_host_memory_holds_one_copy_of_the_state_however_many_checkpoint_names_are_saved(fabric, tmp_path):
    model, optimizer = setup_training(fabric)
    state = {"model": model, "optimizer": optimizer}
    for step in range(1, 4):
        train_step(model, optimizer, fabric)
        for name in (f"step-{step}", "best", "last", f"epoch-{step}-of-9"):
            fabric.save(tmp_path / f"{name}.ckpt", state, asynchronous=True)
    fabric.load_latest(tmp_path / "none-here", {})
    tensors = [*model.state_dict().values(), *(t for s in optimizer.state.values() for t in s.values())]
    state_bytes = sum(t.untyped_storage().nbytes() for t in tensors)
    # The checkpointer's host buffers (private: no public way to see them), plus the random streams' few bytes.
    held = sum(buffer.nbytes for buffer in fabric._checkpointer._buffers.values())
    assert state_bytes <= held < state_bytes + 2**20


class FailingIO(TorchCheckpointIO):
    """A plugin whose writes fail with its own error for a path named step-2.ckpt."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if Path(path).name == "step-2.ckpt":
            raise ConnectionError("the object store refused the upload")
        super().save_checkpoint(checkpoint, path, storage_options)


def test_a_failed_background_write_keeps_its_cause_and_the_call_that_reports_it_says_it_did_not_save(tmp_path):
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FailingIO()])
    state = {"weight": torch.ones(4)}
    fabric.save(tmp_path / "step-1.ckpt", state, asynchronous=True)
    fabric.save(tmp_path / "step-2.ckpt", state, asynchronous=True)
    with pytest.raises(CheckpointError, match="step-2.ckpt") as raised:
        fabric.save(tmp_path / "step-3.ckpt", state, asynchronous=True)
    message = str(raised.value)
    assert "the save of" in message and "step-3.ckpt" in message and "did not happen either" in message
    assert "no partial file was left" not in message  # a plugin's writer promises nothing of the kind
    causes = []
    error = raised.value
    while error is not None:
        causes.append(error)
        error = error.__cause__
    assert any(isinstance(cause, ConnectionError) for cause in causes), causes
    assert any(cause.__traceback__ is not None and isinstance(cause, ConnectionError) for cause in causes)
    fabric.save(tmp_path / "step-3.ckpt", state, asynchronous=True)  # the next call saves again
    assert fabric.load_latest(tmp_path, {"weight": torch.zeros(4)}) == tmp_path / "step-3.ckpt"
    assert not (tmp_path / "step-2.ckpt").exists()


def test_a_keep_last_that_fails_leaves_the_saved_checkpoint_saved_and_says_so(fabric, tmp_path, capfd, monkeypatch):
    # Mock: this runs as root here, which no permission stops, so removing the old checkpoint is made to fail.
    def refuse(path):
        raise PermissionError(13, "Permission denied", str(path))

    state = {"weight": torch.ones(4)}
    fabric.save(tmp_path / "step-1.ckpt", state)
    monkeypatch.setattr(sys.modules["fabriclite.checkpoint.latest"], "remove", refuse)  # the module, not the function
    fabric.save(tmp_path / "step-2.ckpt", state, keep_last=1)  # synchronous: returns
    fabric.save(tmp_path / "step-3.ckpt", state, keep_last=1, asynchronous=True)
    assert fabric.load_latest(tmp_path, {"weight": torch.zeros(4)}) == tmp_path / "step-3.ckpt"  # no error
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-1.ckpt", "step-2.ckpt", "step-3.ckpt"]
    err = capfd.readouterr().err
    assert "'step-2.ckpt' is saved, but removing the checkpoints beyond keep_last=1" in err.replace(
        str(tmp_path) + "/", ""
    )
    assert "'step-3.ckpt' is saved, but removing" in err.replace(str(tmp_path) + "/", "")


def test_a_script_ending_right_after_an_asynchronous_save_exits_cleanly_with_the_checkpoint_written(tmp_path):
    # The writer was a daemon thread, still inside torch's C++ code when the interpreter shut down: 4 runs in 10 of
    # this script aborted ("terminate called without an active exception", exit 134). Six runs, two at a time.
    folders = [tmp_path / str(run) for run in range(6)]
    for pair in (folders[0::2], folders[1::2]):
        children = []
        for folder in pair:
            folder.mkdir()
            children.append(start_python(str(SCRIPTS / "async_save_at_exit.py"), str(folder)))
        for child in children:
            output, _ = child.communicate(timeout=240)
            assert child.returncode == 0, output[-2000:]
    fabric = Fabric(accelerator="cpu", devices=1)
    for folder in folders:
        assert sorted(path.name for path in folder.iterdir()) == ["step-7.ckpt", "step-8.ckpt"]
        assert fabric.load_latest(folder, {"step": 0}) == folder / "step-8.ckpt"


def test_a_value_that_cannot_be_copied_is_refused_at_the_call_naming_its_key(fabric, tmp_path):
    with pytest.raises(TypeError, match=r"state\['handle'\] \(lock\) cannot be copied"):
        fabric.save(tmp_path / "step-1.ckpt", {"step": 1, "handle": threading.Lock()}, asynchronous=True)
    fabric.save(tmp_path / "step-2.ckpt", {"step": 2}, asynchronous=True)  # nothing left behind
    assert fabric.load_latest(tmp_path, {"step": 0}) == tmp_path / "step-2.ckpt"


def test_every_piece_of_the_copy_lands_once_and_a_piece_that_fails_on_any_thread_is_reported():
    from concurrent.futures import ThreadPoolExecutor

    from fabriclite.checkpoint.staging import Copies

    sources = [torch.full((1000,), float(k)) for k in range(40)]
    hosts = [torch.zeros(1000) for _ in sources]
    with ThreadPoolExecutor(2) as helpers:
        copies = Copies(zip(hosts, sources))
        copies.helpers = [helpers.submit(copies.take) for _ in range(2)]
        copies.finish()  # the loop's thread takes what is left, then waits for the helpers
        assert all(torch.equal(host, source) for host, source in zip(hosts, sources))
        bad = Copies([(torch.zeros(3), torch.ones(5))] + list(zip(hosts, sources)))
        bad.helpers = [helpers.submit(bad.take) for _ in range(2)]
        with pytest.raises(RuntimeError):
            bad.finish()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "fsdp-sharded"])
def test_on_two_ranks_the_asynchronous_checkpoint_is_the_synchronous_one_whatever_the_loop_does_after(
    tmp_path, strategy
):
    """DDP and FSDP full (rank 0 writes one file) and FSDP sharded (every rank writes its shards in the background,
    on a process group of its own, while the loop's collectives go on), with a tied weight and `.data` changes."""
    result = run_python(str(SCRIPTS / "async_save_exact.py"), str(tmp_path), strategy, timeout=240)
    checks = ["asynchronous equals synchronous bit for bit"]
    assert_passed(result.stdout, checks if strategy == "fsdp-sharded" else [*checks, "the tied weight is written once"])
