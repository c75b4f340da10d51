"""``torch.compile`` as one switch: which arguments it takes, what gets compiled, and a report of what the
compiler did.

What gets compiled (``compile_model``): by default each repeated block of the model (the transformer blocks of a
``nn.ModuleList``), in place, as torchtitan and PyTorch's regional-compilation recipe do. The blocks share one
code object, so Dynamo compiles the first and reuses its graph for the siblings: a 12-block model compiles about
as fast as one block. A model without repeated blocks, or ``compile={"regional": False}``, is compiled whole.
Unless ``dynamic`` is given, the batch dimension of each compiled call's tensor inputs is marked dynamic, so a
last partial batch or a new evaluation batch size runs the graph already compiled; switching between train and
eval compiles once per mode.

The report reads TorchDynamo's own counters (graphs compiled, graph breaks and their reasons) after the first
forward call of a model set up with ``compile=...`` and when asked; it is a diagnosis, not a gate, so it never
slows a step after the first few.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch

from fabriclite._blocks import repeated_blocks

# After this many forward calls the watch stops: recompiling still then means shapes change every step.
_WATCHED_CALLS = 8
_RECOMPILES_BEFORE_WARNING = 3


# fabriclite's own keys in a compile dict, next to torch.compile's arguments.
_OWN_KEYS = ("regional",)


def compile_kwargs(value: Any, where: str = "compile") -> dict[str, Any] | None:
    """Turn ``compile=False | True | dict`` into keyword arguments for ``torch.compile`` plus fabriclite's own
    ``regional`` (None: don't compile).

    Usage: ``compile_kwargs({"mode": "max-autotune"}) == {"mode": "max-autotune"}``.
    """
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        if not isinstance(value.get("regional", True), bool):
            raise TypeError(f"{where}: 'regional' must be True or False, got {value['regional']!r}.")
        valid = [name for name in inspect.signature(torch.compile).parameters if name != "model"] + list(_OWN_KEYS)
        unknown = [key for key in value if key not in valid]
        if unknown:
            from fabriclite.choices import did_you_mean

            raise ValueError(
                f"{where}={value!r} has keys torch.compile does not take: {unknown}. Valid keys: "
                f"{', '.join(valid)}.{did_you_mean(unknown[0], valid)}"
            )
        return dict(value)
    raise TypeError(f"{where}={value!r} is not valid: expected False, True or a dict of torch.compile arguments.")


def compile_model(
    forward_module: torch.nn.Module, original: torch.nn.Module, strategy: Any, options: dict[str, Any]
) -> tuple[torch.nn.Module, list[str]]:
    """Compile ``original``'s repeated blocks in place, or, without them or with ``regional=False``, the whole
    ``forward_module`` through the strategy (around DDP; per FSDP unit, then the root). Returns the module that
    runs and the names of the compiled regions (empty: the whole model).

    Usage: ``forward_module, regions = compile_model(ddp_model, model, strategy, {"mode": "max-autotune"})``.
    """
    options = dict(options)
    regional = options.pop("regional", True)
    blocks = _regions(original) if regional else []
    if not blocks:
        return strategy.compile_module(forward_module, options), []
    mark_batch = options.get("dynamic") is None
    names = {id(module): name for name, module in original.named_modules()}
    for block in blocks:
        _compile_in_place(block, options, mark_batch)
    return forward_module, [names[id(block)] for block in blocks]


def _regions(module: torch.nn.Module) -> list[torch.nn.Module]:
    # A repeated single layer (the Linears of an nn.Sequential MLP) is not worth a region: the rest would run eager.
    return [block for block in repeated_blocks(module) if next(block.children(), None) is not None]


def _compile_in_place(block: torch.nn.Module, options: dict[str, Any], mark_batch: bool) -> None:
    # What nn.Module.compile does (the module stays the same object: state_dict keys, hooks and FSDP units keep
    # working), plus marking the batch dimension dynamic before each call, outside the traced code (Dynamo
    # refuses mark_dynamic inside it). A batch of 1 still compiles once more: Dynamo specializes sizes 0 and 1.
    compiled = torch.compile(block._call_impl, **options)
    if not mark_batch:
        block._compiled_call_impl = compiled
        return
    mark = torch._dynamo.maybe_mark_dynamic

    def call(*args: Any, **kwargs: Any) -> Any:
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.dim() > 0:
                mark(arg, 0)
        return compiled(*args, **kwargs)

    block._compiled_call_impl = call


def _counters() -> tuple[int, int, dict[str, int]]:
    from torch._dynamo.utils import counters

    breaks = dict(counters["graph_break"])
    return counters["stats"]["unique_graphs"], sum(breaks.values()), breaks


class CompileWatch:
    """Watches the first forward calls of one compiled model and remembers what the compiler did.

    ``regions``: the names of the compiled blocks (empty: the whole model was compiled). Usage: made by
    ``fabric.setup(..., compile=True)``; read through ``fabric.compile_report()``.
    """

    def __init__(self, name: str, regions: list[str] | None = None) -> None:
        self.name = name
        self.regions = regions or []
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
        """Graphs and graph breaks after the first step, recompiles since (train/eval switches, new shapes), the
        compiled regions, and the break reasons (first lines). TorchDynamo's counters are the process's: with
        several compiled models, recompiles after the first step add up across them."""
        base = {"model": self.name, "compiled": "regional" if self.regions else "whole", "regions": self.regions}
        if self._after_first is None:
            return {**base, "calls": 0, "graphs": 0, "graph_breaks": 0, "recompiles": 0, "break_reasons": []}
        graphs, breaks, reasons = self._after_first
        start_graphs, start_breaks, start_reasons = self._start
        new_reasons = [
            reason.splitlines()[0] for reason, count in reasons.items() if count > start_reasons.get(reason, 0)
        ]
        return {
            **base,
            "calls": self.calls,
            "graphs": graphs - start_graphs,
            "graph_breaks": breaks - start_breaks,
            "recompiles": _counters()[0] - graphs,
            "break_reasons": new_reasons,
        }
