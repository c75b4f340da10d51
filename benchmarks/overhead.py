"""Per-step overhead of fabriclite on a tiny training loop, next to the same loop in raw PyTorch, Lightning Fabric
and Accelerate.

The model (Linear(32, 32), ReLU, Linear(32, 2), batch 16, SGD, one CPU thread) is so small that a step is mostly
Python, so whatever a wrapper adds per step (its data loader, forward, backward and optimizer step) shows in the
ratio to raw. Each variant runs its loader through its own wrapper, as a user would.

The variants run interleaved: every round runs each of them for ``--steps`` steps in a rotating order, after a
few untimed steps, so a slow spell of the machine hits all of them alike. Time is the process's CPU time: the
loop runs on one thread, so on a quiet machine that equals wall time, and on a shared one it leaves out the time
spent waiting for a core, the largest part of the noise there. A variant's ratio to raw is the median of its
per-round ratios; their quartiles show how noisy the machine was. The ratio of the fastest rounds (a variant's
best round over raw's) is a second estimate, which other processes can only slow, never speed up.

Each precision runs in its own process, because Accelerate keeps its mixed precision in a process-wide
singleton that refuses a second value.

Usage: ``python benchmarks/overhead.py [--rounds 50] [--steps 256] [--precision 32-true bf16-mixed]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Callable

import torch
import torch.nn.functional as F
from _machine import describe
from torch.utils.data import DataLoader, TensorDataset

PRECISIONS = ("32-true", "bf16-mixed")
SAMPLES = 4096
BATCH_SIZE = 16
BATCHES_PER_EPOCH = SAMPLES // BATCH_SIZE
WARMUP_STEPS = 2 * BATCHES_PER_EPOCH  # once, at setup
ROUND_WARMUP_STEPS = 16  # before each timed segment, to bring the variant back into the caches
GOAL = 1.03

Step = Callable[[torch.Tensor, torch.Tensor], None]


def make_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights in every variant
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def make_loader() -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 32, generator=generator)
    y = torch.randint(0, 2, (SAMPLES,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH_SIZE, shuffle=True)


# Each variant returns its loader and the body of its training loop, written as a user of that library writes it.
def raw(precision: str) -> tuple[DataLoader, Step]:
    model, optimizer = make_model_and_optimizer()

    def step_fp32(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def step_bf16(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return make_loader(), step_bf16 if precision == "bf16-mixed" else step_fp32


def _fabric_variant(fabric_class: type, precision: str) -> tuple[DataLoader, Step]:
    """fabriclite and Lightning Fabric share the API, so they share the loop."""
    fabric = fabric_class(accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    model, optimizer = fabric.setup(*make_model_and_optimizer())
    loader = fabric.setup_dataloaders(make_loader())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)  # the wrapped forward gives fp32 outputs under bf16-mixed
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    return loader, step


def fabriclite(precision: str) -> tuple[DataLoader, Step]:
    from fabriclite import Fabric

    return _fabric_variant(Fabric, precision)


def lightning_fabric(precision: str) -> tuple[DataLoader, Step]:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        from lightning_fabric import Fabric
    return _fabric_variant(Fabric, precision)


def accelerate(precision: str) -> tuple[DataLoader, Step]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if precision == "bf16-mixed" else "no")
    model, optimizer = make_model_and_optimizer()
    model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.cross_entropy(model(x), y)  # the prepared forward gives fp32 outputs under bf16
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()

    return loader, step


VARIANTS: dict[str, Callable[[str], tuple[DataLoader, Step]]] = {
    "raw": raw,
    "fabriclite": fabriclite,
    "lightning_fabric": lightning_fabric,
    "accelerate": accelerate,
}


def forever(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches epoch after epoch; a new epoch starts the loader's iterator anew, as a training loop does."""
    while True:
        yield from loader


def run_steps(batches: Iterator, step: Step, steps: int) -> float:
    """Run ``steps`` steps and return the CPU microseconds per step."""
    start = time.process_time_ns()
    for _ in range(steps):
        x, y = next(batches)
        step(x, y)
    return (time.process_time_ns() - start) / steps / 1000


def measure(precision: str, rounds: int, steps: int) -> dict[str, list[float]]:
    """Per-round microseconds per step of every importable variant, in one process."""
    runners = {}
    for name, build in VARIANTS.items():
        try:
            loader, step = build(precision)
        except ImportError as error:
            print(f"skipping {name}: {error}", file=sys.stderr)
            continue
        batches = forever(loader)
        run_steps(batches, step, WARMUP_STEPS)
        runners[name] = (batches, step)
    # What exists now lives to the end: keep it out of the collector's scans, which then cost every variant alike.
    gc.collect()
    gc.freeze()
    names = list(runners)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            batches, step = runners[name]
            run_steps(batches, step, ROUND_WARMUP_STEPS)
            timings[name].append(run_steps(batches, step, steps))
    return timings


def measure_in_child(precision: str, rounds: int, steps: int) -> dict[str, list[float]]:
    command = [
        sys.executable,
        __file__,
        "--precision",
        precision,
        "--rounds",
        str(rounds),
        "--steps",
        str(steps),
        "--json",
    ]
    # The libraries' own chatter (banners, exit-time warnings) is shown only when the child fails.
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {precision} failed:\n{result.stderr}")
    return json.loads(result.stdout.splitlines()[-1])  # the last line: a library may have printed before it


def ratios_to_raw(timings: dict[str, list[float]], name: str) -> list[float]:
    return [t / r for t, r in zip(timings[name], timings["raw"])]


def table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    lines = [
        "| variant | precision | CPU us/step (median) | ratio vs raw (median) | ratio p25-p75 | best-round ratio |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for precision, timings in results.items():
        for name, per_round in timings.items():
            ratios = ratios_to_raw(timings, name)
            low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            lines.append(
                f"| {name} | {precision} | {statistics.median(per_round):.1f} | "
                f"{statistics.median(ratios):.3f}x | {low:.3f}-{high:.3f} | "
                f"{min(per_round) / min(timings['raw']):.3f}x |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50, help="interleaved rounds (default: 50)")
    parser.add_argument(
        "--steps",
        type=int,
        default=BATCHES_PER_EPOCH,
        help=f"timed steps per variant per round; a multiple of {BATCHES_PER_EPOCH} (one epoch) "
        "gives every segment the same number of epoch starts (default: %(default)s)",
    )
    parser.add_argument("--precision", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child's answer to its parent
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.json:
        print(json.dumps(measure(args.precision[0], args.rounds, args.steps)))
        return
    if len(args.precision) == 1:
        results = {args.precision[0]: measure(args.precision[0], args.rounds, args.steps)}
    else:
        results = {p: measure_in_child(p, args.rounds, args.steps) for p in args.precision}

    print(
        f"Per-step time of a tiny loop ({args.rounds} interleaved rounds of {args.steps} steps, "
        f"torch.set_num_threads(1), CPU):\n"
    )
    print("\n".join(describe()))
    print()
    print("\n".join(table(results)))
    print()
    for precision, timings in results.items():
        ratio = statistics.median(ratios_to_raw(timings, "fabriclite"))
        print(f"goal fabriclite <= {GOAL}x raw at {precision}: {'met' if ratio <= GOAL else 'MISSED'} ({ratio:.3f}x)")


if __name__ == "__main__":
    main()
