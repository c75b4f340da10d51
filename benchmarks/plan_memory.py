"""``fabriclite plan`` against the real thing, and how long it takes at scale.

1. Predicted against measured: the examples' GPT (default size, ``--eval-windows 32``) under DDP and FSDP2, planned
   as rank 0 of 1 and 2 processes (``fabriclite plan --json``), then run for real on as many gloo processes
   (``fabriclite run``) through the same two optimizer steps, each rank's peak of tensor memory counted by torch's
   profiler (tests/scripts/measure_memory.py). CPU rows only: this machine has no GPU.
   Also at 4 ranks: FSDP2, tensor parallel 2 x FSDP2 2 (``--tp 2``) and HSDP 2 x 2 (``--hsdp 2``), with the peak of
   the tensors alive in the real run beside the profiler's.
2. Time to plan: the GPT at a Llama-3-8B shape (benchmarks/plan_llama_shape.py) on 1,024 ranks (8 x 128): FSDP2
   built under ``init_module(empty_init=True)`` and built whole on every rank, HSDP and tensor parallel x FSDP2.

Prints a Markdown table for BENCHMARKS.md. Usage: ``python benchmarks/plan_memory.py [--skip-scale]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt" / "train.py")
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
    """Each rank's peak: the profiler's, and of the tensors alive."""
    out = subprocess.run(
        [sys.executable, "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices), MEASURE, *args],
        capture_output=True, text=True, env=ENV, timeout=1200, check=True,
    )  # fmt: skip
    found = sorted(re.findall(r"MEASURED (\d+) (\d+) steps \d+ alive (\d+)", out.stdout))
    return [int(peak) for _, peak, _ in found], [int(alive) for _, _, alive in found]


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-scale", action="store_true", help="only the predicted-against-measured rows")
    options = parser.parse_args()
    print(
        "| model | strategy | ranks | predicted peak, rank 0 (MiB) | measured peak per rank (MiB) | error | "
        "tensors alive per rank (MiB) |"
    )
    print("|---|---|---|---|---|---|---|")
    layouts = [(s, d, ["--strategy", s]) for s in ("ddp", "fsdp") for d in (1, 2)]
    layouts += [
        ("fsdp", 4, ["--strategy", "fsdp"]),
        ("tp 2 x fsdp 2", 4, ["--tp", "2"]),
        ("hsdp 2 x 2", 4, ["--hsdp", "2"]),
    ]
    with tempfile.TemporaryDirectory() as folder:
        for name, devices, layout in layouts:
            args = [GPT, *layout, "--eval-windows", "32", "--out-dir", folder]
            predicted, _ = plan("--devices", str(devices), *args)
            measured, alive = measure(devices, *args)
            error = (predicted["peak_bytes"] - measured[0]) / measured[0]
            print(
                f"| GPT 0.84M, bf16-mixed | {name} | {devices} | {mib(predicted['peak_bytes'])} | "
                f"{', '.join(mib(m) for m in measured)} | {error:+.1%} | {', '.join(mib(m) for m in alive)} |"
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
