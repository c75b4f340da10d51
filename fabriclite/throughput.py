"""Throughput and model FLOP utilization (MFU); Lightning Fabric has it at ``lightning.fabric.utilities.throughput``,
and so do we.

``measure_flops`` counts the FLOPs of one step with ``torch.utils.flop_counter`` (build the model on the meta device
and it costs no memory); ``Throughput`` turns running totals into rates over a sliding window; ``ThroughputMonitor``
takes the device's peak from the Fabric (a table of dense, not sparse, peaks by GPU and dtype) and logs through
``fabric.log_dict``. Rates appear from the second update on, over the updates in the window so far.

Usage::

    flops_per_batch = measure_flops(meta_model, lambda: meta_model(meta_x), lambda y: y.sum())
    monitor = ThroughputMonitor(fabric, window_size=50)
    for i, batch in enumerate(loader, 1):
        ...
        monitor.update(time=time.perf_counter() - t0, batches=i, samples=i * batch_size, flops=flops_per_batch)
        if i % 10 == 0:
            monitor.compute_and_log(step=i)   # device/samples_per_sec, device/mfu, ...
"""

from __future__ import annotations

import re
import warnings
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import torch

from fabriclite.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from fabriclite.fabric import Fabric

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops", "peak_flops"]

# Dense peak FLOP/s of one device from the vendors' data sheets (the sparsity figures are twice these and no dense
# model reaches them). Matched against torch.cuda.get_device_name() in this order; "tf32" is fp32 matmuls on
# tensor cores, used when torch.get_float32_matmul_precision() is not "highest".
_T = 1e12
PEAK_FLOPS: list[tuple[str, dict[Any, float]]] = [
    (
        "h200",
        {
            torch.float64: 67 * _T,
            torch.float32: 67 * _T,
            "tf32": 494.7 * _T,
            torch.bfloat16: 989.4 * _T,
            torch.float16: 989.4 * _T,
        },
    ),
    (
        "h100 nvl",
        {
            torch.float64: 60 * _T,
            torch.float32: 60 * _T,
            "tf32": 417.5 * _T,
            torch.bfloat16: 835.5 * _T,
            torch.float16: 835.5 * _T,
        },
    ),
    (
        "h100 pcie",
        {
            torch.float64: 51 * _T,
            torch.float32: 51.2 * _T,
            "tf32": 378 * _T,
            torch.bfloat16: 756 * _T,
            torch.float16: 756 * _T,
        },
    ),
    (
        "h100",
        {
            torch.float64: 67 * _T,
            torch.float32: 66.9 * _T,
            "tf32": 494.7 * _T,
            torch.bfloat16: 989.4 * _T,
            torch.float16: 989.4 * _T,
        },
    ),
    (
        "a100",
        {
            torch.float64: 19.5 * _T,
            torch.float32: 19.5 * _T,
            "tf32": 156 * _T,
            torch.bfloat16: 312 * _T,
            torch.float16: 312 * _T,
        },
    ),
    ("l40s", {torch.float32: 91.6 * _T, "tf32": 183 * _T, torch.bfloat16: 362 * _T, torch.float16: 362 * _T}),
    ("l4", {torch.float32: 30.3 * _T, "tf32": 60 * _T, torch.bfloat16: 121 * _T, torch.float16: 121 * _T}),
    ("a10", {torch.float32: 31.2 * _T, "tf32": 62.5 * _T, torch.bfloat16: 125 * _T, torch.float16: 125 * _T}),
    ("rtx 4090", {torch.float32: 82.6 * _T, "tf32": 82.6 * _T, torch.bfloat16: 165.2 * _T, torch.float16: 165.2 * _T}),
    ("v100", {torch.float64: 7.8 * _T, torch.float32: 15.7 * _T, torch.float16: 125 * _T}),
    ("t4", {torch.float32: 8.1 * _T, torch.float16: 65 * _T}),
]
_warned: set[str] = set()


