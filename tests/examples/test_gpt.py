"""examples/gpt/train.py, run as a real process: it learns, logs, samples, resumes bit-exactly after a SIGKILL,
accumulates gradients equivalently to a larger batch, and refuses bad arguments with a clear message."""

import csv
import importlib.util
import re

import pytest
import torch
from helpers import ROOT, run_python, sigkill, start_python

TRAIN = str(ROOT / "examples" / "gpt" / "train.py")
# On the CPU everywhere, so the checks are the same with or without a GPU (and bit-exact where they say so).
CPU = ["--accelerator", "cpu"]
QUIET = [*CPU, "--quick", "--sample-tokens", "0"]  # a tiny model; sampling is checked in the first test


def metrics_rows(out_dir, version=0):
    with open(out_dir / "logs" / f"version_{version}" / "metrics.csv", newline="") as file:
        return list(csv.DictReader(file))


def logged(rows, column):
    """{step: value} for the rows that have ``column``."""
    return {int(row["step"]): float(row[column]) for row in rows if row.get(column)}


def model_weights(out_dir):
    return torch.load(out_dir / "last.ckpt", weights_only=True)["model"]


def test_quick_run_learns_logs_csv_and_tensorboard_and_prints_a_sample(tmp_path):
    out = run_python(TRAIN, *CPU, "--quick", "--out-dir", str(tmp_path), timeout=60).stdout

    first = float(re.search(r"^step +0 \| val loss (\d+\.\d+)$", out, re.MULTILINE).group(1))
    final = float(re.search(r"^final val loss: (\d+\.\d+)$", out, re.MULTILINE).group(1))
    # Untrained, the model is near ln(256) = 5.55 nats per byte; the quick run reaches about 2.4 here.
    assert first > 5.0, out
    assert final < first - 1.5, out
    assert re.search(r"^peak memory: \d+ MiB$", out, re.MULTILINE), out
    assert re.search(r"^time: \d+\.\d s \(training \d+\.\d s\)$", out, re.MULTILINE), out
    sample = out.split("\nsample:\n", 1)[1]
    assert sample.startswith("def ") and len(sample) > 100, out

    rows = metrics_rows(tmp_path)
    assert set(rows[0]) == {"step", "val_loss", "train_loss", "lr", "tokens_per_sec", "grad_norm"}
    val = logged(rows, "val_loss")
    assert sorted(val) == [0, 25, 50, 75, 100]
    assert round(val[100], 4) == final  # the printed and the logged number are the same value
    train = logged(rows, "train_loss")
    assert sorted(train) == list(range(5, 101, 5))
    assert all(logged(rows, "tokens_per_sec")[step] > 0 for step in train)
    # Warmup then cosine: the learning rate rises, peaks at --lr (3e-3 with --quick), and ends at lr / 10.
    lr = logged(rows, "lr")
    assert lr[5] == max(lr.values()) and abs(lr[5] - 3e-3) < 1e-4 and abs(lr[100] - 3e-4) < 1e-9
    if importlib.util.find_spec("tensorboard") is not None:
        assert list(tmp_path.glob("logs/version_0/events.out.tfevents.*"))
    else:
        assert "tensorboard is not installed: logging to CSV only" in out, out
    assert (tmp_path / "logs" / "version_0" / "hparams.yaml").is_file()


