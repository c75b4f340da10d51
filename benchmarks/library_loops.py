"""overhead.py's four variants on any device: the body of a training loop as users of raw PyTorch, fabriclite,
Lightning Fabric and Accelerate write it, and the interleaved timing of those loops. gpu_suite.py compares them on
the ViT step and on overhead.py's tiny model.

Usage::

    runners = {}
    for name in FRAMEWORKS:
        loader, step = build(name, "bf16-mixed", device, make_model_and_optimizer, make_loader())
        runners[name] = (forever(loader), step)
    milliseconds = interleaved(runners, rounds=10, steps=50, warmup=5, device=device)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

FRAMEWORKS = ("raw", "fabriclite", "lightning_fabric", "accelerate")
Step = Callable[[torch.Tensor, torch.Tensor], None]
ModelAndOptimizer = Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queue to drain (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable[..., Any], batches: Iterator, steps: int, device: torch.device) -> float:
    """Seconds per step of ``steps`` steps, the device's queue drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(*next(batches))
    synchronize(device)
    return (time.perf_counter() - start) / max(steps, 1)


def build(
    name: str, precision: str, device: torch.device, make: ModelAndOptimizer, loader: Optional[Iterable] = None
) -> tuple[Optional[Iterable], Step]:
    """The body of a training loop as a user of ``name`` writes it, and ``loader`` passed through that library's
    wrapper (None: the batches already sit on the device). overhead.py's variants, on any device."""
    mixed = precision == "bf16-mixed"
    if name == "raw":
        model, optimizer = make()
        model.to(device)

        def raw_step(x: torch.Tensor, y: torch.Tensor) -> None:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

        return loader, raw_step
    if name in ("fabriclite", "lightning_fabric"):
        if name == "fabriclite":
            from fabriclite import Fabric
        else:
            try:
                from lightning.fabric import Fabric
            except ImportError:
                from lightning_fabric import Fabric
        fabric = Fabric(accelerator=device.type, devices=1, precision=precision)
        fabric.launch()
        model, optimizer = fabric.setup(*make())
        loader = fabric.setup_dataloaders(loader) if loader is not None else None

        def fabric_step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = F.cross_entropy(model(x), y)  # the wrapped forward gives fp32 outputs under bf16-mixed
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()

        return loader, fabric_step
    if name == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision="bf16" if mixed else "no")
        model, optimizer = make()
        if loader is None:
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

        def accelerate_step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = F.cross_entropy(model(x), y)  # the prepared forward gives fp32 outputs under bf16
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()

        return loader, accelerate_step
    raise ValueError(f"unknown variant {name!r}")


def interleaved(
    runners: dict[str, tuple[Iterator, Step]],
    rounds: int,
    steps: int,
    warmup: int,
    device: torch.device,
    stop: Callable[[], bool] = lambda: False,
) -> dict[str, list[float]]:
    """Milliseconds per step of each variant in each round: every round runs every variant for ``steps`` steps in
    a rotating order, each after ``warmup`` untimed steps, so a slow spell of the machine hits all of them alike.
    Ends early, after two rounds at least, once ``stop()`` says so.

    Usage: ``interleaved({name: (batches, step), ...}, rounds=10, steps=50, warmup=5, device=device)``.
    """
    for batches, step in runners.values():
        timed(step, batches, 2 * warmup, device)
    gc.collect()
    gc.freeze()  # what exists now lives to the end: keep it out of the collector's scans
    names = list(runners)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        if round_index >= 2 and stop():
            break
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            batches, step = runners[name]
            timed(step, batches, warmup, device)
            timings[name].append(1e3 * timed(step, batches, steps, device))
    gc.unfreeze()
    return timings
