"""Import cost of fabriclite next to torch (and Lightning Fabric, Accelerate when installed): the wall time and the
peak resident memory of a fresh ``python -c "import ..."``.

Each statement runs in a new interpreter, interleaved with the others in a rotating order, ``--runs`` times. A
statement's ratio to torch is the median of its per-run ratios to the ``import torch`` of the same run. Next to
wall time, the child's CPU time (user plus system), which waiting for a core on a shared machine does not
inflate, and its peak resident memory; the kernel reports both when the child is reaped. Last, the script lists
the heavy optional modules ``import fabriclite`` pulled in (there should be none) and the top-level packages it
adds to those torch imports.

Usage: ``python benchmarks/import_time.py [--runs 12]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from importlib.util import find_spec

from _machine import describe

GOAL = 1.05

# The heavy or optional modules fabriclite promises to import only when a feature needs them.
HEAVY_CHECK = (
    "import fabriclite, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
    "{'tensorboard','triton','sklearn','yaml','torch.distributed.fsdp'} or m.startswith('torch.distributed.fsdp') "
    "or m.startswith('torch.distributed.checkpoint')))"
)
ADDED_PACKAGES = (
    "import sys; import torch; before = set(sys.modules); import fabriclite; "
    "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))"
)


def statements() -> dict[str, str]:
    """The import statements to time, by label; the peers only when installed."""
    found = {"python": "pass", "torch": "import torch", "fabriclite": "import fabriclite"}
    if find_spec("lightning") is not None and find_spec("lightning.fabric") is not None:
        found["lightning.fabric"] = "import lightning.fabric"
    if find_spec("lightning_fabric") is not None:
        found["lightning_fabric"] = "import lightning_fabric"
    if find_spec("accelerate") is not None:
        found["accelerate"] = "import accelerate"
    return found


# The child's own peak resident memory, read after the statement: ru_maxrss would also count the memory of this
# (large) process, which posix_spawn's child shares until it execs.
_PEAK = "; import sys; sys.stdout.write(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')))"


def run_once(statement: str) -> dict[str, float]:
    """Wall ms, CPU ms and peak RSS (MiB) of one ``python -c statement``."""
    read_end, write_end = os.pipe()
    start = time.perf_counter()
    # The child's stderr is dropped: some libraries print warnings at exit; a failure says how to see them.
    files = [(os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0), (os.POSIX_SPAWN_DUP2, write_end, 1)]
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", statement + _PEAK], os.environ, file_actions=files)
    os.close(write_end)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - start
    with os.fdopen(read_end) as pipe:
        peak_kib = int(pipe.read().split()[1])  # "VmHWM:  224512 kB"
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"python -c {statement!r} failed; run it by hand to see why.")
    return {"wall": wall * 1000, "cpu": (usage.ru_utime + usage.ru_stime) * 1000, "rss": peak_kib / 1024}


def measure(runs: int) -> dict[str, dict[str, list[float]]]:
    labels = statements()
    names = list(labels)
    for name in names:  # once untimed: bytecode caches written, files in the page cache
        run_once(labels[name])
    results: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": [], "rss": []} for name in names}
    for run_index in range(runs):
        shift = run_index % len(names)
        for name in names[shift:] + names[:shift]:
            for key, value in run_once(labels[name]).items():
                results[name][key].append(value)
    return results


def ratio_to_torch(results: dict[str, dict[str, list[float]]], name: str, key: str) -> float:
    return statistics.median(m / t for m, t in zip(results[name][key], results["torch"][key]))


def table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = [
        "| statement | wall ms (median) | wall ratio vs torch | CPU ms (median) | CPU ratio vs torch | "
        "peak RSS MiB (median) | RSS vs torch MiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, measured in results.items():
        statement = "python -c pass" if name == "python" else f"import {name}"
        extra_rss = statistics.median(r - t for r, t in zip(measured["rss"], results["torch"]["rss"]))
        lines.append(
            f"| `{statement}` | {statistics.median(measured['wall']):.0f} | "
            f"{ratio_to_torch(results, name, 'wall'):.3f}x | {statistics.median(measured['cpu']):.0f} | "
            f"{ratio_to_torch(results, name, 'cpu'):.3f}x | {statistics.median(measured['rss']):.0f} | "
            f"{extra_rss:+.1f} |"
        )
    return lines


def python_output(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, check=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=12, help="interleaved runs of every statement (default: 12)")
    args = parser.parse_args()

    results = measure(args.runs)
    print(f"Fresh-interpreter import cost ({args.runs} interleaved runs):\n")
    print("\n".join(describe()))
    print()
    print("\n".join(table(results)))
    ratio = ratio_to_torch(results, "fabriclite", "wall")
    print(
        f"\ngoal import fabriclite <= {GOAL}x import torch (wall): {'met' if ratio <= GOAL else 'MISSED'} "
        f"({ratio:.3f}x; CPU time {ratio_to_torch(results, 'fabriclite', 'cpu'):.3f}x)"
    )
    print(f"heavy modules imported by `import fabriclite`: {python_output(HEAVY_CHECK)}")
    print(f"top-level packages `import fabriclite` adds to `import torch`: {python_output(ADDED_PACKAGES)}")


if __name__ == "__main__":
    main()