def get_available_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The dense peak FLOP/s of ``device`` computing in ``dtype``, or None where there is none to compare with (a
    CPU, an unknown GPU, a dtype the GPU has no tensor cores for): then no MFU is reported.

    Usage: ``get_available_flops(torch.device("cuda"), torch.bfloat16)``  # 989.4e12 on an H100 SXM
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key: Any = dtype
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    peak = peak_flops(name, key)
    if peak is None and name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"No peak FLOP/s is known for {name!r} in {key}, so no MFU is reported. Pass "
            "ThroughputMonitor(fabric, available_flops=<dense peak FLOP/s of one device>) to get it.",
            stacklevel=3,
        )
    return peak


def peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """The dense peak FLOP/s in ``PEAK_FLOPS`` for a GPU named ``device_name`` (as CUDA names it) computing in
    ``dtype`` ("tf32" for fp32 matmuls on tensor cores), or None when the table has none.

    Usage: ``peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16)``  # 989.4e12
    """
    for pattern, peaks in PEAK_FLOPS:
        if re.search(rf"\b{pattern}\b", device_name.lower()):
            return peaks.get(dtype)
    return None


def measure_flops(
    model: torch.nn.Module,
    forward_fn: Callable[[], Any],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> int:
    """The FLOPs of ``forward_fn()`` (a forward pass of ``model``), and of ``loss_fn(output).backward()`` as well
    when ``loss_fn`` is given: a training step counts about 3x its forward. Counted by
    ``torch.utils.flop_counter``, so only what it knows (matmuls, convolutions, attention) is counted.

    Usage::

        with torch.device("meta"):
            model, x = GPT(config), torch.randint(0, 50257, (8, 1024))
        flops_per_step = measure_flops(model, lambda: model(x), lambda logits: logits.sum())
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        output = forward_fn()
        if loss_fn is not None:
            loss_fn(output).backward()
    if loss_fn is not None:
        model.zero_grad(set_to_none=True)  # leave no (meta) gradients behind for the real step to add to
    return counter.get_total_flops()


class Throughput:
    """Rates from running totals over the last ``window_size`` updates: batches, samples, items (tokens, say: pass
    ``lengths``) and FLOPs per second per device, and across the ``world_size`` devices (assumed alike), and MFU
    against ``available_flops`` (the peak FLOP/s of one device).

    ``update`` takes totals since the start (``time`` in seconds, ``batches``, ``samples``, ``lengths``) and the
    FLOPs of this update alone (``flops``, per device); ``compute`` returns a dict with ``time``, ``batches``,
    ``samples`` (and ``lengths``), and once ``window_size`` updates have filled the window (as Lightning: a rate
    over fewer would be noisier than the window asked for) ``device/samples_per_sec`` ... ``device/mfu``, plus
    ``samples_per_sec`` ... ``flops_per_sec`` across devices when ``world_size > 1`` (as Lightning: no global
    ``mfu``, which would equal ``device/mfu``).

    Usage: ``t = Throughput(available_flops=312e12); t.update(time=1.5, batches=2, samples=64); t.compute()``.
    """

    def __init__(
        self, available_flops: float | None = None, world_size: int = 1, window_size: int = 100, separator: str = "/"
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int >= 1.")
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 2:
            raise ValueError(f"window_size={window_size!r} must be an int >= 2: a rate needs two updates.")
        if available_flops is not None and not available_flops > 0:
            raise ValueError(f"available_flops={available_flops!r} must be > 0, or None for no MFU.")
        self.available_flops = available_flops
        self.world_size = world_size
        self.window_size = window_size
        self.separator = separator
        self._totals: dict[str, deque] = {}
        self._flops: deque = deque(maxlen=window_size)

    def update(
        self, *, time: float, batches: int, samples: int, lengths: int | None = None, flops: float | None = None
    ) -> None:
        """Record the totals so far (``time`` since the start, increasing; ``batches``, ``samples``, ``lengths``: each
        at least its previous value) and ``flops``, the FLOPs per device since the last update. The errors have
        Lightning's types and phrases, checked in its order (time first)."""
        self._check_increases("time", time, strictly=True)  # a zero interval has no rate
        if samples < batches:
            raise ValueError(
                f"Expected samples ({samples}) to be greater or equal than batches ({batches}): each batch has at "
                "least one sample."
            )
        if lengths is not None and lengths < samples:
            raise ValueError(
                f"Expected lengths ({lengths}) to be greater or equal than samples ({samples}): each sample has at "
                "least one item."
            )
        totals = {"time": time, "batches": batches, "samples": samples}
        if lengths is not None:
            totals["lengths"] = lengths
        for name in ("batches", "samples", "lengths"):
            if name in totals:
                self._check_increases(name, totals[name], strictly=False)
        if self._totals and set(totals) != set(self._totals):
            raise RuntimeError(
                f"update() was given {sorted(totals)} after {sorted(self._totals)}: if lengths are passed, there needs "
                "to be the same number of samples; pass lengths at every update or never."
            )
        for name, value in totals.items():
            self._totals.setdefault(name, deque(maxlen=self.window_size)).append(value)
        if flops is not None:
            self._flops.append(flops)

    def _check_increases(self, name: str, value: float, strictly: bool) -> None:
        last = self._totals[name][-1] if self._totals.get(name) else None
        if last is not None and (value < last or (strictly and value == last)):
            raise ValueError(
                f"Expected the value to increase, last: {last}, current: {value} ({name}={value} after {name}={last}): "
                "pass totals since the start, not increments."
            )

    def compute(self) -> dict[str, float]:
        """The totals of the last update and the rates over the window (see the class)."""
        if not self._totals:
            return {}
        metrics: dict[str, float] = {name: window[-1] for name, window in self._totals.items()}
        time = self._totals["time"]
        elapsed = time[-1] - time[0]
        if len(time) < self.window_size or elapsed <= 0:
            return metrics
        device = f"device{self.separator}"
        for name, rate in (
            ("batches", "batches_per_sec"),
            ("samples", "samples_per_sec"),
            ("lengths", "items_per_sec"),
        ):
            if name in self._totals:
                per_device = (self._totals[name][-1] - self._totals[name][0]) / elapsed
                metrics[device + rate] = per_device
                if self.world_size > 1:
                    metrics[rate] = per_device * self.world_size
        # The first update's FLOPs were done before the window's first time stamp.
        if len(self._flops) == self.window_size:
            per_device = sum(list(self._flops)[1:]) / elapsed
            metrics[device + "flops_per_sec"] = per_device
            if self.world_size > 1:
                metrics["flops_per_sec"] = per_device * self.world_size
            if self.available_flops:
                metrics[device + "mfu"] = per_device / self.available_flops  # a utilization: no total across devices
        return metrics

    def reset(self) -> None:
        """Forget every update (say, after a validation pause that should not count)."""
        self._totals.clear()
        self._flops.clear()


class ThroughputMonitor(Throughput):
    """``Throughput`` for a Fabric: the world size and the device's peak FLOP/s in the precision's compute dtype come
    from it, and ``compute_and_log`` logs through ``fabric.log_dict``. As in Lightning, it counts on rank 0 only
    (other ranks get ``{}``) and multiplies by the world size for the totals across devices.

    Usage: ``monitor = ThroughputMonitor(fabric, window_size=20); ...; monitor.compute_and_log(step=i)``.
    """

    def __init__(self, fabric: Fabric, available_flops: float | None = None, **kwargs: Any) -> None:
        if available_flops is None:
            available_flops = get_available_flops(fabric.device, _compute_dtype(fabric))
        super().__init__(available_flops=available_flops, world_size=fabric.world_size, **kwargs)
        self._fabric = fabric
        self.step = -1

    # Rank 0 as ``rank_zero_only`` knows it (what a parallel strategy sets), as in Lightning: a stand-in for the
    # Fabric (a test's mock) counts as rank 0 too.
    def update(self, **totals: Any) -> None:
        if rank_zero_only.rank == 0:
            super().update(**totals)

    def compute(self) -> dict[str, float]:
        return super().compute() if rank_zero_only.rank == 0 else {}

    def compute_and_log(self, step: int | None = None) -> dict[str, float]:
        """Compute the metrics and log them at ``step`` (by default one more than the last call's)."""
        self.step = self.step + 1 if step is None else step
        metrics = self.compute()
        if metrics:
            self._fabric.log_dict(metrics=metrics, step=self.step)  # Lightning's keywords (mocks compare them)
        return metrics


def _compute_dtype(fabric: Fabric) -> torch.dtype:
    # The dtype the matmuls run in: autocast's for mixed precision, the weights' for true precision.
    name = getattr(fabric.strategy.precision, "name", "32-true")
    return {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}.get(name.split("-")[0], torch.float32)
