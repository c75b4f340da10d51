"""What Fabric's own collectives and a training step cost on 2 gloo processes: ``fabric.all_reduce`` of one number
(as a loop logs its loss), ``fabric.barrier()``, and a DDP step of a small model (forward, backward with its
gradient all-reduce, optimizer step), next to ``torch.distributed.all_reduce`` of one number on the default group.

The question it answers: does running Fabric's calls over a group of their own (``ParallelStrategy.calls_group``,
which lets a call made on some ranks only be named instead of pairing with the training's collectives) cost the
loop anything? ``fabric.all_reduce(group=WORLD)`` is the same call over the default group, as before that change,
measured in the same rounds; running the script on the code before and after compares the rest. Variants run
interleaved, round after round; each number is the median over rounds of the mean per call within a round, in
microseconds of wall time (a collective waits for the other rank: CPU time would leave out the wait).

Usage: ``python benchmarks/collective_calls.py [--rounds 30] [--calls 200]`` (rank 0 prints the table).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from _machine import describe

from fabriclite import Fabric


def timed(action, calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        action()
    return (time.perf_counter_ns() - start) / calls / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, one = torch.randn(16, 64), torch.ones(())

    def step() -> None:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    variants = {
        "dist.all_reduce (default group)": lambda: dist.all_reduce(one.clone()),
        "fabric.all_reduce": lambda: fabric.all_reduce(one),
        "fabric.all_reduce(group=WORLD)": lambda: fabric.all_reduce(one, group=dist.group.WORLD),
        "fabric.barrier": fabric.barrier,
        "DDP step": step,
    }
    for action in variants.values():
        timed(action, 20)  # warm up
    results: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:  # the same order on both ranks: the calls pair up
            results[name].append(timed(variants[name], args.calls))
    if fabric.is_global_zero:
        print("\n".join(describe()))
        print(f"\n{args.rounds} rounds of {args.calls} calls, 2 gloo processes\n")
        print("| call | us per call (median) | quartiles |\n|---|---|---|")
        for name, values in results.items():
            q1, median, q3 = statistics.quantiles(values, n=4)
            print(f"| {name} | {median:.0f} | {q1:.0f} to {q3:.0f} |")


if __name__ == "__main__":
    main()
