"""First-step compile time of a 12-block ViT: ``Fabric(compile=True)`` (regional: each block in place, one graph for
the twelve) against ``compile={"regional": False}`` (the whole model, as ``torch.compile(model)``).

Each measurement is a fresh Python process with its own empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a new
temporary folder, so the FX graph and AOTAutograd caches start empty too): the first training step (forward,
backward, AdamW step) is what a user waits for before training starts. The modes run interleaved, ``--runs`` times
each; the table shows medians, the wall time and the CPU time (user + system of the process and of the C++
compiler runs it waited for; one Inductor compile thread, so all of the compilation is counted), which waiting for a
core on a shared machine does not inflate. After the first step, each
process times ``--steps`` more steps (steady state), then runs an evaluation pass with a new batch size and its
partial last batch, and reports the recompiles ``compile_report()`` counted.

Modes: ``regional`` (the default: batch dimension marked dynamic), ``regional-static`` (``dynamic=False``: what
marking the batch dimension costs per step) and ``whole``.

Usage: ``python benchmarks/compile_time.py [--runs 2] [--steps 10] [--dim 192] [--batch 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import describe

MODES = {
    "regional": {},
    "regional-static": {"dynamic": False},
    "whole": {"regional": False},
}
GOAL = 2.0  # the first step under regional compile at least this many times faster than whole-model, on a CPU
ROOT = Path(__file__).resolve().parents[1]


def child(mode: str, steps: int, dim: int, batch: int) -> dict:
    """One measurement, in this (fresh) process."""
    sys.path.insert(0, str(ROOT / "examples"))
    import torch
    import torch.nn.functional as F

    from fabriclite import Fabric
    from vit.model import ViT, ViTConfig

    torch.set_num_threads(1)  # one thread per process: steadier on a shared machine; the compiler's workers are apart
    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=4, in_channels=3, dim=dim, depth=12, heads=dim // 64, num_classes=10)
    fabric = Fabric(accelerator="cpu", compile=MODES[mode])
    model = ViT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    cpu_before, start = cpu_seconds(), time.perf_counter()
    step()
    first, first_cpu = time.perf_counter() - start, cpu_seconds() - cpu_before
    start = time.perf_counter()
    for _ in range(steps):
        step()
    steady = (time.perf_counter() - start) / steps
    model.eval()
    with torch.no_grad():
        for size in (2 * batch, 2 * batch, batch // 2 + 1):  # a new eval batch size, then its partial last batch
            model(torch.randn(size, 3, 32, 32))
    (report,) = fabric.compile_report()
    return {
        "first_step_s": first,
        "first_step_cpu_s": first_cpu,
        "steady_step_ms": 1000 * steady,
        "graphs": report["graphs"],
        "recompiles": report["recompiles"],
    }


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of the children it has reaped (the C++ compiler's runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(mode: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        # One compile thread: Inductor compiles in this process, so the first step's CPU time counts all of it.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        command = [
            sys.executable,
            __file__,
            "--child",
            mode,
            "--steps",
            str(args.steps),
            "--dim",
            str(args.dim),
            "--batch",
            str(args.batch),
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False, timeout=1800)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**result, "process_wall_s": wall, "process_cpu_s": cpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dim", type=int, default=192, help="ViT width (192: ViT-Tiny's); depth is 12")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps, args.dim, args.batch)))
        return
    modes = [mode.strip() for mode in args.modes.split(",")]
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes}: unknown {unknown}; valid: {', '.join(MODES)}")
    print("\n".join(describe()))
    print(f"- load average before: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"- 12-block ViT, width {args.dim}, 32x32 images in 4x4 patches (65 tokens), batch {args.batch}, AdamW\n")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    for run in range(args.runs):
        for mode in modes[run % len(modes) :] + modes[: run % len(modes)]:  # rotate the order between runs
            results[mode].append(measure(mode, args))
            print(f"  run {run + 1} {mode}: {results[mode][-1]}", file=sys.stderr, flush=True)
    print(f"- load average after: {os.getloadavg()[0]:.2f} (1 min)\n")
    print(
        "| mode | first step, wall (s) | first step, CPU (s) | whole process, CPU (s) | steady step (ms) | graphs "
        "| recompiles after eval |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    median = {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for mode, rows in results.items()}
    for mode, m in median.items():
        print(
            f"| {mode} | {m['first_step_s']:.1f} | {m['first_step_cpu_s']:.1f} | {m['process_cpu_s']:.1f} "
            f"| {m['steady_step_ms']:.1f} "
            f"| {m['graphs']:.0f} | {m['recompiles']:.0f} |"
        )
    if "regional" in median and "whole" in median:
        wall = median["whole"]["first_step_s"] / median["regional"]["first_step_s"]
        cpu = median["whole"]["first_step_cpu_s"] / median["regional"]["first_step_cpu_s"]
        print(f"\nfirst step, whole / regional: {wall:.2f}x wall, {cpu:.2f}x CPU (goal on a CPU: at least {GOAL:.0f}x)")


if __name__ == "__main__":
    main()
