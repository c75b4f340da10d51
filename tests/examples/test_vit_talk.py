"""examples/vit/10_talk_vit_b16.py at a tiny size on a CPU: synthetic data and random init (never a download),
one process and two (DDP), compiled, each ending with the series' RESULT line."""

import json
import re

import pytest
from helpers import ROOT, run_python

SCRIPT = ROOT / "examples" / "vit" / "10_talk_vit_b16.py"
TINY = [
    "--synthetic",
    "--image-size",
    "32",
    "--dim",
    "32",
    "--depth",
    "2",
    "--train-size",
    "96",
    "--test-size",
    "40",
    "--batch-size",
    "16",
    "--epochs",
    "2",
    "--workers",
    "0",
    "--precision",
    "32-true",
]


def result_of(stdout):
    return json.loads(stdout.split("RESULT ", 1)[1].splitlines()[0])


def test_the_talk_run_says_loudly_it_has_no_weights_and_no_data_and_reports_its_speed():
    done = run_python(str(SCRIPT), *TINY, "--no-compile", timeout=300)
    assert "RANDOM INITIALISATION" in done.stderr and "SYNTHETIC DATA" in done.stderr
    assert len(re.findall(r"^epoch \d/2 .* test acc \d", done.stdout, re.M)) == 2  # evaluated after each epoch
    record = result_of(done.stdout)
    assert record["script"] == "10_talk_vit_b16" and record["device"] == "CPU"
    assert record["images_per_s"] > 0 and record["seconds"] > 0 and record["peak_memory_mib"] > 0
    assert record["data"] == "synthetic CIFAR-10-shaped" and record["model"].startswith("random init")
    assert "end-to-end wall time" in done.stdout and "training images/s" in done.stdout
    # Timed from the process's start: the setup line counts the imports, which take more than a tenth of a second.
    setup = float(re.search(r"^setup: ([\d.]+) s since the process started", done.stdout, re.M).group(1))
    assert 0.1 < setup <= record["seconds"], done.stdout
    assert "counting FLOPs" not in done.stdout  # worked out from the shapes: no traced pass to time apart
    assert record["train_mfu"] is None and "MFU of that training: n/a" in done.stdout  # a CPU has no peak


def test_the_talk_run_takes_fp8_from_its_command_line():
    pytest.importorskip("torchao", reason="fp8-mixed needs torchao (the dev extra installs it)")
    args = [*TINY[:-1], "fp8-mixed"]
    done = run_python(str(SCRIPT), *args, "--no-compile", timeout=300)
    output = done.stdout + done.stderr
    assert re.search(r"fp8-mixed: [1-9]\d* of \d+ Linear layers run in float8", output), output[-2000:]
    assert "precision fp8-mixed" in done.stdout and result_of(done.stdout)["images_per_s"] > 0


@pytest.mark.timeout(600)
def test_the_talk_run_compiled_evaluates_new_and_partial_batch_sizes_without_recompiling():
    done = run_python(str(SCRIPT), *TINY, "--compile", timeout=540)
    # Test batches of 32 and a partial 8 after training on 16: evaluation after training runs the blocks eagerly,
    # so nothing compiles again.
    recompiles = [int(n) for n in re.findall(r"'recompiles': (\d+)", done.stdout)]
    assert recompiles == [0], done.stdout[-2000:]
    assert "'compiled': 'regional'" in done.stdout
    assert result_of(done.stdout)["test_accuracy"] >= 0


@pytest.mark.timeout(600)
def test_the_talk_run_trains_with_ddp_on_two_processes():
    done = run_python(str(SCRIPT), *TINY, "--no-compile", "--devices", "2", timeout=540)
    assert "devices: 2" in done.stdout
    assert result_of(done.stdout)["test_accuracy"] >= 0


@pytest.mark.parametrize(("option", "value"), [("--devices", "0"), ("--image-size", "40"), ("--epochs", "0")])
def test_bad_options_are_refused_by_name(option, value):
    done = run_python(str(SCRIPT), option, value, check=False, timeout=120)
    assert done.returncode == 2 and option in done.stderr and value in done.stderr
