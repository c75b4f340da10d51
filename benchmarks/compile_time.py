"""How long ``Fabric(compile=True)`` keeps a 12-block ViT waiting before its first step, with caches empty and
warm, and against compiling the whole model (``compile={"regional": False}``, as ``torch.compile(model)``).

Each measurement is a fresh Python process. The caches it starts with:

- ``empty``: a new temporary folder is both ``TORCHINDUCTOR_CACHE_DIR`` (FX graph, AOTAutograd and compiled-kernel
  caches) and ``TMPDIR`` (Inductor keeps its precompiled C++ header under the temporary folder, outside
  ``TORCHINDUCTOR_CACHE_DIR``, so a fresh cache dir alone would reuse it): everything is compiled, including what
  Inductor does once per machine (checking which vector instructions the C++ compiler can build, precompiling its
  header).
- ``other``: a warm-up process in the same folders first compiled one unrelated function (``x.sin()``), which pays
  those once-per-machine costs and caches nothing the ViT can reuse: what compiling this model costs on a machine
  that has compiled anything before.
- ``same``: the same script ran before in the same folders (the ``empty`` process of the same run): what a user
  waits for the second time a script starts. The issue 40 goal on a CPU: at most 1/10 of ``empty``.

The wait is ``setup`` plus the first training step (forward, backward, AdamW step): setup is where fabriclite
prepares the compile, the first step is where Dynamo and Inductor compile. Wall time and CPU time (user + system of
the process and of the child processes it waited for: the C++ compiler's runs and Inductor's probes; one Inductor
compile thread, so all of the compilation is counted), which waiting for a core on a shared machine does not
inflate. After the first step, each process times ``--steps`` more steps (steady state), then runs an evaluation
pass (``model.eval()`` under ``torch.no_grad()``, a new batch size and its partial last batch; the CPU time of its
first call is where an evaluation compile shows), one more training step, and reports the recompiles
``compile_report()`` counted (0: the evaluation compiled nothing).

The modes and caches run interleaved, ``--runs`` times each; the table shows medians. Modes: ``regional`` (the
default: batch dimension marked dynamic), ``regional-static`` (``dynamic=False``: what marking the batch dimension
costs) and ``whole``.

Usage: ``python benchmarks/compile_time.py [--runs 2] [--steps 10] [--dim 192] [--batch 16] [--modes regional,whole]
[--caches empty,other,same]``.
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
CACHES = ("empty", "other", "same")
GOAL = 2.0  # the first step under regional compile at least this many times faster than whole-model, on a CPU
WARM_GOAL = 0.1  # the wait with this script's caches warm at most this fraction of the wait with empty caches
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
    images, labels = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    (own_before, cxx_before), start = cpu_seconds(), time.perf_counter()
    model, optimizer = fabric.setup(model, optimizer)
    setup = time.perf_counter() - start

    def step() -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    step()
    wait = time.perf_counter() - start
    own_after, cxx_after = cpu_seconds()
    wait_cpu, wait_cxx_cpu = (own_after - own_before) + (cxx_after - cxx_before), cxx_after - cxx_before
    compiles = len(torch._dynamo.utils.compilation_time_metrics.get("compile_file", []))
    start, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    steady, steady_cpu = (time.perf_counter() - start) / steps, (time.process_time() - start_cpu) / steps
    model.eval()
    with torch.no_grad():
        own_before, cxx_before = cpu_seconds()
        model(torch.randn(2 * batch, 3, 32, 32))  # the first evaluation call: where evaluation would compile
        own_after, cxx_after = cpu_seconds()
        for size in (2 * batch, batch // 2 + 1):  # the new eval batch size again, then its partial last batch
            model(torch.randn(size, 3, 32, 32))
    model.train()
    step()  # back to training: no compile either
    (report,) = fabric.compile_report()
    return {
        "setup_s": setup,
        "wait_s": wait,
        "wait_cpu_s": wait_cpu,
        "wait_cxx_cpu_s": wait_cxx_cpu,
        "first_eval_cpu_s": (own_after - own_before) + (cxx_after - cxx_before),
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


def measure(mode: str, cache: str, args: argparse.Namespace) -> list[tuple[str, dict]]:
    """One process with empty caches (``cache`` "empty" or "same") or after the unrelated warm-up ("other"); for
    "same", then a second process in the same folders. Returns (cache, result) for each process."""
    with tempfile.TemporaryDirectory(prefix="compile-time-") as root:
        # One compile thread: Inductor compiles in this process, so the first step's CPU time counts all of it.
        env = {
            **os.environ,
            "TMPDIR": root,
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
        if cache == "other":
            subprocess.run(
                [sys.executable, __file__, "--warm-up"], env=env, check=True, capture_output=True, timeout=900
            )
            return [("other", run_child(mode, env, args))]
        first = run_child(mode, env, args)
        return [("empty", first)] + ([("same", run_child(mode, env, args))] if cache == "same" else [])


def run_child(mode: str, env: dict[str, str], args: argparse.Namespace) -> dict:
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
    parser.add_argument("--caches", default="same,other", help=f"comma-separated, of {', '.join(CACHES)}")
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
    caches = [cache.strip() for cache in args.caches.split(",")]
    unknown = [mode for mode in modes if mode not in MODES] + [cache for cache in caches if cache not in CACHES]
    if unknown:
        parser.error(f"unknown {unknown}; valid modes: {', '.join(MODES)}; valid caches: {', '.join(CACHES)}")
    print("\n".join(describe()))
    print(f"- load average before: {os.getloadavg()[0]:.2f} (1 min)")
    print(f"- 12-block ViT, width {args.dim}, 32x32 images in 4x4 patches (65 tokens), batch {args.batch}, AdamW\n")
    # "same" runs an "empty" process first: a separate "empty" case would only repeat it.
    cases = [(mode, cache) for cache in caches for mode in modes if not (cache == "empty" and "same" in caches)]
    results: dict[tuple[str, str], list[dict]] = {}
    for run in range(args.runs):
        for case in cases[run % len(cases) :] + cases[: run % len(cases)]:  # rotate the order between runs
            for cache, result in measure(*case, args):
                results.setdefault((case[0], cache), []).append(result)
                print(f"  run {run + 1} {case[0]}, {cache}: {result}", file=sys.stderr, flush=True)
    print(f"- load average after: {os.getloadavg()[0]:.2f} (1 min)\n")
    print(
        "| mode | caches | setup + first step, wall (s) | setup + first step, CPU (s) | of which C++ compiler and "
        "probes (s) | C++ compiler runs | whole process, CPU (s) | steady step, wall (ms) | steady step, CPU (ms) "
        "| first eval call, CPU (s) | graphs | recompiles after eval |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    median = {case: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for case, rows in results.items()}
    for (mode, cache), m in sorted(median.items(), key=lambda item: (CACHES.index(item[0][1]), item[0][0])):
        print(
            f"| {mode} | {cache} | {m['wait_s']:.1f} | {m['wait_cpu_s']:.1f} | {m['wait_cxx_cpu_s']:.1f} "
            f"| {m['cxx_compiles']:.0f} | {m['process_cpu_s']:.1f} | {m['steady_step_ms']:.1f} "
            f"| {m['steady_step_cpu_ms']:.1f} | {m['first_eval_cpu_s']:.2f} | {m['graphs']:.0f} | {m['recompiles']:.0f} |"
        )
    print()
    for mode in modes:
        if (mode, "same") in median and (mode, "empty") in median:
            warm, cold = median[(mode, "same")], median[(mode, "empty")]
            print(
                f"{mode}, caches of the same script / empty caches: {warm['wait_s'] / cold['wait_s']:.3f} wall, "
                f"{warm['wait_cpu_s'] / cold['wait_cpu_s']:.3f} CPU (goal on a CPU: at most {WARM_GOAL})"
            )
    for cache in caches:
        if ("regional", cache) in median and ("whole", cache) in median:
            regional, whole = median[("regional", cache)], median[("whole", cache)]
            print(
                f"{cache} caches, whole / regional: {whole['wait_s'] / regional['wait_s']:.2f}x wall, "
                f"{whole['wait_cpu_s'] / regional['wait_cpu_s']:.2f}x CPU (goal on a CPU: at least {GOAL:.0f}x)"
            )


if __name__ == "__main__":
    main()
