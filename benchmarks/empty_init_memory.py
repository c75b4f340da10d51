"""Peak resident memory of rank 0 while building and setting up a model of about 1 GB of fp32 parameters under FSDP
on 2 CPU processes: built normally (the whole model in every process; before this change rank 0 built it so under
``init_module(empty_init=True)`` too) against ``init_module(empty_init=True)`` (the meta device everywhere, then
each unit given storage and initialised just before it is sharded).

The model: 16 blocks of ``Linear(4096, 4096)`` (268 M parameters, 1.07 GB in fp32). The figure is rank 0's peak
RSS minus its RSS just before building. The baseline is read after a tiny model has been built and set up the same
way, so what FSDP's first setup imports and allocates once per process is not counted as the model's; the peak is
the kernel's high-water mark (``VmHWM``), reset at the baseline. Goal: at most about half the model above that
baseline with ``empty_init=True``.

Each variant runs in its own 2 processes, one variant after the other (at most 2 processes at a time).
Usage: ``python benchmarks/empty_init_memory.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys

import torch
from torch import nn

WIDTH, DEPTH = 4096, 16
VARIANTS = {"built normally (before)": "normal", "init_module(empty_init=True) (after)": "empty"}
GOAL = 0.5


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_variant(variant: str) -> None:
    from fabriclite import Fabric, seed_everything

    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    fabric.launch()
    seed_everything(0, verbose=False)

    def build(width: int) -> nn.Module:
        with fabric.init_module(empty_init=variant == "empty"):
            model = nn.Sequential(*(nn.Linear(width, width) for _ in range(DEPTH)))
        return fabric.setup(model)

    build(8)  # FSDP's fixed cost (imports, first allocations), paid once per process: not the model's
    gc.collect()
    fabric.barrier()
    reset_peak_rss()
    baseline = current_rss()
    model = build(WIDTH)  # noqa: F841 (kept alive: "after" below counts it)
    fabric.barrier()
    peak = peak_rss()
    if fabric.is_global_zero:
        print("RESULT " + json.dumps({"baseline": baseline, "peak": peak, "after": current_rss()}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", choices=list(VARIANTS.values()), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_variant(args.run)
        gc.collect()  # free the sharded model before the process group closes at exit (pytorch/pytorch#190489)
        return

    from _machine import describe

    model_bytes = DEPTH * (WIDTH * WIDTH + WIDTH) * 4
    gb = 1e9
    print(f"{DEPTH} x Linear({WIDTH}, {WIDTH}): {model_bytes / gb:.2f} GB of fp32 parameters; FSDP on 2 CPU processes")
    print("\n".join(describe()))
    print()
    print("| rank 0 | baseline RSS | peak RSS | peak above baseline | in models | RSS after setup |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, variant in VARIANTS.items():
        command = [sys.executable, __file__, "--run", variant]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True, env=env)
        r = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
        above = r["peak"] - r["baseline"]
        print(
            f"| {name} | {r['baseline'] / gb:.2f} GB | {r['peak'] / gb:.2f} GB | {above / gb:.2f} GB | "
            f"{above / model_bytes:.2f}x | {r['after'] / gb:.2f} GB |",
            flush=True,
        )
    print(f"\nGoal: empty_init at most about {GOAL:.1f}x the model above the baseline.")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
