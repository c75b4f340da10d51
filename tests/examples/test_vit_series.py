"""The numbered ViT scripts (examples/vit/00-09): the three-line promise, and every script running end to end."""

import ast
import difflib
import json
import re

import pytest
from helpers import ROOT, run_python

VIT = ROOT / "examples" / "vit"


def code_lines(name):
    """The script's lines after its module docstring, which rightly differs from script to script."""
    source = (VIT / name).read_text()
    docstring_end = ast.parse(source).body[0].end_lineno
    return [line.rstrip() for line in source.splitlines()[docstring_end:]]


# What 03 may add to 01: the import, the constructor and launch, setup and setup_dataloaders, backward,
# fabric.print, and fabric.device where 01 passes its own device.
FABRIC_LINE = re.compile(
    r"^\s*(from fabriclite import Fabric"
    r"|fabric = Fabric\(.*\)"
    r"|fabric\.launch\(\)"
    r"|model, optimizer = fabric\.setup\(model, optimizer\)"
    r"|[\w, ]+ = fabric\.setup_dataloaders\(.*\)"
    r"|fabric\.backward\(loss\)"
    r"|fabric\.print\(.*\)"
    r"|.*\bfabric\.device\b.*)$"
)


def test_the_fabric_script_differs_from_the_raw_one_only_by_the_three_fabric_changes():
    raw, fabric = code_lines("01_raw_pretrained.py"), code_lines("03_fabric.py")
    diff = list(difflib.unified_diff(raw, fabric, lineterm="", n=0))
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]

    # Every line 01 loses moves data to a device, picks the device, prints, or calls loss.backward().
    for line in removed:
        assert re.search(r"\bdevice\b|\bprint\(|loss\.backward\(\)|one_device", line), f"01 loses: {line!r}"
    # Every line 03 gains is one of the Fabric lines (or 01's import without its device helper), and each of
    # the three changes is there.
    without_device_helper = {line.replace("one_device, ", "") for line in removed}
    for line in added:
        assert FABRIC_LINE.match(line) or line in without_device_helper, f"03 gains a non-Fabric line: {line!r}"
    joined = "\n".join(added)
    for needed in (
        "fabric = Fabric(",
        "fabric.launch()",
        "fabric.setup(",
        "fabric.setup_dataloaders(",
        "fabric.backward(",
    ):
        assert needed in joined, f"03 lacks {needed}"
    # The training itself is untouched: the forward, the loss, the optimizer and the loop are the same lines.
    for line in ("loss = F.cross_entropy(model(images), labels)", "optimizer.step()", "optimizer.zero_grad()"):
        assert any(line in kept for kept in fabric) and any(line in kept for kept in raw)


def test_each_later_script_changes_only_what_its_step_is_about():
    # 04 is 03 with one argument more; 05 and 06 differ from 04 only in the constructor and default devices.
    base = code_lines("03_fabric.py")
    bf16 = code_lines("04_fabric_bf16.py")
    changed = [line for line in difflib.unified_diff(base, bf16, lineterm="", n=0) if line[:1] in "+-"]
    assert [line for line in changed if not line.startswith(("---", "+++"))] == [
        '-    fabric = Fabric(accelerator="auto", devices=args.devices)',
        '+    fabric = Fabric(accelerator="auto", devices=args.devices, precision="bf16-mixed")',
    ]
    for name, strategy in (("05_fabric_ddp.py", "ddp"), ("06_fabric_fsdp.py", "fsdp")):
        changed = [
            line
            for line in difflib.unified_diff(bf16, code_lines(name), lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("---", "+++"))
        ]
        assert len(changed) == 4, changed
        assert f'strategy="{strategy}"' in changed[-1] or f'strategy="{strategy}"' in changed[-2]


def test_a_plain_pytorch_script_refuses_more_than_one_device_and_says_which_script_does_it():
    result = run_python(str(VIT / "01_raw_pretrained.py"), "--devices", "2", check=False, timeout=60)
    assert result.returncode != 0
    assert "--devices 2: this plain PyTorch script runs one process" in result.stderr
    assert "05_fabric_ddp.py" in result.stderr


def test_a_missing_weights_file_is_named_with_the_command_that_makes_it(tmp_path):
    missing = tmp_path / "nope.pt"
    result = run_python(str(VIT / "03_fabric.py"), "--weights", str(missing), check=False, timeout=60)
    assert result.returncode != 0
    assert f"no pretrained weights at {missing}" in result.stderr
    assert "pretrain.py --series" in result.stderr


@pytest.mark.parametrize(("option", "value"), [("--epochs", "0"), ("--devices", "0"), ("--batch-size", "-1")])
def test_bad_options_are_refused_by_name(option, value):
    result = run_python(str(VIT / "04_fabric_bf16.py"), option, value, check=False, timeout=60)
    assert result.returncode == 2
    assert f"{option} must be at least 1, got {value}" in result.stderr


