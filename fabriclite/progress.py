"""A tqdm progress bar that shows samples/s and live metrics, and costs nothing when it is off.

The Fabric exposes it as ``fabric.progress(loader, desc=...)``, switched off on ranks other than 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# Formatting a metric calls .item(), which waits for the GPU; doing it at most ~5 times a second keeps
# the bar from slowing the step it measures.
_REFRESH_SECONDS = 0.2


def progress(
    iterable: Iterable[T],
    desc: str | None = None,
    total: int | None = None,
    enable: bool | None = None,
    **tqdm_kwargs: Any,
) -> ProgressBar[T]:
    """Wrap ``iterable`` in a progress bar showing samples/s and the metrics given to ``set_metrics``.

    ``enable=None`` shows the bar only when it writes to a terminal (``sys.stderr`` unless ``file=`` is
    given), so logs redirected to a file stay clean; ``True``/``False`` force it on or off. Other keyword
    arguments go to ``tqdm.tqdm``.

    Usage::

        bar = progress(loader, desc="train")
        for batch in bar:
            loss = step(batch)
            bar.set_metrics(loss=loss)
    """
    if enable is None:
        stream = tqdm_kwargs.get("file") or sys.stderr
        isatty = getattr(stream, "isatty", None)
        enable = bool(isatty is not None and isatty())
    return ProgressBar(iterable, desc=desc, total=total, enable=enable, tqdm_kwargs=tqdm_kwargs)


class ProgressBar(Generic[T]):
    """What ``progress()`` returns: iterating it yields the items of the wrapped iterable unchanged.

    Usage: ``bar = progress(loader); for batch in bar: bar.set_metrics(loss=loss)``
    """

    def __init__(
        self,
        iterable: Iterable[T],
        desc: str | None,
        total: int | None,
        enable: bool,
        tqdm_kwargs: Mapping[str, Any],
    ) -> None:
        self._iterable = iterable
        self._desc = desc
        self._total = total
        self._enabled = enable
        self._tqdm_kwargs = dict(tqdm_kwargs)
        self._metrics: dict[str, Any] = {}

    @property
    def enabled(self) -> bool:
        """Whether the bar is shown."""
        return self._enabled

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        if not self._enabled:
            # Off (other ranks, redirected output): hand out the iterable's own iterator, zero overhead.
            return iter(self._iterable)
        return self._iterate()

    def set_metrics(self, **values: Any) -> None:
        """Show ``values`` (numbers or 0-dim tensors) after the bar; does nothing when the bar is off.

        Usage: ``bar.set_metrics(loss=loss, lr=scheduler.get_last_lr()[0])``
        """
        if not self._enabled:
            return
        for key, value in values.items():
            # detach() costs no GPU sync and lets the step's graph be freed before the next refresh.
            self._metrics[key] = value.detach() if hasattr(value, "detach") else value

    def _iterate(self) -> Iterator[T]:
        from tqdm import tqdm  # lazily: only a rank that shows a bar pays for it

        total = self._total
        if total is None and hasattr(self._iterable, "__len__"):
            total = len(self._iterable)  # type: ignore[arg-type]
        bar = tqdm(total=total, desc=self._desc, **self._tqdm_kwargs)
        start = window_start = time.perf_counter()
        samples = window_samples = 0
        try:
            for item in self._iterable:
                yield item
                # Counted once the loop body has run, so the rate covers loading and the step.
                count = _batch_size(item)
                if count is None:
                    count = 1
                samples += count
                window_samples += count
                now = time.perf_counter()
                if now - window_start >= _REFRESH_SECONDS:
                    self._set_postfix(bar, window_samples / (now - window_start))
                    window_start, window_samples = now, 0
                bar.update(1)
            self._set_postfix(bar, samples / max(time.perf_counter() - start, 1e-9))
        finally:
            bar.close()

    def _set_postfix(self, bar: Any, samples_per_second: float) -> None:
        parts = [f"{key}={_format(value)}" for key, value in self._metrics.items()]
        parts.append(f"samples/s={samples_per_second:.1f}")
        # No refresh here: tqdm redraws on its own schedule, so the postfix adds no extra writes.
        bar.set_postfix_str(", ".join(parts), refresh=False)


def _format(value: Any) -> str:
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _batch_size(batch: Any) -> int | None:
    """The first dimension of the first tensor (or array) in ``batch``, searched depth first; None if none."""
    shape = getattr(batch, "shape", None)
    if shape is not None and len(shape) > 0:
        return int(shape[0])
    if isinstance(batch, Mapping):
        batch = batch.values()
    elif not isinstance(batch, (list, tuple)):
        return None
    for element in batch:
        size = _batch_size(element)
        if size is not None:
            return size
    return None
