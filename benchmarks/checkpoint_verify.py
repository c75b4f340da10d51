"""What checksums cost a checkpoint of about 1 GB: saving and loading it with fabriclite, with and without
verification, next to raw ``torch.save`` / ``torch.load`` and Lightning Fabric's ``save`` / ``load``.

Variants, each timed once per round, in an order that rotates from round to round (a slow spell of the machine hits
all alike):

- save: ``torch.save`` with torch's per-record CRC-32 off and on, ``fabric.save`` (atomic and fsynced) without and
  with those checksums, Lightning Fabric's ``save``; and, for the sharded format, ``fabric.save`` under FSDP on one
  process next to the part of it that checksums every file for the manifest.
- load: ``torch.load`` + ``load_state_dict``, ``fabric.load`` with ``verify=False`` and with ``verify=True`` (the
  default), Lightning Fabric's ``load``; the same for the sharded folder.

Wall time (saving and loading are I/O and memory bound, not CPU bound); the files are in the page cache, as right
after a save: loading from a cold disk adds the same read time to every variant, so the ratios shrink.
Usage: ``python benchmarks/checkpoint_verify.py [--rounds 7] [--gigabytes 1]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe  # noqa: E402

warnings.filterwarnings("ignore")


def make_model(gigabytes: float) -> nn.Module:
    layers = max(1, round(gigabytes * 2**30 / (2048 * 2048 * 4)))  # 16 MB per layer
    return nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(layers)))


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def single_file_variants(folder: Path, model: nn.Module) -> dict[str, Callable[[], None]]:
    from torch.utils.serialization import config

    from fabriclite import Fabric
    from fabriclite import checkpoint as ckpt
    from fabriclite.checkpoint.files import atomic_write

    fabric = Fabric(accelerator="cpu")
    state = {"model": model}
    raw_path, ours, theirs = folder / "raw.pt", folder / "fabriclite.ckpt", folder / "lightning.ckpt"

    def torch_save(crc: bool) -> Callable[[], None]:
        def save() -> None:
            config.save.compute_crc32 = crc
            try:
                torch.save(model.state_dict(), raw_path)
            finally:
                config.save.compute_crc32 = True

        return save

    def fabric_save_without_crc() -> None:
        # fabric.save's own steps (the checkpoint dict, atomic write, fsync) with torch's CRC-32 off: the same save
        # without the checksums the file carries.
        checkpoint = ckpt.to_checkpoint(state, ckpt.capture_meta(fabric.strategy, fabric._precision))
        config.save.compute_crc32 = False
        try:
            atomic_write(ours_unchecked, lambda f: torch.save(checkpoint, f))
        finally:
            config.save.compute_crc32 = True

    ours_unchecked = folder / "fabriclite-unchecked.ckpt"
    variants = {
        "save: torch.save, CRC-32 off": torch_save(False),
        "save: torch.save, CRC-32 on": torch_save(True),
        "save: fabriclite without checksums": fabric_save_without_crc,
        "save: fabriclite": lambda: fabric.save(ours, state),
        "load: torch.load + load_state_dict": lambda: model.load_state_dict(torch.load(raw_path, weights_only=True)),
        "load: fabriclite, verify=False": lambda: fabric.load(ours, state, verify=False),
        "load: fabriclite, verify=True": lambda: fabric.load(ours, state),
    }
    if importlib.util.find_spec("lightning") is not None:
        from lightning.fabric import Fabric as LightningFabric

        lightning = LightningFabric(accelerator="cpu", devices=1)
        variants["save: lightning_fabric"] = lambda: lightning.save(theirs, state)
        variants["load: lightning_fabric"] = lambda: lightning.load(theirs, state)
    torch_save(True)()  # every file exists before the first load
    fabric.save(ours, state)
    if "save: lightning_fabric" in variants:
        variants["save: lightning_fabric"]()
    return variants


def sharded_variants(folder: Path, model: nn.Module) -> dict[str, Callable[[], None]]:
    from fabriclite import Fabric
    from fabriclite.checkpoint.integrity import MANIFEST_FILE, digest
    from fabriclite.strategies import FSDPStrategy

    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
    state = {"model": fabric.setup(model)}
    path = folder / "sharded.ckpt"
    fabric.save(path, state)
    files = [entry.name for entry in path.iterdir() if entry.name != MANIFEST_FILE]
    return {
        "save: fabriclite sharded": lambda: fabric.save(path, state),
        "part of that save: the manifest's checksums": lambda: digest(path, files),
        "load: fabriclite sharded, verify=False": lambda: fabric.load(path, state, verify=False),
        "load: fabriclite sharded, verify=True": lambda: fabric.load(path, state),
    }


def measure(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(timed(variants[name]))
    return times


def table(times: dict[str, list[float]], baselines: dict[str, str]) -> list[str]:
    """Median seconds; the median and quartiles of the per-round ratios to the baseline; and the best-round ratio
    (fastest round over the baseline's fastest: other processes only ever slow a round down)."""
    lines = [
        "| variant | s (median) | ratio (median) | ratio p25-p75 | best-round ratio | to |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, values in times.items():
        base = baselines.get(name)
        if base is None:
            lines.append(f"| {name} | {statistics.median(values):.3f} | | | | |")
            continue
        ratios = sorted(v / b for v, b in zip(values, times[base]))
        low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        best = min(values) / min(times[base])
        lines.append(
            f"| {name} | {statistics.median(values):.3f} | {statistics.median(ratios):.3f}x | {low:.3f}-{high:.3f} "
            f"| {best:.3f}x | {base} |"
        )
    return lines


BASELINES = {
    "save: torch.save, CRC-32 on": "save: torch.save, CRC-32 off",
    "save: fabriclite without checksums": "save: torch.save, CRC-32 off",
    "save: fabriclite": "save: fabriclite without checksums",
    "save: lightning_fabric": "save: torch.save, CRC-32 off",
    "load: fabriclite, verify=False": "load: torch.load + load_state_dict",
    "load: fabriclite, verify=True": "load: fabriclite, verify=False",
    "load: lightning_fabric": "load: torch.load + load_state_dict",
    "part of that save: the manifest's checksums": "save: fabriclite sharded",
    "load: fabriclite sharded, verify=True": "load: fabriclite sharded, verify=False",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="Rounds of every variant (default: 7).")
    parser.add_argument("--gigabytes", type=float, default=1.0, help="Size of the checkpoint (default: 1).")
    parser.add_argument("--format", choices=["file", "sharded"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="Where to write the files (default: a temporary folder).")
    args = parser.parse_args()
    if args.format is None:  # each format in its own process: FSDP sets up a process group
        print("\n".join(describe()), flush=True)
        for kind in ("file", "sharded"):
            command = [sys.executable, __file__, "--format", kind, "--rounds", str(args.rounds)]
            command += ["--gigabytes", str(args.gigabytes)] + (["--dir", args.dir] if args.dir else [])
            code = os.spawnv(os.P_WAIT, sys.executable, command)
            if code:
                sys.exit(code)
        return
    torch.set_num_threads(os.cpu_count() or 1)
    folder = Path(tempfile.mkdtemp(dir=args.dir, prefix="checkpoint-verify-"))
    try:
        model = make_model(args.gigabytes)
        size = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
        make = single_file_variants if args.format == "file" else sharded_variants
        times = measure(make(folder, model), args.rounds)
        print(f"\n{args.format}: {size:.2f} GiB of parameters, {args.rounds} rounds, page cache warm\n")
        print("\n".join(table(times, BASELINES)), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
