"""Throughput of fabriclite.metrics next to torchmetrics (when installed), and the memory of binned AUROC.

Throughput: 1M samples fed through ``update`` in batches, then one ``compute``, for multiclass accuracy, macro F1,
and binary AUROC exact and binned. The variants run interleaved, round after round, so that a slow spell of the
machine hits both alike; a variant's time is its median over the rounds, and the ratio is torchmetrics' median time
over fabriclite's (above 1: fabriclite is faster). Both run with argument validation on (their default) and one
CPU thread.

Memory: binned AUROC fed ever more samples in a fresh process each time; the state does not grow, nor does the
peak resident memory beyond the batch being processed. Exact AUROC is shown beside it for contrast.

Usage: ``python benchmarks/metrics.py [--samples 1000000] [--batch 10000] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
from _machine import describe

NUM_CLASSES = 10
THRESHOLDS = 200


def make_inputs(samples: int, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, NUM_CLASSES, (samples,), generator=g)
    logits = torch.randn(samples, NUM_CLASSES, generator=g)
    logits[torch.arange(samples), target] += 1.0
    binary_target = torch.randint(0, 2, (samples,), generator=g)
    scores = (torch.rand(samples, generator=g) + 0.3 * binary_target).clamp(max=1.0)
    return {"multiclass": (logits, target), "binary": (scores, binary_target)}


def cases(package: Any) -> dict[str, tuple[Callable[[], Any], str]]:
    """Metric factories by case name, with the inputs each one takes."""
    return {
        "multiclass accuracy": (lambda: package.Accuracy(task="multiclass", num_classes=NUM_CLASSES), "multiclass"),
        "multiclass macro F1": (
            lambda: package.F1Score(task="multiclass", num_classes=NUM_CLASSES, average="macro"),
            "multiclass",
        ),
        "binary AUROC, exact": (lambda: package.AUROC(task="binary"), "binary"),
        f"binary AUROC, binned ({THRESHOLDS} thresholds)": (
            lambda: package.AUROC(task="binary", thresholds=THRESHOLDS),
            "binary",
        ),
    }


def time_once(make: Callable[[], Any], preds: torch.Tensor, target: torch.Tensor, batch: int) -> float:
    metric = make()
    start = time.perf_counter()
    for i in range(0, preds.shape[0], batch):
        metric.update(preds[i : i + batch], target[i : i + batch])
    metric.compute()
    return time.perf_counter() - start


def throughput(samples: int, batch: int, rounds: int) -> list[str]:
    import fabriclite.metrics as ours

    try:
        import torchmetrics as theirs
    except ImportError:
        theirs = None
    inputs = make_inputs(samples)
    variants = {"fabriclite": cases(ours)} | ({"torchmetrics": cases(theirs)} if theirs else {})
    times: dict[tuple[str, str], list[float]] = {}
    for name in cases(ours):
        for variant in variants.values():  # warm-up: first calls pay for lazy initialisation
            make, kind = variant[name]
            time_once(make, *(t[: 10 * batch] for t in inputs[kind]), batch)
    for r in range(rounds):
        for name in cases(ours):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for label in order:
                make, kind = variants[label][name]
                times.setdefault((label, name), []).append(time_once(make, *inputs[kind], batch))

    lines = [
        f"Throughput: {samples:,} samples in batches of {batch:,}, update + compute, median of {rounds} rounds",
        "",
        "| metric | fabriclite (M samples/s) | torchmetrics (M samples/s) | ratio (torchmetrics time / fabriclite time) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name in cases(ours):
        ours_s = statistics.median(times[("fabriclite", name)])
        if theirs:
            theirs_s = statistics.median(times[("torchmetrics", name)])
            lines.append(
                f"| {name} | {samples / ours_s / 1e6:.1f} | {samples / theirs_s / 1e6:.1f} | {theirs_s / ours_s:.2f} |"
            )
        else:
            lines.append(f"| {name} | {samples / ours_s / 1e6:.1f} | not installed | - |")
    return lines


def memory_child(package: str, thresholds: int | None, samples: int, batch: int) -> dict[str, float]:
    """Run in a fresh process: feed ``samples`` to an AUROC, report its state size and peak RSS growth."""
    torch.set_num_threads(1)
    metrics = __import__("fabriclite.metrics" if package == "fabriclite" else package, fromlist=["AUROC"])
    metric = metrics.AUROC(task="binary", thresholds=thresholds)
    g = torch.Generator().manual_seed(0)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(batch, generator=g), torch.randint(0, 2, (batch,), generator=g)

    metric.update(*next_batch())  # the first batch sets up whatever is lazily allocated
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(samples // batch - 1):
        metric.update(*next_batch())
    metric.compute()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    state = 0
    for name in metric._defaults:
        value = getattr(metric, name)
        state += (
            sum(v.numel() * v.element_size() for v in value)
            if isinstance(value, list)
            else value.numel() * value.element_size()
        )
    return {"state_bytes": state, "peak_growth_kib": peak - baseline}


def memory(batch: int) -> list[str]:
    def measure(package: str, thresholds: int | None, samples: int) -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-child", json.dumps([package, thresholds, samples, batch])],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    try:
        import torchmetrics  # noqa: F401

        have_theirs = True
    except ImportError:
        have_theirs = False
    lines = [
        f"Memory of binary AUROC (batches of {batch:,}; peak RSS growth after the first batch, in a fresh process)",
        "",
        "| samples | binned state | binned peak growth | exact state | exact peak growth |"
        + (" torchmetrics binned peak growth |" if have_theirs else ""),
        "| ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if have_theirs else ""),
    ]
    for samples in (100_000, 1_000_000, 4_000_000):
        binned = measure("fabriclite", THRESHOLDS, samples)
        exact = measure("fabriclite", None, samples)
        row = (
            f"| {samples:,} | {binned['state_bytes'] / 1024:.1f} KiB | {binned['peak_growth_kib'] / 1024:.1f} MiB "
            f"| {exact['state_bytes'] / 2**20:.1f} MiB | {exact['peak_growth_kib'] / 1024:.1f} MiB |"
        )
        if have_theirs:
            row += f" {measure('torchmetrics', THRESHOLDS, samples)['peak_growth_kib'] / 1024:.1f} MiB |"
        lines.append(row)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(*json.loads(args.memory_child))))
        return
    torch.set_num_threads(1)
    print("\n".join([*describe(), f"- torch threads: {torch.get_num_threads()}", ""]))
    print("\n".join(throughput(args.samples, args.batch, args.rounds)))
    print()
    print("\n".join(memory(args.batch)))


if __name__ == "__main__":
    main()
