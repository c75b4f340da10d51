"""Peak resident memory of each rank while ``fabric.load_raw`` loads a full state dict of about 1 GB into a model
sharded by FSDP on 2 CPU processes (the model built under ``init_module(empty_init=True)``, as LitGPT's finetuning
scripts do), against each rank loading the whole file itself (``torch.load``, then ``load_state_dict`` of its
slices), which is what every rank did before ``load_raw`` knew sharded models.

The model: 16 blocks of ``Linear(4096, 4096)`` (268 M parameters, 1.07 GB in fp32). Each figure is the rank's peak
RSS (``VmHWM``, reset just before loading) minus its RSS just before loading, where it already holds its half of
the weights. Rank 0 maps the file (torch's ``mmap``): the pages it reads count in its RSS while mapped; "file
pages mapped after" (``RssFile`` at the end, above its value before) shows they are let go once loaded. Goal: rank
0 at most about one copy of the file, the other ranks about one tensor (67 MB) above their shards.

Usage: ``python benchmarks/load_raw_memory.py [--dir DIR]`` (writes the 1 GB file there, then removes it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

WIDTH, DEPTH = int(os.environ.get("WIDTH", 4096)), 16
VARIANTS = {"every rank reads the whole file (torch.load)": "whole", "fabric.load_raw": "load_raw"}


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def run_variant(variant: str, path: str) -> None:
    from torch.distributed.tensor import distribute_tensor

    from fabriclite import Fabric
    from fabriclite.strategies import FSDPStrategy

    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={nn.Linear}))
    fabric.launch()
    with fabric.init_module(empty_init=True):
        model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    model = fabric.setup(model)
    gc.collect()
    fabric.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    baseline, file_baseline = status("VmRSS"), status("RssFile")
    if variant == "load_raw":
        fabric.load_raw(path, model)
    else:
        full = torch.load(path, weights_only=True, map_location="cpu")
        own = model.state_dict()
        with torch.no_grad():
            for name, tensor in own.items():
                piece = distribute_tensor(full[name], tensor.device_mesh, tensor.placements, src_data_rank=None)
                tensor.to_local().copy_(piece.to_local())
        del full
    fabric.barrier()
    sums = fabric.all_gather(torch.tensor([float(model.state_dict()["3.weight"].full_tensor().sum())]))
    result = {
        "baseline": baseline,
        "peak": status("VmHWM"),
        "file": status("RssFile") - file_baseline,
        "sum": sums[0].item(),
    }
    for rank, r in enumerate(fabric.strategy.all_gather_object(result)):
        if fabric.is_global_zero:
            print("RESULT " + json.dumps({"rank": rank, **r}), flush=True)
    del model
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--dir", default=None, help="where to write the 1 GB state dict (default: a temp dir)")
    args = parser.parse_args()
    if args.run:
        run_variant(args.run, args.path)
        return

    from _machine import describe

    gb = 1e9
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "lit_model.pth"
        torch.manual_seed(0)
        torch.save(nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).state_dict(), path)
        size = path.stat().st_size
        print(f"State dict: {DEPTH} x Linear({WIDTH}, {WIDTH}), {size / gb:.2f} GB; FSDP on 2 CPU processes")
        print("\n".join(describe()))
        print()
        print("| variant | rank | RSS before (its shards) | peak above it | file pages mapped after | of the file |")
        print("|---|---:|---:|---:|---:|---:|")
        sums = set()
        for name, variant in VARIANTS.items():
            command = [sys.executable, __file__, "--run", variant, "--path", str(path)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True, env=env)
            for line in out.stdout.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[7:])
                    sums.add(r["sum"])
                    above = r["peak"] - r["baseline"]
                    print(
                        f"| {name} | {r['rank']} | {r['baseline'] / gb:.2f} GB | {above / gb:.2f} GB | "
                        f"{r['file'] / gb:.2f} GB | {above / size:.2f}x |",
                        flush=True,
                    )
        assert len(sums) == 1, f"the variants loaded different weights: {sums}"


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
