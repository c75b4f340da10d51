"""Per-rank memory of parameters + gradients + AdamW state under FSDP2 against DDP, and the step time of one process,
DDP and FSDP on 2 processes, for a small ViT-like model (patch embedding, 6 transformer blocks of width 256, head).

Memory counts the storage behind each rank's parameters, gradients and optimizer state after a step (for FSDP the
local shards, with their padding); DDP's gradient buckets are not counted, which favours DDP. Peak RSS is the whole
process (Python and torch included), for scale. Step time is the median over the timed steps; every variant sees
the same global batch (one process takes all of it, two processes half each), on the CPU, one thread per process
when there are two.

Each variant runs in its own processes. Usage: ``python benchmarks/fsdp_memory.py [--steps 20] [--batch 32]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = {"one process": ("single_device", 1), "DDP, 2 processes": ("ddp", 2), "FSDP, 2 processes": ("fsdp", 2)}
GOAL = 0.55


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, num_heads=4, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, dim: int = 256, depth: int = 6, patches: int = 64, patch_size: int = 48, classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(patch_size, dim)
        self.position = nn.Parameter(torch.randn(1, patches, dim) * 0.02)
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(depth)))
        self.head = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x) + self.position).mean(1))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def run_variant(strategy: str, devices: int, steps: int, batch: int) -> None:
    from fabriclite import Fabric, seed_everything

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    seed_everything(0, verbose=False)
    model = ViT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    per_rank = batch // devices
    x, y = torch.randn(per_rank, 64, 48), torch.randint(0, 10, (per_rank,))
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad()
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        fabric.barrier()
        if step >= 3:
            times.append(time.perf_counter() - start)
    params = list(model.parameters())
    result = {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times),
        "threads": torch.get_num_threads(),
    }
    results = fabric.strategy.all_gather_object(result)
    if fabric.is_global_zero:
        print("RESULT " + json.dumps(results), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="global batch (images of 64 patches)")
    parser.add_argument("--run", choices=[s for s, _ in VARIANTS.values()], help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run_variant(args.run, args.devices, args.steps, args.batch)
        gc.collect()  # free the sharded model before the process group closes at exit (pytorch/pytorch#190489)
        return

    from _machine import describe

    rows = {}
    for name, (strategy, devices) in VARIANTS.items():
        command = [sys.executable, __file__, "--run", strategy, "--devices", str(devices)]
        command += ["--steps", str(args.steps), "--batch", str(args.batch)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
        rows[name] = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])

    total = sum(p.numel() for p in ViT().parameters())
    mb = 1024 * 1024
    print(f"ViT: 6 blocks of width 256, {total / 1e6:.2f} M parameters; AdamW; global batch {args.batch}")
    print("\n".join(describe()))
    print()
    print(
        "| variant | per rank: params + grads + AdamW state | ratio to DDP | peak RSS per rank | step time | samples/s |"
    )
    print("|---|---|---|---|---|---|")
    ddp_bytes = max(r["params"] + r["grads"] + r["optimizer"] for r in rows["DDP, 2 processes"])
    for name, ranks in rows.items():
        state = max(r["params"] + r["grads"] + r["optimizer"] for r in ranks)
        step = max(r["step_s"] for r in ranks)
        rss = max(r["peak_rss"] for r in ranks)
        print(
            f"| {name} ({ranks[0]['threads']} thread{'s' if ranks[0]['threads'] > 1 else ''} each) | "
            f"{state / mb:.1f} MB | {state / ddp_bytes:.2f}x | {rss / mb:.0f} MB | {step * 1000:.0f} ms | "
            f"{args.batch / step:.0f} |"
        )
    fsdp = max(r["params"] + r["grads"] + r["optimizer"] for r in rows["FSDP, 2 processes"]) / ddp_bytes
    print(f"\nFSDP / DDP memory: {fsdp:.2f}x (goal <= {GOAL}x): {'met' if fsdp <= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