def test_a_run_killed_and_resumed_ends_with_the_weights_and_losses_of_an_uninterrupted_run(tmp_path):
    args = [*QUIET, "--max-steps", "40", "--save-every", "10", "--eval-every", "10", "--log-every", "1"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run_python(TRAIN, *args, "--out-dir", str(whole), timeout=60)

    child = start_python(TRAIN, *args, "--out-dir", str(broken))
    try:
        lines = []
        for line in child.stdout:  # SIGKILL right after the first checkpoint, mid-run, as a preemption would
            lines.append(line)
            if "saved" in line:
                break
    finally:
        sigkill(child)
    assert "step    10 | saved" in lines[-1], "".join(lines)

    resumed = run_python(TRAIN, *args, "--out-dir", str(broken), "--resume", timeout=60).stdout
    at = int(re.search(r"^resumed from .* at step (\d+)$", resumed, re.MULTILINE).group(1))
    assert 10 <= at < 40, resumed  # the kill came before the end (normally right after step 10)

    expected, got = model_weights(whole), model_weights(broken)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    # Every loss logged after the resumption is the uninterrupted run's, to the last bit.
    rows_whole, rows_resumed = metrics_rows(whole), metrics_rows(broken, version=1)
    for column in ("train_loss", "val_loss", "lr"):
        after = {step: value for step, value in logged(rows_whole, column).items() if step > at}
        assert logged(rows_resumed, column) == after, column
    assert len(logged(rows_resumed, "train_loss")) == 40 - at


def test_two_micro_batches_of_8_train_like_one_batch_of_16(tmp_path):
    # 32-true: the two runs differ only in the order of float sums, so their weights agree to rounding.
    common = [*QUIET, "--precision", "32-true", "--max-steps", "8", "--log-every", "1", "--eval-every", "8"]
    accumulated = run_python(
        TRAIN, *common, "--batch-size", "8", "--grad-accum", "2", "--out-dir", str(tmp_path / "acc"), timeout=60
    ).stdout
    run_python(TRAIN, *common, "--batch-size", "16", "--out-dir", str(tmp_path / "big"), timeout=60)

    assert "trained 8 optimizer steps of 2 micro-batch(es) each (16 micro-batches of 8x64 bytes" in accumulated
    rows_acc, rows_big = metrics_rows(tmp_path / "acc"), metrics_rows(tmp_path / "big")
    # The logged loss of a step is the mean over its micro-batches: the loss of the 16 windows, not twice it.
    loss_acc, loss_big = logged(rows_acc, "train_loss"), logged(rows_big, "train_loss")
    assert sorted(loss_acc) == list(range(1, 9))
    for step in loss_big:
        assert abs(loss_acc[step] - loss_big[step]) < 1e-5, (step, loss_acc[step], loss_big[step])
    acc, big = model_weights(tmp_path / "acc"), model_weights(tmp_path / "big")
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-5, msg=name)
    # ...and the steps did change the weights: equal because they trained alike, not because neither trained.
    assert loss_acc[8] < loss_acc[1] - 0.5


def test_ddp_on_two_processes_accumulates_without_syncing_every_micro_batch_and_learns(tmp_path):
    out = run_python(
        TRAIN, *QUIET, "--devices", "2", "--strategy", "ddp", "--grad-accum", "2", "--max-steps", "30",
        "--eval-every", "30", "--sample-tokens", "20", "--out-dir", str(tmp_path), timeout=120,
    ).stdout  # fmt: skip
    assert "2 process(es) on cpu" in out and "4096 tokens per step" in out, out
    assert out.count("final val loss") == 1, out  # printed by rank 0 only
    first = float(re.search(r"^step +0 \| val loss (\d+\.\d+)$", out, re.MULTILINE).group(1))
    final = float(re.search(r"^final val loss: (\d+\.\d+)$", out, re.MULTILINE).group(1))
    assert final < first - 1.0, out
    assert "sample:\ndef " in out, out


def test_the_launcher_starts_it_on_two_processes_with_devices_and_precision_left_to_it(tmp_path):
    out = run_python(
        "-m", "fabriclite.cli", "run", "--devices", "2", "--precision", "32-true", TRAIN, *QUIET, "--max-steps", "3",
        "--eval-every", "3", "--out-dir", str(tmp_path), timeout=180,
    ).stdout  # fmt: skip
    assert "2 process(es) on cpu, precision 32-true" in out, out
    assert out.count("final val loss") == 1, out


