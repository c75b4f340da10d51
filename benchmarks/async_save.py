"""What a checkpoint every N steps costs the training loop: ``fabric.save`` synchronous against
``asynchronous=True``, next to the same loop without saving, on 2 CPU processes (DDP, gloo) with a model of about
100 MB per rank (``--megabytes``).

Each round runs ``--steps`` steps of every variant, in an order that rotates from round to round (a slow spell of the
machine hits all alike), saving every ``--every`` steps but not at the last step (so every write overlaps training)
into a temporary folder (``keep_last=1``). Reported on rank 0:

- the time a save holds the loop, per save: the ``fabric.save`` call (an asynchronous save: waiting for the previous
  write, one collective, staging the whole state into host buffers; nothing waits for it later). Every variant
  meets in a barrier where a save would be, outside the timing: the ranks drift apart during the steps and the
  first collective after that waits for the slower one; without the barrier the save's collective would wait it,
  and the next gradient all-reduce that much less;
- the loop's whole time over the loop without saves, per save: this also counts the steps slowed down while the
  background thread writes (on a 2-core machine it takes a core from the ranks);
- and what reading ``fabric.preempted`` costs, read after each of ``--steps`` training steps (median per read).

The goal: an asynchronous save holds the loop at most 10% of a synchronous save's time. Wall time.
Usage: ``python benchmarks/async_save.py [--rounds 5] [--steps 30] [--every 10] [--megabytes 100]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import describe  # noqa: E402

from fabriclite import Fabric  # noqa: E402

VARIANTS = ("no saves", "sync save", "async save")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--megabytes", type=int, default=100)
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    width = 1024
    layers = max(1, round(args.megabytes * 2**20 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)  # no momentum: the checkpoint is the model's size
    model, optimizer = fabric.setup(model, optimizer)
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    batch = torch.randn(16, width)

    results: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}  # loop s, held
    with tempfile.TemporaryDirectory() as folder:
        folder = fabric.broadcast(folder)
        for round_index in range(args.rounds + 1):  # round 0 warms up
            order = VARIANTS[round_index % 3 :] + VARIANTS[: round_index % 3]
            for name in order:
                target = Path(folder) / name.replace(" ", "-")
                loop, held = run(fabric, model, optimizer, batch, name, args, target)
                if round_index:
                    results[name].append((loop, held))
                if fabric.is_global_zero:
                    print(f"round {round_index} {name}: loop {loop:.2f} s, held {held:.3f} s per save", file=sys.stderr)
    # What reading fabric.preempted once per step costs the loop, read where a script reads it: after each step.
    reads = []
    fabric.barrier()
    for _ in range(args.steps):
        train_step(fabric, model, optimizer, batch)
        before = time.perf_counter()
        fabric.preempted  # noqa: B018
        reads.append(time.perf_counter() - before)
    read_us = statistics.median(reads) * 1e6
    if not fabric.is_global_zero:
        return
    saves = saves_per_round(args)
    base = statistics.median(loop for loop, _ in results["no saves"])
    sync_held = statistics.median(held for _, held in results["sync save"])
    print("\n".join(describe()))
    print(
        f"\n2 processes (DDP, gloo), model {megabytes:.0f} MB per rank, {args.steps} steps per round, a save every "
        f"{args.every} steps, {args.rounds} rounds (medians)\n"
    )
    print("| variant | loop s | s held per save | held / sync save | extra loop s per save | extra / sync save |")
    print("|---|---:|---:|---:|---:|---:|")
    sync_extra = (statistics.median(loop for loop, _ in results["sync save"]) - base) / saves
    for name in VARIANTS:
        loop = statistics.median(loop for loop, _ in results[name])
        held = statistics.median(held for _, held in results[name])
        extra = (loop - base) / saves
        if name == "no saves":
            print(f"| {name} | {loop:.3f} | | | | |")
        else:
            print(
                f"| {name} | {loop:.3f} | {held:.3f} | {held / sync_held:.1%} | {extra:.3f} | "
                f"{extra / sync_extra:.1%} |"
            )
    step_ms = base / args.steps * 1e3
    print(
        f"\nReading fabric.preempted after each step: {read_us:.0f} us per read (median), against {step_ms:.0f} ms "
        "per step without saves."
    )


def run(fabric, model, optimizer, batch, name, args, folder: Path) -> tuple[float, float]:
    held = 0.0
    fabric.barrier()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        train_step(fabric, model, optimizer, batch)
        if step % args.every == 0 and step < args.steps:  # each write overlaps steps
            fabric.barrier()  # every variant: the ranks' drift apart is not counted as the save's
            if name == "no saves":
                continue
            before = time.perf_counter()
            state = {"model": model, "optimizer": optimizer, "step": step}
            fabric.save(folder / f"step-{step}.ckpt", state, keep_last=1, asynchronous=name == "async save")
            held += time.perf_counter() - before
    loop = time.perf_counter() - start
    fabric.load_latest(folder / "none", {})  # the last write ends before the next variant starts, outside the timing
    return loop, held / saves_per_round(args)


def train_step(fabric, model, optimizer, batch) -> None:
    loss = model(batch).square().mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()


def saves_per_round(args: argparse.Namespace) -> int:
    return (args.steps - 1) // args.every


if __name__ == "__main__":
    main()
