"""fabric.load_latest resumes from the newest complete checkpoint of a folder, and keep_last keeps the K newest."""

import errno
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import SCRIPTS, assert_passed, python_env, run_python

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError, TorchCheckpointIO


@pytest.fixture
def fabric():
    return Fabric(accelerator="cpu", devices=1)


def names(folder):
    return sorted(path.name for path in folder.iterdir())


def save_steps(fabric, folder, steps, **kwargs):
    for step in steps:
        fabric.save(folder / f"step-{step}.ckpt", {"step": step, "weight": torch.full((4,), float(step))}, **kwargs)


def test_load_latest_returns_none_and_leaves_state_alone_on_a_fresh_start(fabric, tmp_path):
    state = {"step": 0}
    assert fabric.load_latest(tmp_path / "not-yet", state) is None
    assert fabric.load_latest(tmp_path, state) is None
    assert state == {"step": 0}


def test_load_latest_loads_the_newest_checkpoint_and_returns_its_path(fabric, tmp_path):
    save_steps(fabric, tmp_path, [1, 2, 3])
    (tmp_path / "notes.txt").write_text("a newer file that is not a checkpoint\n")
    state = {"step": 0, "weight": None}
    assert fabric.load_latest(tmp_path, state) == tmp_path / "step-3.ckpt"
    assert state["step"] == 3 and torch.equal(state["weight"], torch.full((4,), 3.0))


def test_a_newer_checkpoint_with_the_same_time_is_told_apart_by_the_number_in_its_name(fabric, tmp_path):
    save_steps(fabric, tmp_path, [9, 10])
    same = time.time_ns()
    for step in (9, 10):
        os.utime(tmp_path / f"step-{step}.ckpt", ns=(same, same))
    assert fabric.load_latest(tmp_path, {"step": 0}) == tmp_path / "step-10.ckpt"


def test_newest_is_the_last_saved_whatever_the_files_modification_times_say(fabric, tmp_path):
    # A requeue onto a host whose clock is ahead, or a folder copied without keeping times, reorders the mtimes.
    save_steps(fabric, tmp_path, [1, 2, 3])
    later = time.time_ns() + 3600 * 10**9
    os.utime(tmp_path / "step-1.ckpt", ns=(later, later))
    copy = tmp_path / "copied"
    copy.mkdir()
    for step in (3, 2, 1):  # copied newest first: the oldest checkpoint gets the newest time
        (copy / f"step-{step}.ckpt").write_bytes((tmp_path / f"step-{step}.ckpt").read_bytes())
        time.sleep(0.01)
    for folder in (tmp_path, copy):
        assert fabric.load_latest(folder, {"step": 0}) == folder / "step-3.ckpt"
    save_steps(fabric, copy, [4], keep_last=2)  # and keep_last removes the older, not the newer
    assert names(copy) == ["step-3.ckpt", "step-4.ckpt"]


def test_a_model_only_best_checkpoint_or_a_foreign_file_is_never_taken_for_the_newest(fabric, tmp_path, capfd):
    model = fabric.setup(torch.nn.Linear(4, 4))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    for step in (10, 20):
        state["step"] = step
        fabric.save(tmp_path / f"step-{step:06d}.ckpt", state, keep_last=3)
    fabric.save(tmp_path / "best.ckpt", {"model": model})  # docs/long-runs.md's keep_last example
    torch.save({"x": 1}, tmp_path / "other.pt")
    resumed = {"model": model, "optimizer": optimizer, "step": 0}
    assert Fabric(accelerator="cpu", devices=1).load_latest(tmp_path, resumed) == tmp_path / "step-000020.ckpt"
    assert resumed["step"] == 20
    assert "passes over" in capfd.readouterr().err  # best.ckpt lacks 'optimizer' and 'step': said, not loaded