@pytest.mark.timeout(600)
def test_run_all_quick_runs_the_series_and_writes_the_table_and_the_chart(tmp_path):
    pytest.importorskip("sklearn", reason="the series' data set ships with scikit-learn")
    # All but 02 (plain torch.compile): compiling this ViT on a CPU takes 1-2 minutes, and 09 already
    # compiles the same model through Fabric. `run_all.py --quick` with no --only runs 02 as well.
    only = "00,01,03,04,05,06,07,08,09"
    # TRITON_INTERPRET=0: the tests' interpreter setting would make 09's kernels=True run Triton's interpreter on
    # the CPU (minutes); a user's CPU run leaves the model unchanged, and so does this one.
    result = run_python(
        str(VIT / "run_all.py"),
        "--quick",
        "--only",
        only,
        "--out-dir",
        str(tmp_path),
        timeout=540,
        TRITON_INTERPRET="0",
    )
    table = (tmp_path / "results.md").read_text()
    rows = {}
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if cells[0].endswith(".py"):
            rows[cells[0]] = cells
    # The series is 00-09; 10 (the talk's ViT-B/16 run, on CIFAR-10) runs on its own: tests/examples/test_vit_talk.py.
    scripts = sorted(path.name for path in VIT.glob("0[0-9]_*.py") if not path.name.startswith("02"))
    assert len(scripts) == 10 and sorted(rows) == scripts, table
    for name, cells in rows.items():
        assert re.fullmatch(r"\d+\.\d", cells[2]), f"{name} has no time: {cells}"
        accuracy = float(cells[5].rstrip("%"))
        # After a three-epoch pretraining: about 50% here, far from a full run's 89%, but well above chance (10%).
        assert accuracy > 25.0, f"{name}: {cells}"
    # The separate load script tests the very model the save script trained.
    assert rows["08_load_checkpoint.py"][5] == rows["08_save_checkpoint.py"][5], table
    png = (tmp_path / "results.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # Each script's own RESULT line is what the table shows.
    log = (tmp_path / "logs" / "04_fabric_bf16.log").read_text()
    record = json.loads(log.split("RESULT ", 1)[1].splitlines()[0])
    assert f"{record['test_accuracy']:.1f}%" == rows["04_fabric_bf16.py"][5]
    assert "failed" not in result.stdout


def test_the_mfu_counts_a_training_step_per_training_image_and_a_forward_per_validation_image(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
    from vit import series

    def loader(images, **kwargs):
        return DataLoader(TensorDataset(torch.zeros(images, 1, 8, 8)), batch_size=4, **kwargs)

    train_only = series.loop_flops(loader(12), loader(0), epochs=1)
    val_only = series.loop_flops(loader(0), loader(12), epochs=1)
    # A training step is a forward and a backward of about twice its cost (the images need no gradient: a bit less).
    assert 2.5 < train_only / val_only < 3.0, (train_only, val_only)
    assert series.loop_flops(loader(12), loader(12), epochs=3) == 3 * (train_only + val_only)
    # Under DDP a process counts its own share of the images only.
    shared = loader(12, sampler=DistributedSampler(TensorDataset(torch.zeros(12)), num_replicas=2, rank=0))
    assert series.loop_flops(shared, loader(0), epochs=1) == train_only // 2

    # A CPU has no peak: no MFU, said so. A GPU's peak is what get_available_flops returns (a GPU cannot be had here).
    assert series.mfu(train_only, 1.0, torch.device("cpu")) is None
    assert "MFU: n/a (no bf16 peak known for CPU)" in series.results(1.0, torch.device("cpu"), 0.5, train_only)
    monkeypatch.setattr(series, "get_available_flops", lambda device, dtype: 4.0 * train_only)
    assert series.mfu(train_only, 1.0, torch.device("cuda")) == 0.25
    assert series.mfu(train_only, 0.5, torch.device("cuda")) == 0.5


@pytest.mark.parametrize(
    "shapes",
    [
        {},  # the demo's
        {"dim": 256, "depth": 6, "heads": 8},  # the series'
        {"image_size": 224, "patch_size": 16, "in_channels": 3, "dim": 768, "depth": 12, "heads": 12},  # ViT-B/16
        {"image_size": 48, "patch_size": 8, "in_channels": 3, "dim": 96, "depth": 3, "heads": 3, "mlp_ratio": 2},
    ],
)
def test_the_vits_flops_worked_out_from_its_shapes_are_what_torchs_flop_counter_counts(monkeypatch, shapes):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import torch
    from vit.model import ViT, ViTConfig

    from fabriclite.throughput import measure_flops

    config = ViTConfig(**shapes, num_classes=7)
    with torch.device("meta"):
        model = ViT(config)
        images = torch.zeros(2, config.in_channels, config.image_size, config.image_size)
    assert config.flops(training=False) * 2 == measure_flops(model, lambda: model(images))
    assert config.flops() * 2 == measure_flops(model, lambda: model(images), lambda logits: logits.sum())


def test_the_process_clock_counts_from_the_start_of_the_process_imports_included():
    # The seconds before the module is imported (here a sleep; in a real run, the imports) are on the clock.
    code = (
        "import sys, time; time.sleep(1.5); sys.path.insert(0, sys.argv[1]); from vit import series; "
        "print(series.process_seconds())"
    )
    done = run_python("-c", code, str(ROOT / "examples"), timeout=300)
    assert float(done.stdout.split()[-1]) >= 1.5, done.stdout


def test_pick_devices_takes_the_gpus_there_are_and_says_so(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import torch
    from vit import series

    assert series.pick_devices(None, wanted=2) == (
        2 if not torch.cuda.is_available() else min(2, torch.cuda.device_count())
    )
    assert series.pick_devices(3, wanted=2) == 3  # --devices given: taken as it is (Fabric says if it cannot)
    # A one-GPU machine cannot be had here: its CUDA answers are faked.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert series.pick_devices(None, wanted=2) == 1
    assert "1 GPU(s) here, not 2: running on 1" in capsys.readouterr().err
    assert series.pick_devices(None, wanted=1) == 1 and capsys.readouterr().err == ""