def test_tensor_parallel_on_two_processes_trains_like_one_process(tmp_path):
    """--tp 2: each block split over 2 ranks (parallel.py), which read the same windows; fp32, so the two runs differ
    only in the order of float sums."""
    common = [*QUIET, "--precision", "32-true", "--max-steps", "6", "--log-every", "1", "--eval-every", "6"]
    out = run_python(
        TRAIN, *common, "--devices", "2", "--tp", "2", "--out-dir", str(tmp_path / "tp"), timeout=240
    ).stdout
    run_python(TRAIN, *common, "--out-dir", str(tmp_path / "one"), timeout=60)

    assert "2 process(es) on cpu" in out and "1024 tokens per step" in out, out
    rows_tp, rows_one = metrics_rows(tmp_path / "tp"), metrics_rows(tmp_path / "one")
    for column in ("train_loss", "val_loss"):
        expected = logged(rows_one, column)
        assert logged(rows_tp, column).keys() == expected.keys()
        for step, value in logged(rows_tp, column).items():
            assert abs(value - expected[step]) < 1e-5, (column, step, value, expected[step])
    assert logged(rows_tp, "train_loss")[6] < logged(rows_tp, "train_loss")[1] - 0.3  # and it did learn


def test_kernels_through_the_triton_interpreter_train_like_torchs_ops(tmp_path):
    """--kernels --fused-loss: Llama-style blocks with RMSNorm, RoPE, SwiGLU and the linear cross-entropy on
    fabriclite's Triton kernels (the interpreter, on CPU), against the same blocks on torch's ops (--llama)."""
    pytest.importorskip("triton", reason="fabriclite's kernels are written in Triton")
    # One 64-byte window per step keeps the interpreter (a Python loop per row) to a few seconds.
    common = [*QUIET, "--max-steps", "2", "--batch-size", "1", "--log-every", "1", "--eval-windows", "1"]
    fused = run_python(TRAIN, *common, "--kernels", "--fused-loss", "--out-dir", str(tmp_path / "fused"), timeout=180,
                       TRITON_INTERPRET="1").stdout  # fmt: skip
    plain = run_python(TRAIN, *common, "--llama", "--out-dir", str(tmp_path / "torch"), timeout=60).stdout

    assert "Llama-style blocks, Triton kernels (RoPE, SwiGLU, norms, linear cross-entropy)" in fused, fused
    assert "Llama-style blocks, torch ops" in plain, plain
    rows_fused, rows_torch = metrics_rows(tmp_path / "fused"), metrics_rows(tmp_path / "torch")
    for column in ("train_loss", "val_loss"):
        expected = logged(rows_torch, column)
        assert logged(rows_fused, column).keys() == expected.keys()
        for step, value in logged(rows_fused, column).items():
            assert abs(value - expected[step]) < 1e-3, (column, step, value, expected[step])


def test_bad_arguments_stop_before_training_with_a_message_naming_them(tmp_path):
    cases = [
        (["--grad-accum", "0"], "argument --grad-accum: must be >= 1, got '0'"),
        (["--text", str(tmp_path / "missing.txt")], f"--text {tmp_path / 'missing.txt'}: no such file"),
        (["--resume", "--out-dir", str(tmp_path)], f"--resume: no checkpoint at {tmp_path / 'last.ckpt'}"),
        (["--tp", "2", "--devices", "3"], "--tp 2 needs --strategy auto (it brings its own), --devices a multiple"),
        (["--hsdp", "2", "--devices", "3"], "--hsdp 2 needs --strategy auto (it brings its own), no --tp, and"),
        (["--devices", "two"], "argument --devices: expected auto or a whole number >= 1, got 'two'"),
        (["--fused-loss"], "--fused-loss is one of the kernels: give it with --kernels."),
    ]
    for args, message in cases:
        result = run_python(TRAIN, *args, timeout=60, check=False)
        assert result.returncode != 0, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "step" not in result.stdout, args


def test_own_text_file_trains_and_samples_from_its_bytes(tmp_path):
    text = tmp_path / "abc.txt"
    text.write_bytes(b"abcabcabc" * 2000)
    out = run_python(
        TRAIN, *CPU, "--quick", "--text", str(text), "--max-steps", "60", "--prompt", "ab", "--out-dir", str(tmp_path),
        timeout=60,
    ).stdout  # fmt: skip
    assert f"on 0.02 MB of {text}" in out, out
    final = float(re.search(r"^final val loss: (\d+\.\d+)$", out, re.MULTILINE).group(1))
    assert final < 0.5, out  # a repeating pattern is easy to predict
    sample = out.split("\nsample:\n", 1)[1]
    assert sample.startswith("ab") and "abcabcabc" in sample[:40], out
