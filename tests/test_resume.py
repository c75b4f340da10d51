"""A run SIGKILLed between checkpoints and resumed, twice, must end bit-identical to a run never interrupted."""

import signal

import pytest
import torch
from helpers import SCRIPTS, run_python, start_python

SCRIPT = str(SCRIPTS / "resumable_train.py")


def run_until_step(args, step, timeout=120):
    """Start the script, read its output until it prints "step {step}", SIGKILL it; return the lines it printed."""
    child = start_python(SCRIPT, *args)
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.strip())
            if line.strip() == f"step {step}":
                child.send_signal(signal.SIGKILL)
                break
        child.wait(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
    assert f"step {step}" in lines, f"the script never reached step {step}: {lines[-5:]}"
    return lines


@pytest.mark.parametrize(("precision", "workers"), [("32-true", 0), ("bf16-mixed", 2), ("16-mixed", 0)])
def test_killed_twice_and_resumed_ends_bit_identical_to_an_uninterrupted_run(tmp_path, precision, workers):
    common = ["--precision", precision, "--num-workers", str(workers)]
    run_python(SCRIPT, "--ckpt", str(tmp_path / "ref.ckpt"), "--out", str(tmp_path / "ref.pt"), *common, timeout=180)

    args = ["--ckpt", str(tmp_path / "run.ckpt"), "--out", str(tmp_path / "run.pt"), "--sleep", "0.05", *common]
    run_until_step(args, 10)  # checkpoint at step 8, inside the first epoch (13 batches)
    second = run_until_step(args, 23)  # resumes at 8; checkpoint at 20, inside the second epoch
    assert [line for line in second if line.startswith("resumed")] == ["resumed at step 8 epoch 0"]
    third = run_python(SCRIPT, *args, timeout=180).stdout.splitlines()
    assert [line for line in third if line.startswith("resumed")] == ["resumed at step 20 epoch 1"]
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
