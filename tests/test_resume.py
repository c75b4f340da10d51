"""A run SIGKILLed between checkpoints and resumed, twice, must end bit-identical to a run never interrupted."""

import pytest
import torch
from helpers import SCRIPTS, run_python, sigkill, start_python

SCRIPT = str(SCRIPTS / "resumable_train.py")


def run_until_step(args, step):
    """Start the script, read its output until it prints "step {step}", SIGKILL it; return the lines it printed."""
    child = start_python(SCRIPT, *args)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if line.strip() == f"step {step}":
                break
    finally:
        sigkill(child)
    assert f"step {step}" in lines, f"the script never reached step {step}: {lines[-5:]}"
    return lines


# (precision, loader workers, processes, [(kill at step, expected resume line)]). One process sees 13 batches
# per epoch, two see 7 each; every kill lands after a checkpoint taken inside an epoch.
CASES = [
    ("32-true", 0, 1, [(10, "resumed at step 8 epoch 0"), (23, "resumed at step 20 epoch 1")]),
    ("bf16-mixed", 2, 1, [(10, "resumed at step 8 epoch 0"), (23, "resumed at step 20 epoch 1")]),
    ("16-mixed", 0, 1, [(10, "resumed at step 8 epoch 0"), (23, "resumed at step 20 epoch 1")]),
    ("32-true", 0, 2, [(10, "resumed at step 8 epoch 1"), (18, "resumed at step 16 epoch 2")]),
]


@pytest.mark.parametrize(("precision", "workers", "devices", "kills"), CASES)
def test_killed_twice_and_resumed_ends_bit_identical_to_an_uninterrupted_run(
    tmp_path, precision, workers, devices, kills
):
    common = ["--precision", precision, "--num-workers", str(workers), "--devices", str(devices)]
    run_python(SCRIPT, "--ckpt", str(tmp_path / "ref.ckpt"), "--out", str(tmp_path / "ref.pt"), *common, timeout=180)

    args = ["--ckpt", str(tmp_path / "run.ckpt"), "--out", str(tmp_path / "run.pt"), "--sleep", "0.05", *common]
    (first_kill, _), (second_kill, first_resume) = kills[0], kills[1]
    run_until_step(args, first_kill)
    second = run_until_step(args, second_kill)
    assert [line for line in second if line.startswith("resumed")] == [kills[0][1]]
    third = run_python(SCRIPT, *args, timeout=180).stdout.splitlines()
    assert [line for line in third if line.startswith("resumed")] == [first_resume]
    assert third[-1] == "done"

    reference, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "run.pt")
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), f"{key} differs after resuming"


def test_a_resume_without_the_loader_position_is_detected(tmp_path):
    """Guards the test above: restarting from scratch after a kill (no checkpoint) differs from resuming."""
    run_python(SCRIPT, "--ckpt", str(tmp_path / "ref.ckpt"), "--out", str(tmp_path / "ref.pt"), "--epochs", "2")
    run_python(SCRIPT, "--ckpt", str(tmp_path / "other.ckpt"), "--out", str(tmp_path / "other.pt"), "--epochs", "3")
    reference, other = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "other.pt")
    assert not all(torch.equal(reference[k], other[k]) for k in reference)
