"""``torch.compile`` as one switch: which arguments it takes, and a report of what the compiler did.

The report reads TorchDynamo's own counters (graphs compiled, graph breaks and their reasons) around the first
forward calls of a model set up with ``compile=...``; it is a diagnosis, not a gate, so it never slows a step after
the first few.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch

# After this many forward calls the watch stops: recompiling still then means shapes change every step.
_WATCHED_CALLS = 8
_RECOMPILES_BEFORE_WARNING = 3


def compile_kwargs(value: Any, where: str = "compile") -> dict[str, Any] | None:
    """Turn ``compile=False | True | dict`` into keyword arguments for ``torch.compile`` (None: don't compile).

    Usage: ``compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune"}``.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        valid = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
        unknown = [key for key in value if key not in valid]
        if unknown:
            from fabriclite.choices import did_you_mean

            raise ValueError(
                f"{where}={value!r} has keys torch.compile does not take: {unknown}. Valid keys: "
                f"{', '.join(valid)}.{did_you_mean(unknown[0], valid)}"
            )
        return dict(value)
    raise TypeError(f"{where}={value!r} is not valid: expected False, True or a dict of torch.compile arguments.")


def _counters() -> tuple[int, int, dict[str, int]]:
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return counters["stats"]["unique_graphs"], sum(breaks.values()), breaks


class CompileWatch:
    """Watches the first forward calls of one compiled model and remembers what the compiler did.

    Usage: made by ``fabric.setup(..., compile=True)``; read through ``fabric.compile_report()``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self._start = _counters()
        self._after_first: tuple[int, int, dict[str, int]] | None = None
        self._last_graphs = self._start[0]
        self._growth_streak = 0
        self.recompiling_every_step = False

    def wrap(self, forward: Callable[..., Any], stop: Callable[[], None]) -> Callable[..., Any]:
        """``forward`` with counting around it, calling ``stop`` once the watch has seen enough calls."""

        def watched(*args: Any, **kwargs: Any) -> Any:
            output = forward(*args, **kwargs)
            self._after_call()
            if self.calls >= _WATCHED_CALLS:
                stop()
            return output

        return watched

    def _after_call(self) -> None:
        self.calls += 1
        graphs = _counters()[0]
        if self.calls == 1:
            self._after_first = _counters()
        else:
            self._growth_streak = self._growth_streak + 1 if graphs > self._last_graphs else 0
            if self._growth_streak >= _RECOMPILES_BEFORE_WARNING and not self.recompiling_every_step:
                self.recompiling_every_step = True
                warnings.warn(
                    f"torch.compile recompiled {self.name} on each of the last {self._growth_streak} steps: the input "
                    "shapes probably change every step. Pass compile={'dynamic': True} (or pad inputs to fixed shapes).",
                    UserWarning,
                    stacklevel=4,
                )
        self._last_graphs = graphs

    def report(self) -> dict[str, Any]:
        """Graphs and graph breaks after the first step, recompiles since, and the break reasons (first lines)."""
        if self._after_first is None:
            return {
                "model": self.name,
                "calls": 0,
                "graphs": 0,
                "graph_breaks": 0,
                "recompiles": 0,
                "break_reasons": [],
            }
        graphs, breaks, reasons = self._after_first
        start_graphs, start_breaks, start_reasons = self._start
        new_reasons = [
            reason.splitlines()[0] for reason, count in reasons.items() if count > start_reasons.get(reason, 0)
        ]
        return {
            "model": self.name,
            "calls": self.calls,
            "graphs": graphs - start_graphs,
            "graph_breaks": breaks - start_breaks,
            "recompiles": self._last_graphs - graphs,
            "break_reasons": new_reasons,
        }
