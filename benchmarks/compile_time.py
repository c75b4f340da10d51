"""First-step compile time of a 12-block ViT: ``Fabric(compile=True)`` (regional: each block in place, one graph for
the twelve) against ``compile={"regional": False}`` (the whole model, as ``torch.compile(model)``).

Each measurement is a fresh Python process whose caches all start empty: a new temporary folder is both
``TORCHINDUCTOR_CACHE_DIR`` (FX graph, AOTAutograd and compiled-kernel caches) and ``TMPDIR`` (Inductor keeps its
precompiled C++ header under the temporary folder, outside ``TORCHINDUCTOR_CACHE_DIR``, so a fresh cache dir alone
would reuse it). The first training step (forward, backward, AdamW step) is what a user waits for before training
starts. It includes costs Inductor pays once per machine and then keeps in its cache: checking which vector
instructions the C++ compiler can build (compiling test programs) and precompiling its header. So each mode is
measured twice: on an empty machine cache, and after a warm-up process in the same folders compiled one unrelated
function (``x.sin()``), which pays those one-off costs and caches nothing the ViT can reuse: the second figure is
what compiling this model costs on a machine that has compiled anything before.

The modes run interleaved, ``--runs`` times each; the table shows medians, the wall time and the CPU time of the
first step (user + system of the process and of the child processes it waited for: the C++ compiler's runs and
Inductor's probes; one Inductor compile thread, so all of the compilation is counted), which waiting for a core on
a shared machine does not inflate, and the child processes' share of it. After the first step, each process times
``--steps`` more steps (steady state; wall and the process's CPU time, the figure to compare on a shared machine),
then runs an evaluation pass with a new batch size and its partial last batch, and reports the recompiles
``compile_report()`` counted.

Modes: ``regional`` (the default: batch dimension marked dynamic), ``regional-static`` (``dynamic=False``: what
marking the batch dimension costs) and ``whole``.

Usage: ``python benchmarks/compile_time.py [--runs 2] [--steps 10] [--dim 192] [--batch 16] [--modes regional,whole]``.
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

    (own_before, cxx_before), start = cpu_seconds(), time.perf_counter()
    step()
    first = time.perf_counter() - start
    own_after, cxx_after = cpu_seconds()
    compiles = len(torch._dynamo.utils.compilation_time_metrics.get("compile_file", []))
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    steady, steady_cpu = (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps
    model.eval()
    with torch.no_grad():
        for size in (2 * batch, 2 * batch, batch // 2 + 1):  # a new eval batch size, then its partial last batch
            model(torch.randn(size, 3, 32, 32))
    (report,) = fabric.compile_report()
    return {
        "first_step_s": first,
        "first_step_cpu_s": (own_after - own_before) + (cxx_after - cxx_before),
        "first_step_cxx_cpu_s": cxx_after - cxx_before,
        "cxx_compiles": compiles,
        "steady_step_ms": 1000 * steady,
        "steady_step_cpu_ms": 1000 * steady_cpu,
        "graphs": report["graphs"],
        "recompiles": report["recompiles"],
    }


def cpu_seconds() -> tuple[float, float]:
    """CPU time of this process (all its threads), and of the children it has reaped (the C++ compiler's runs)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def warm_up() -> None:
    """Pay Inductor's once-per-machine costs (vector instruction checks, the precompiled header) on a function that
    shares no graph or kernel with the ViT."""
    import torch

    torch.compile(lambda x: (2 * x).sin())(torch.randn(64))


def measure(mode: str, warm_machine: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="compile-time-") as root:
        # One compile thread: Inductor compiles in this process, so the first step's CPU time counts all of it.
        env = {
            **os.environ,
            "TMPDIR": root,
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
        if warm_machine:
            subprocess.run(
                [sys.executable, __file__, "--warm-up"], env=env, check=True, capture_output=True, timeout=900
            )
        command = [sys.executable, __file__, "--child", mode]
        command += ["--steps", str(args.steps), "--dim", str(args.dim), "--batch", str(args.batch)]
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
    parser.add_argument("--warm-up", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warm_up:
        warm_up()
        return
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
    cases = [(mode, warm) for warm in (False, True) for mode in modes]
    results: dict[tuple[str, bool], list[dict]] = {case: [] for case in cases}
    for run in range(args.runs):
        for case in cases[run % len(cases) :] + cases[: run % len(cases)]:  # rotate the order between runs
            results[case].append(measure(*case, args))
            print(f"  run {run + 1} {case}: {results[case][-1]}", file=sys.stderr, flush=True)
    print(f"- load average after: {os.getloadavg()[0]:.2f} (1 min)\n")
    print(
        "| mode | machine cache | first step, wall (s) | first step, CPU (s) | of which C++ compiler and probes (s) | C++ compiler runs "
        "| whole process, CPU (s) | steady step, wall (ms) | steady step, CPU (ms) | graphs | recompiles after eval |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    median = {case: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for case, rows in results.items()}
    for (mode, warm), m in median.items():
        print(
            f"| {mode} | {'warm' if warm else 'empty'} | {m['first_step_s']:.1f} | {m['first_step_cpu_s']:.1f} "
            f"| {m['first_step_cxx_cpu_s']:.1f} | {m['cxx_compiles']:.0f} | {m['process_cpu_s']:.1f} "
            f"| {m['steady_step_ms']:.1f} | {m['steady_step_cpu_ms']:.1f} | {m['graphs']:.0f} | {m['recompiles']:.0f} |"
        )
    if "regional" in modes and "whole" in modes:
        print()
        for warm in (False, True):
            regional, whole = median[("regional", warm)], median[("whole", warm)]
            wall = whole["first_step_s"] / regional["first_step_s"]
            cpu = whole["first_step_cpu_s"] / regional["first_step_cpu_s"]
            print(
                f"first step, whole / regional, {'warm' if warm else 'empty'} machine cache: {wall:.2f}x wall, "
                f"{cpu:.2f}x CPU (goal on a CPU: at least {GOAL:.0f}x)"
            )


if __name__ == "__main__":
    main()
