"""The pretend world a plan runs a script in: this process is one global rank (0 unless told) of ``devices *
num_nodes`` processes, the others of which do not exist. Nothing is started and nothing is sent: the process group
is torch's fake one (every collective returns at once, an all-gather hands each rank's slot this rank's data),
every tensor the script makes is a fake tensor (shape, dtype and device, no memory, ``FakeTensorMode``), and the
script stops once its optimizers stepped ``steps`` times (``PlanStop``).

What a fake tensor cannot give is a value. When the script reads one (``loss.item()``, ``if torch.isfinite(norm)``),
``ValueReads`` answers with a stand-in and notes where: 0 for numbers, and for a truth value what a healthy run
sees (finite is true; NaN, inf and any other test false), so the script takes its usual path. Data keeps its real
values: the loaders ``fabric.setup_dataloaders`` returns draw their sample order outside the fake mode.

Usage::

    with FakeWorld(world_size=16, steps=2, settings={"FABRICLITE_CLI_DEVICES": "8"}) as world:
        runpy.run_path("train.py", run_name="__main__")   # raises PlanStop after the second optimizer step
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fabriclite._versions_fake import (
    READ_VALUE,
    fake_process_group,
    fake_tensor_mode,
    is_fake,
    real_tensors,
    tensors_in,
    torch_dispatch_mode,
    unknown_value,
)

# What would make the script's Fabric join another launcher's job instead of the planned one.
_FOREIGN_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "SLURM_NTASKS", "SLURM_PROCID", "GROUP_RANK", "LOCAL_WORLD_SIZE")


class PlanStop(BaseException):
    """Raised from the optimizer step that ends the plan. A BaseException, so a script's ``except Exception``
    cannot swallow it."""


@dataclass
class ValueRead:
    """One value the script read from a fake tensor, and the stand-in it got."""

    where: str  # "train.py:183 in evaluate"
    dtype: str
    given: Any


@dataclass
class Observed:
    """What the plan saw of the script's Fabric: the models and optimizers ``fabric.setup`` returned, as they
    were used."""

    modules: list[Any] = field(default_factory=list)  # _FabricModule, in the order of their first forward
    optimizers: list[Any] = field(default_factory=list)  # _FabricOptimizer, in the order of their first step
    steps: int = 0


def _user_frame(skip_prefixes: tuple[str, ...]) -> str:
    """ "file:line in function" of the innermost frame outside torch and fabriclite: where the script read."""
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip_prefixes):
            return f"{os.path.relpath(frame.filename)}:{frame.lineno} in {frame.name}"
    return "?"


_LIBRARIES = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)), "<frozen")

# How a healthy run answers a truth value computed by these functions (any other: False, "nothing happened").
_HEALTHY_TRUTHS = {"isfinite": lambda *values: True}
_HEALTHY_TRUTHS.update({name: lambda x, *rest: x for name in ("all", "any", "clone", "detach")})
_HEALTHY_TRUTHS.update({name: lambda x, *rest: not x for name in ("logical_not", "__invert__")})
_HEALTHY_TRUTHS.update({name: lambda x, y=False, *rest: x or y for name in ("logical_or", "__or__", "__ror__")})
_HEALTHY_TRUTHS.update({name: lambda x, y=False, *rest: x and y for name in ("logical_and", "__and__", "__rand__")})


class HealthyTruths(torch.overrides.TorchFunctionMode):
    """Notes on each fake truth value what a healthy run would find: ``torch.isfinite(norm)`` true, ``isnan`` false,
    ``logical_not``/``all``/``any``/``and``/``or`` of those as the rules say. Seen at torch's Python API, where
    ``isfinite`` is one call (below it, it is several comparisons)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        rule = _HEALTHY_TRUTHS.get(getattr(func, "__name__", ""))
        if rule is not None and isinstance(out, torch.Tensor) and out.dtype == torch.bool and is_fake(out):
            truths = [getattr(a, "_plan_healthy", False) if isinstance(a, torch.Tensor) else bool(a) for a in args]
            out._plan_healthy = bool(rule(*truths))
        return out


