"""``fabriclite plan`` against the real thing, and how long it takes at scale.

1. Predicted against measured, every script unchanged, planned as rank 0 of 1, 2 and 4 processes (``fabriclite plan
   --json``), then run for real on as many gloo processes (``fabriclite run``) through the same two optimizer steps
   (tests/scripts/measure_memory.py): each rank's peak of tensor memory as torch's profiler counts it, allocation by
   allocation from the start, and the peak of the tensors alive from the first forward on, counted as the plan
   counts them but on the real run's tensors. CPU rows only: this machine has no GPU.
   - the examples' GPT (default size, ``--eval-windows 32``): DDP and FSDP2 on 1, 2 and 4 ranks, tensor parallel
     2 x FSDP2 2 (``--tp 2``) and HSDP 2 x 2 (``--hsdp 2``) on 4;
   - the examples' ViT: examples/vit/05_fabric_ddp.py (DDP) and 06_fabric_fsdp.py (FSDP2) on 1, 2 and 4 ranks,
     with random weights of the series' ViT in place of the pretrained ones (they bring their own strategy, so no
     tensor parallel or HSDP rows);
   - the talk's script, examples/vit/10_talk_vit_b16.py (``--synthetic``, eager, no loader workers): at a small
     size (``--image-size 64 --dim 192 --depth 4``, batch 32) on 1, 2 and 4 ranks, and at the full ViT-B/16 size
     with a batch of 8 instead of 128 on 1 and 2 ranks (the talk's batch of 128 holds 10 GiB a rank and takes
     minutes a step on a CPU).
2. Time to plan: the GPT at a Llama-3-8B shape (benchmarks/plan_llama_shape.py) on 1,024 ranks (8 x 128): FSDP2
   built under ``init_module(empty_init=True)`` and built whole on every rank, HSDP and tensor parallel x FSDP2.

Prints Markdown tables for BENCHMARKS.md. Usage: ``python benchmarks/plan_memory.py [--skip-scale] [--only GPT]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt" / "train.py")
VIT = ROOT / "examples" / "vit"
MEASURE = str(ROOT / "tests" / "scripts" / "measure_memory.py")
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def plan(*args: str) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "fabriclite.cli", "plan", "--json", *args],
        capture_output=True, text=True, env=ENV, timeout=1200,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def measure(devices: int, *args: str) -> tuple[list[int], list[int]]:
    """Each rank's peak: the profiler's from the start, and of the tensors alive from the first forward on."""
    out = subprocess.run(
        [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices), MEASURE, *args],
        capture_output=True, text=True, env=ENV, timeout=1200, check=True,
    )  # fmt: skip
    found = sorted(re.findall(r"MEASURED (\d+) (\d+) steps 2 alive \d+ stepping (\d+)", out.stdout))
    assert len(found) == devices, out.stdout[-3000:]
    return [int(peak) for _, peak, _ in found], [int(alive) for _, _, alive in found]


def layouts(folder: str) -> list[tuple[str, str, int, list[str]]]:
    """(model, strategy, ranks, the script and its arguments) of every row."""
    rows = []
    for strategy in ("ddp", "fsdp"):
        for devices in (1, 2, 4):
            rows.append(("GPT 0.84M, bf16-mixed", strategy, devices, [GPT, "--strategy", strategy]))
    rows += [("GPT 0.84M, bf16-mixed", "tp 2 x fsdp 2", 4, [GPT, "--tp", "2"])]
    rows += [("GPT 0.84M, bf16-mixed", "hsdp 2 x 2", 4, [GPT, "--hsdp", "2"])]
    rows = [
        (model, name, devices, [*args, "--eval-windows", "32", "--out-dir", folder])
        for model, name, devices, args in rows
    ]
    vit = runpy.run_path(str(VIT / "model.py"))
    weights = os.path.join(folder, "vit_series.pt")
    torch.save(vit["ViT"](replace(vit["SERIES_CONFIG"], num_classes=10)).state_dict(), weights)
    for script, strategy in (("05_fabric_ddp.py", "ddp"), ("06_fabric_fsdp.py", "fsdp")):
        for devices in (1, 2, 4):
            args = [str(VIT / script), "--devices", str(devices), "--weights", weights]
            rows.append((f"ViT 4.7M, bf16-mixed, vit/{script}", strategy, devices, args))
    talk = [str(VIT / "10_talk_vit_b16.py"), "--synthetic", "--workers", "0", "--no-compile"]
    small = ["--image-size", "64", "--dim", "192", "--depth", "4", "--train-size", "256", "--test-size", "64"]
    for devices in (1, 2, 4):
        args = [*talk, *small, "--batch-size", "32", "--devices", str(devices)]
        rows.append(
            ("talk's script, small ViT 1.9M, batch 32, bf16-mixed", "auto" if devices == 1 else "ddp", devices, args)
        )
    for devices in (1, 2):
        args = [*talk, "--batch-size", "8", "--devices", str(devices)]
        rows.append(
            ("talk's script, ViT-B/16 85.8M, batch 8, bf16-mixed", "auto" if devices == 1 else "ddp", devices, args)
        )
    return rows


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-scale", action="store_true", help="only the predicted-against-measured rows")
    parser.add_argument("--only", default="", help="only the rows whose model starts with this (GPT, ViT, talk)")
    options = parser.parse_args()
    print(
        "| model | strategy | ranks | predicted peak, rank 0 (MiB) | profiler, each rank (MiB) | error vs profiler, "
        "rank 0 | tensors alive from the first forward, each rank (MiB) | error vs tensors alive, rank 0 | "
        "plan + run (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for model, name, devices, args in layouts(folder):
            if not model.startswith(options.only):
                continue
            start = time.perf_counter()
            predicted, _ = plan("--devices", str(devices), *args)
            measured, alive = measure(devices, *args)
            seconds = time.perf_counter() - start
            peak = predicted["peak_bytes"]
            print(
                f"| {model} | {name} | {devices} | {mib(peak)} | {', '.join(mib(m) for m in measured)} | "
                f"{(peak - measured[0]) / measured[0]:+.1%} | {', '.join(mib(m) for m in alive)} | "
                f"{(peak - alive[0]) / alive[0]:+.1%} | {seconds:.0f} |",
                flush=True,
            )
    if options.skip_scale:
        return
    print()
    print("| plan | ranks | time (s) | peak, rank 0 (GiB) | setup peak (GiB) |")
    print("|---|---|---|---|---|")
    fsdp = ["--strategy", "fsdp"]  # HSDP and TP bring their own strategy objects
    for name, settings, extra in (
        ("FSDP2, empty init", fsdp, ["--empty-init"]),
        ("FSDP2, built whole on every rank", fsdp, []),
        ("HSDP 128 x 8, empty init", [], ["--empty-init", "--hsdp"]),
        ("TP 8 x FSDP2 128, empty init", [], ["--empty-init", "--tp"]),
    ):
        script = [str(ROOT / "benchmarks" / "plan_llama_shape.py"), *extra]
        result, seconds = plan("--devices", "8", "--num-nodes", "128", *settings, *script)
        print(
            f"| Llama-3-8B-shaped GPT (6.97B), {name} | 1,024 | {seconds:.0f} (plan {result['seconds']:.0f}) | "
            f"{result['peak_bytes'] / 2**30:.1f} | {result['setup_peak_bytes'] / 2**30:.1f} |"
        )


if __name__ == "__main__":
    main()