def test_keep_last_never_removes_another_runs_checkpoints_in_a_shared_folder(tmp_path):
    seed1, seed2 = Fabric(accelerator="cpu", devices=1), Fabric(accelerator="cpu", devices=1)  # two runs
    for step in (10, 20):
        seed1.save(tmp_path / f"seed1-step-{step:06d}.ckpt", {"step": step}, keep_last=1)
    seed2.save(tmp_path / "seed2-step-000010.ckpt", {"step": 10}, keep_last=1)
    assert names(tmp_path) == ["seed1-step-000020.ckpt", "seed2-step-000010.ckpt"]


def test_a_resumed_run_goes_on_with_its_series_and_keep_last_removes_its_older_checkpoints(fabric, tmp_path):
    save_steps(fabric, tmp_path, [1, 2, 3], keep_last=2)
    restarted = Fabric(accelerator="cpu", devices=1)  # a new process after a requeue, in effect
    state = {"step": 0, "weight": None}
    assert restarted.load_latest(tmp_path, state) == tmp_path / "step-3.ckpt"
    save_steps(restarted, tmp_path, [4], keep_last=2)
    assert names(tmp_path) == ["step-3.ckpt", "step-4.ckpt"]
    assert Fabric(accelerator="cpu", devices=1).load_latest(tmp_path, state) == tmp_path / "step-4.ckpt"


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_a_damaged_newest_checkpoint_is_named_set_aside_and_the_one_before_resumed(fabric, tmp_path, capfd, damage):
    save_steps(fabric, tmp_path, [1, 2, 3])
    bad = tmp_path / "step-3.ckpt"
    data = bytearray(bad.read_bytes())
    if damage == "truncated":  # cut while copying: the zip directory at the end is gone
        data = data[: len(data) // 2]
    else:
        data[len(data) // 3] ^= 0xFF  # inside a record: only its checksum shows it
    bad.write_bytes(bytes(data))
    state = {"step": 0, "weight": None}
    assert fabric.load_latest(tmp_path, state) == tmp_path / "step-2.ckpt"
    assert state["step"] == 2
    err = capfd.readouterr().err
    assert f"fabriclite: load_latest: {str(bad)!r} is damaged, set aside as 'step-3.ckpt.damaged': " in err, err
    assert ("truncated" if damage == "truncated" else "corrupt") in err
    assert (tmp_path / "step-3.ckpt.damaged").read_bytes() == bytes(data)  # renamed, never deleted
    save_steps(fabric, tmp_path, [3], keep_last=2)  # the run goes on and saves under that name again
    assert names(tmp_path) == ["step-2.ckpt", "step-3.ckpt", "step-3.ckpt.damaged"]
    assert fabric.load_latest(tmp_path, state) == bad and capfd.readouterr().err == ""


def test_a_damaged_checkpoint_set_aside_twice_keeps_both_copies(fabric, tmp_path, capfd):
    for _ in range(2):
        save_steps(fabric, tmp_path, [1, 2])
        data = (tmp_path / "step-2.ckpt").read_bytes()
        (tmp_path / "step-2.ckpt").write_bytes(data[: len(data) // 2])
        assert fabric.load_latest(tmp_path, {"step": 0, "weight": None}) == tmp_path / "step-1.ckpt"
    assert names(tmp_path) == ["step-1.ckpt", "step-2.ckpt.damaged", "step-2.ckpt.damaged-2"]


def test_a_cut_file_that_fabric_save_did_not_write_is_left_alone(fabric, tmp_path):
    save_steps(fabric, tmp_path, [1])
    torch.save({"weights": torch.ones(1000)}, tmp_path / "other.pt")
    (tmp_path / "other.pt").write_bytes((tmp_path / "other.pt").read_bytes()[:2000])
    assert fabric.load_latest(tmp_path, {"step": 0, "weight": None}) == tmp_path / "step-1.ckpt"
    assert names(tmp_path) == ["other.pt", "step-1.ckpt"]


def test_a_sharded_checkpoint_missing_a_shard_is_set_aside_and_the_one_before_resumed(fabric, tmp_path, capfd):
    # One FSDP process writes two sharded checkpoints (a process group of its own, so in a child process).
    writer = (
        "import sys, torch\n"
        "from fabriclite import Fabric\n"
        "from fabriclite.strategies import FSDPStrategy\n"
        "fabric = Fabric(accelerator='cpu', devices=1, strategy=FSDPStrategy(state_dict_type='sharded'))\n"
        "fabric.launch()\n"
        "model = fabric.setup(torch.nn.Linear(4, 4))\n"
        "for step in (1, 2):\n"
        "    fabric.save(f'{sys.argv[1]}/step-{step}.ckpt', {'model': model, 'step': step})\n"
    )
    run_python("-c", writer, str(tmp_path), timeout=180)
    shards = list((tmp_path / "step-2.ckpt").glob("*.distcp"))
    assert shards
    shards[0].unlink()
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    assert fabric.load_latest(tmp_path, state) == tmp_path / "step-1.ckpt"
    assert state["step"] == 1
    err = capfd.readouterr().err
    assert f"{str(tmp_path / 'step-2.ckpt')!r} is damaged, set aside as 'step-2.ckpt.damaged': " in err, err
    assert "'__0_0.distcp', listed in its manifest.json, is missing" in err
    assert names(tmp_path) == ["step-1.ckpt", "step-2.ckpt.damaged"]


def test_load_latest_refuses_a_file_for_a_folder(fabric, tmp_path):
    (tmp_path / "log.txt").write_text("epoch 1\n")
    with pytest.raises(ValueError, match="expects a folder of checkpoints.*log.txt.*a text file"):
        fabric.load_latest(tmp_path / "log.txt", {})


@pytest.mark.parametrize("asynchronous", [False, True])
def test_keep_last_keeps_exactly_k_complete_checkpoints_and_nothing_else_is_touched(fabric, tmp_path, asynchronous):
    fabric.save(tmp_path / "best.ckpt", {"step": 0})  # named otherwise: not in the series
    (tmp_path / "step-0.ckpt").write_text("the user's notes, named like a checkpoint\n")
    (tmp_path / "step-log.txt").write_text("a log\n")
    save_steps(fabric, tmp_path, range(1, 7), keep_last=2, asynchronous=asynchronous)
    fabric.load_latest(tmp_path, {"step": 0})  # waits for the last asynchronous write
    assert names(tmp_path) == ["best.ckpt", "step-0.ckpt", "step-5.ckpt", "step-6.ckpt", "step-log.txt"]


def test_keep_last_does_not_count_a_damaged_checkpoint(fabric, tmp_path):
    save_steps(fabric, tmp_path, [1, 2])
    data = bytearray((tmp_path / "step-2.ckpt").read_bytes())
    data[len(data) // 3] ^= 0xFF
    (tmp_path / "step-2.ckpt").write_bytes(bytes(data))
    save_steps(fabric, tmp_path, [3], keep_last=2)
    assert names(tmp_path) == ["step-1.ckpt", "step-2.ckpt", "step-3.ckpt"]  # 1 and 3 are the two complete ones
    save_steps(fabric, tmp_path, [4], keep_last=2)
    assert names(tmp_path) == ["step-3.ckpt", "step-4.ckpt"]


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True, "2"])
def test_keep_last_must_be_a_positive_whole_number(fabric, tmp_path, keep_last):
    with pytest.raises(ValueError, match=f"keep_last={keep_last!r} must be a whole number"):
        fabric.save(tmp_path / "step-1.ckpt", {"step": 1}, keep_last=keep_last)
    assert names(tmp_path) == []


def partials(folder):
    return [name for name in os.listdir(folder) if name.startswith(".step-")]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_save_killed_mid_write_is_never_returned(fabric, tmp_path, asynchronous):
    """A real SIGKILL lands while a 64 MB checkpoint is being written (asynchronously: in the background thread)."""
    killed_mid_write = 0
    for attempt in range(3):
        folder = tmp_path / str(attempt)
        args = [str(SCRIPTS / "save_steps.py"), str(folder)] + (["--asynchronous"] if asynchronous else [])
        child = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, env=python_env())
        try:
            # Asynchronously, save 2 returns once save 1 is written (it waits for it).
            assert child.stdout.readline().strip() == "saved 1"
            if asynchronous:
                assert child.stdout.readline().strip() == "saved 2"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not any(
                (folder / name).stat().st_size > 1 << 20 for name in partials(folder) if (folder / name).exists()
            ):
                time.sleep(0.001)
        finally:
            child.kill()
            child.wait(timeout=60)
        killed_mid_write += bool(partials(folder))
        state = {"step": 0, "payload": None}
        path = fabric.load_latest(folder, state)
        assert path == folder / f"step-{state['step']}.ckpt"
        assert state["step"] >= 1 and torch.all(state["payload"] == state["step"]), "a snapshot was not taken"
    assert killed_mid_write >= 1, "no kill landed mid-write; the test proved nothing"


class FullDiskIO(TorchCheckpointIO):
    """Writes like the default until the disk is full (the error a full disk gives, raised where it would be)."""

    full = False

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


def test_an_asynchronous_save_that_fails_raises_at_the_next_save_and_leaves_the_previous_newest(tmp_path):
    io = FullDiskIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    fabric.save(tmp_path / "step-1.ckpt", {"step": 1}, asynchronous=True)
    assert fabric.load_latest(tmp_path, {"step": 0}) == tmp_path / "step-1.ckpt"  # waits for the write
    io.full = True
    fabric.save(tmp_path / "step-2.ckpt", {"step": 2}, asynchronous=True)  # returns before the write fails
    with pytest.raises(CheckpointError, match="step-2.ckpt"):
        fabric.save(tmp_path / "step-3.ckpt", {"step": 3})
    assert names(tmp_path) == ["step-1.ckpt"]
    io.full = False
    assert fabric.load_latest(tmp_path, {"step": 0}) == tmp_path / "step-1.ckpt"


def test_asynchronous_save_refuses_to_replace_a_users_file_at_once(fabric, tmp_path):
    (tmp_path / "step-1.ckpt").write_text("not a checkpoint\n")
    with pytest.raises(CheckpointError, match="Will not save"):
        fabric.save(tmp_path / "step-1.ckpt", {"step": 1}, asynchronous=True)
    fabric.save(tmp_path / "step-2.ckpt", {"step": 2}, asynchronous=True)  # no earlier failure left behind
    assert (tmp_path / "step-1.ckpt").read_text() == "not a checkpoint\n"


def test_on_two_ranks_an_asynchronous_failure_or_refusal_raises_on_every_rank(tmp_path):
    """Only rank 0 writes; its failed write, its refusal to replace a user's file, and state it cannot stage raise on
    rank 1 as well (staging failures at that very call)."""
    result = run_python(str(SCRIPTS / "async_save_ranks.py"), str(tmp_path), timeout=180)
    assert_passed(
        result.stdout,
        [
            "failed write raises on every rank",
            "occupied target refused on every rank",
            "a staging failure on rank 0 alone raises on every rank",
            "a value rank 0 cannot copy raises on every rank",
            "newest agreed after failures",
        ],
    )


def test_an_asynchronous_save_at_the_end_of_a_script_is_finished_before_it_exits(fabric, tmp_path):
    """Python stops thread pools (the checksums use one) before it joins threads: the write must end first."""
    path = tmp_path / "step-1.ckpt"
    code = (
        "import torch; from fabriclite import Fabric; "
        f"Fabric(accelerator='cpu', devices=1).save({str(path)!r}, {{'w': torch.ones(16 * 2**20)}}, asynchronous=True)"
    )
    run_python("-c", code, timeout=120)
    state = {"w": None}
    assert fabric.load_latest(tmp_path, state) == path
    assert torch.all(state["w"] == 1)
