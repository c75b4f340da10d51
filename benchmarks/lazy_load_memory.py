"""Peak resident memory while loading one tensor of a checkpoint of about 1 GB: ``torch.load`` (reads every
tensor), fabriclite's ``utilities.load._lazy_load`` (torch's ``mmap``: tensors stay in the file until touched; with
and without the checksum check it does by default) and Lightning Fabric's ``_lazy_load`` (its own unpickler), where
Lightning is installed.

The checkpoint: ``{"model": {"w0".."w15"}}``, 16 fp32 tensors of 4096 x 4096 (1.07 GB). Each variant runs in a
fresh process: the figure is its peak RSS (``VmHWM``, reset just before loading) minus its RSS before loading,
after ``state["model"]["w7"]`` was loaded and summed (one tensor, 67 MB). Goal: about one tensor, not the file.

Usage: ``python benchmarks/lazy_load_memory.py [--dir DIR]`` (writes the 1 GB file there, then removes it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SIZE, COUNT = 4096, 16
VARIANTS = {
    "torch.load (everything read)": "torch",
    "fabriclite _lazy_load (mmap, checksums verified)": "fabriclite",
    "fabriclite _lazy_load(verify=False)": "fabriclite-noverify",
    "Lightning _lazy_load": "lightning",
}


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run_variant(variant: str, path: str) -> None:
    if variant == "torch":
        load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
    elif variant.startswith("fabriclite"):
        from fabriclite.utilities.load import _lazy_load

        load = lambda p: _lazy_load(p, verify=variant == "fabriclite")  # noqa: E731
    else:
        from lightning.fabric.utilities.load import _lazy_load as load
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    baseline = rss()
    state = load(path)
    total = float(torch.sum(state["model"]["w7"]))  # one tensor read
    print("RESULT " + json.dumps({"baseline": baseline, "peak": peak_rss(), "sum": total}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where to write the 1 GB checkpoint (default: a temp dir)")
    args = parser.parse_args()
    if args.run:
        run_variant(args.run, args.path)
        return

    from _machine import describe, installed_version

    gb = 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "model.pth"
        generator = torch.Generator().manual_seed(0)
        torch.save({"model": {f"w{i}": torch.randn(SIZE, SIZE, generator=generator) for i in range(COUNT)}}, path)
        size = path.stat().st_size
        print(
            f"Checkpoint: {COUNT} x fp32 [{SIZE}, {SIZE}], {size / gb:.2f} GB; one tensor: {SIZE * SIZE * 4 / gb:.3f} GB"
        )
        print("\n".join(describe()))
        print()
        print("| variant | RSS before | peak above it | of the file |")
        print("|---|---:|---:|---:|")
        sums = set()
        for name, variant in VARIANTS.items():
            if variant == "lightning" and installed_version("lightning") is None:
                continue
            command = [sys.executable, __file__, "--run", variant, "--path", str(path)]
            out = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
            r = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
            sums.add(r["sum"])
            above = r["peak"] - r["baseline"]
            print(f"| {name} | {r['baseline'] / gb:.2f} GB | {above / gb:.3f} GB | {above / size:.2f}x |", flush=True)
        assert len(sums) == 1, f"the variants read different values: {sums}"


if __name__ == "__main__":
    main()