class ValueReads(torch_dispatch_mode()):
    """Answers reads of fake values (``READ_VALUE``: ``.item()``, ``bool()``, ``.tolist()``) with a
    stand-in, and records each read (``reads``)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[ValueRead] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is READ_VALUE and unknown_value(args[0]):
            return self._stand_in(args[0])
        return func(*args, **(kwargs or {}))

    def _stand_in(self, tensor: torch.Tensor) -> Any:
        if tensor.dtype == torch.bool:
            value: Any = bool(getattr(tensor, "_plan_healthy", False))
        elif tensor.is_floating_point():
            value = 0.0
        else:
            value = 0
        self.reads.append(ValueRead(_user_frame(_LIBRARIES), str(tensor.dtype).replace("torch.", ""), value))
        return value


class RealStaysReal(torch_dispatch_mode()):
    """An op whose tensor inputs are all real computes for real: what the plan keeps real (a device mesh's rank
    numbers, pickled objects, a loader's sample order) stays real through what torch computes from it. FSDP2 and
    DTensor build meshes of meshes inside ``fully_shard`` (tensor parallel x FSDP), finding this rank in them with
    ``nonzero``, which fake tensors cannot answer. Ops that make tensors from nothing (the model's weights) and ops
    on any fake tensor stay fake."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = tensors_in((args, kwargs))
        if inputs and not any(is_fake(t) or type(t) is not torch.Tensor for t in inputs):
            with real_tensors():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


@contextmanager
def _environment(variables: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    for name in _FOREIGN_LAUNCHERS:
        os.environ.pop(name, None)
    os.environ.update(variables)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class FakeWorld:
    """Global ``rank`` of ``world_size`` pretend processes on a fake process group, under ``FakeTensorMode``; stops
    the script with ``PlanStop`` after ``steps`` optimizer steps. ``settings`` are ``FABRICLITE_CLI_*`` variables for
    the script's ``Fabric()``, as ``fabriclite run`` exports them (its devices per node place the rank on a node).

    While it runs: ``observed`` (the set-up models and optimizers), ``reads`` (values read from fake tensors);
    ``trackers`` are extra dispatch modes entered above the fake mode (the memory tracker).
    """

    def __init__(
        self,
        world_size: int,
        steps: int = 2,
        settings: dict[str, str] | None = None,
        trackers: tuple[Any, ...] = (),
        rank: int = 0,
    ) -> None:
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "fabriclite plan runs the script as one rank of a pretend world on a process group of its own, but this "
                "process has one already. Plan from a fresh process (the `fabriclite plan` command, or a notebook "
                "kernel that has not joined a process group)."
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank!r} is not a rank of a world of {world_size}: expected 0 to {world_size - 1}.")
        self.world_size, self.steps, self.rank = world_size, steps, rank
        self.settings = settings or {}
        self.trackers = trackers
        self.observed = Observed()
        self.value_reads = ValueReads()
        self._stack = ExitStack()

    @property
    def reads(self) -> list[ValueRead]:
        return self.value_reads.reads

    def __enter__(self) -> FakeWorld:
        try:
            self._enter(self._stack)
        except BaseException:
            self._stack.close()  # what was entered before the failure is given back
            raise
        return self

    def _enter(self, stack: ExitStack) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        devices = int(self.settings.get("FABRICLITE_CLI_DEVICES", self.world_size))
        stack.enter_context(
            _environment(
                {
                    "RANK": str(self.rank),
                    "LOCAL_RANK": str(self.rank % devices),
                    "NODE_RANK": str(self.rank // devices),
                    "WORLD_SIZE": str(self.world_size),
                    "MASTER_ADDR": "127.0.0.1",  # never contacted: the fake group has no store to meet at
                    "MASTER_PORT": "29500",
                    "FABRICLITE_LAUNCHER": "fabriclite plan",
                    **self.settings,
                }
            )
        )
        fake_process_group(self.world_size, self.rank)
        stack.callback(dist.destroy_process_group)
        stack.enter_context(register_module_forward_pre_hook(self._on_forward))
        stack.enter_context(register_optimizer_step_pre_hook(self._on_step_start))
        stack.enter_context(register_optimizer_step_post_hook(self._on_step_end))
        stack.enter_context(fake_tensor_mode())
        stack.enter_context(RealStaysReal())
        for tracker in self.trackers:
            stack.enter_context(tracker)
        stack.enter_context(self.value_reads)
        stack.enter_context(HealthyTruths())

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ what the script does, seen through hooks
    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        from fabriclite.wrappers import _FabricModule

        # The set-up model calls its inner module without nn.Module's hooks: find it a few frames up.
        wrapper = _calling(_FabricModule, depth=8)
        if wrapper is not None and not any(m is wrapper for m in self.observed.modules):
            self.observed.modules.append(wrapper)
            for tracker in self.trackers:
                tracker.on_first_forward(wrapper)

    def _on_step_start(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        from fabriclite.wrappers import _FabricOptimizer

        wrapper = _calling(_FabricOptimizer, depth=30)  # the optimizer hooks see only the optimizer inside it
        if wrapper is not None and not any(o is wrapper for o in self.observed.optimizers):
            self.observed.optimizers.append(wrapper)
        for tracker in self.trackers:
            tracker.on_step_start(optimizer, self.observed.modules)

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for tracker in self.trackers:
            tracker.on_step_end(optimizer)
        self.observed.steps += 1
        if self.observed.steps >= self.steps:
            raise PlanStop(f"stopped after optimizer step {self.observed.steps}")


def _calling(kind: type, depth: int) -> Any:
    """The object of class ``kind`` whose method is running within ``depth`` frames above the caller, or None."""
    frame = sys._getframe(2)
    while frame is not None and depth > 0:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, kind):
            return candidate
        frame, depth = frame.f_back, depth - 1
    return None
