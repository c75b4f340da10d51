"""Plan a run before launching it: ``fabriclite plan --devices 8 --num-nodes 128 train.py ...`` runs the script,
unchanged, as global rank 0 (or ``--rank N``) of the 1,024 processes it would have, in this one process, with no
GPU and nobody else started: torch's fake process group, every tensor a fake one (``world.py``), the real
``Fabric``, strategy, precision and ``fabric.backward``, until the script's optimizers stepped twice (the second
step is the steady state: its backward holds the optimizer's state too). Then it reports the configuration
fabriclite resolved, the rank's memory at the peak of the steps by kind (``memory.py``), the kinds of rank whose
shards differ (``ranks.py``), and the error the real run would raise (``report.py``); with a device memory, it
plans again at other batch sizes for the largest micro-batch that fits (``batch.py``).

Usage::

    from fabriclite.plan import plan_script
    plan = plan_script("examples/gpt/train.py", ["--quick"], devices=8, num_nodes=2, device_memory="80GiB")
    print(plan.format())
"""

from __future__ import annotations

import os
import re
import runpy
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

from fabriclite._versions_fake import forget_sharding_specs, is_fake_limit
from fabriclite.data import planned_batch_size
from fabriclite.plan.batch import largest_batch
from fabriclite.plan.memory import MemoryTracker
from fabriclite.plan.ranks import rank_kinds, shards_of
from fabriclite.plan.report import Plan, describe, format_bytes
from fabriclite.plan.traffic import CollectiveCounter, checkpoint_bytes
from fabriclite.plan.world import FakeWorld, PlanStop
from fabriclite.strategies.fsdp import without_activation_checkpointing

__all__ = ["Plan", "parse_bytes", "plan_script", "format_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
# Where fabriclite's setup runs: an error raised inside one of these is one the real run raises before its steps.
_SETUP_CALLS = {"__init__", "launch", "setup", "setup_module", "setup_optimizers", "setup_dataloaders", "init_module"}


def parse_bytes(text: str | int) -> int:
    """``"80GiB"`` -> ``85899345920``; also GB (powers of 10), MiB, a plain number of bytes.

    Usage: ``parse_bytes("141GB")``."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f"device memory {text!r} is not a size: expected a number with a unit, such as 80GiB, 141GB or 24576MiB."
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def plan_script(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    devices: int = 1,
    num_nodes: int = 1,
    device_memory: str | int | None = None,
    settings: dict[str, str] | None = None,
    steps: int = 2,
    rank: int = 0,
) -> Plan:
    """Run ``script`` with ``args`` as global ``rank`` of ``devices * num_nodes`` processes on fake tensors, stop
    it after ``steps`` optimizer steps, and return what was found. ``settings`` are more ``FABRICLITE_CLI_*``
    variables for the script's ``Fabric()`` (accelerator, strategy, precision), as ``fabriclite run`` exports them.

    Usage: ``print(plan_script("train.py", ["--strategy", "fsdp"], devices=8, num_nodes=128).format())``.
    """
    for name, value in (("devices", devices), ("num_nodes", num_nodes), ("steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < devices * num_nodes:
        raise ValueError(
            f"rank={rank!r} is not a rank of {devices} x {num_nodes} processes: expected 0 to "
            f"{devices * num_nodes - 1}."
        )
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise ValueError(f"script {script!r} does not exist (relative paths start at {os.getcwd()}).")
    memory = None if device_memory is None else parse_bytes(device_memory)
    world_size = devices * num_nodes
    variables = {"FABRICLITE_CLI_DEVICES": str(devices), "FABRICLITE_CLI_NUM_NODES": str(num_nodes), **(settings or {})}
    plan = Plan(script, world_size, devices, num_nodes, rank, device_memory=memory)
    start = time.perf_counter()
    script_sizes = _trace(plan, args, variables, steps)
    if plan.memory is not None and "activation checkpointing" in dict(plan.configuration):
        without = Plan(script, world_size, devices, num_nodes, rank)
        with without_activation_checkpointing():
            _trace(without, args, variables, steps)
        if without.memory is not None:
            activations = without.memory["activations and temporaries"]
            plan.without_checkpointing = {"peak_bytes": without.peak_bytes, "activations": activations}
    if memory is not None and plan.memory is not None and plan.error is None and plan.limit is None:

        def trace(batch_size: int) -> Plan:  # the same plan at another micro-batch
            again = Plan(script, world_size, devices, num_nodes, rank, device_memory=memory)
            _trace(again, args, variables, steps, batch_size)
            return again

        plan.batch = largest_batch(plan, script_sizes, trace)
    plan.seconds = time.perf_counter() - start
    return plan


def _trace(plan: Plan, args: Sequence[str], variables: dict[str, str], steps: int, batch_size: int | None = None):
    """Run the script once in a fake world and fill in ``plan``; with ``batch_size``, the loaders set up by
    ``fabric.setup_dataloaders`` batch that many samples. Returns the batch sizes the script gave its loaders."""
    tracker, counter = MemoryTracker(), CollectiveCounter()
    forget_sharding_specs()  # a plan before this one in this process may have been another rank's
    shards = None
    world = FakeWorld(plan.world_size, steps=steps, settings=variables, trackers=(tracker, counter), rank=plan.rank)
    with world, _script_context(plan.script, args), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # each warning once per place, as a run shows them
        with planned_batch_size(batch_size) as script_sizes:
            try:
                runpy.run_path(plan.script, run_name="__main__")
            except PlanStop:
                pass
            except SystemExit as stop:
                plan.exit_code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except Exception as error:  # the script's own error, fabriclite's refusal of its configuration, or a limit
                if is_fake_limit(error):
                    plan.limit = _explain(error)[0]
                else:
                    plan.error, plan.error_at_setup = _explain(error)
        plan.steps = world.observed.steps
        plan.configuration = describe(world.observed)
        plan.reads = list(world.reads)
        plan.warnings = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in caught))
        if plan.steps:
            plan.memory = tracker.peak_by_kind()
            plan.peak_bytes = tracker.step_peak
        if plan.steps == steps:  # the last step traced whole: the steady state
            plan.collectives = counter.by_collective(step=steps - 1)
            strategy = next((o._strategy for o in world.observed.optimizers if o._strategy is not None), None)
            plan.checkpoint = checkpoint_bytes(
                world.observed.modules, world.observed.optimizers, strategy, plan.world_size, plan.rank
            )
        plan.setup_peak_bytes = tracker.setup_peak
        if world.observed.modules:
            shards = shards_of(world.observed.modules)
    if shards is not None:
        plan.kinds = rank_kinds(shards, plan.world_size, plan.rank)
    return script_sizes


class _script_context:  # noqa: N801 - used as a context manager, named like one
    """``sys.argv`` and ``sys.path[0]`` as ``python script.py args`` sets them, restored afterwards."""

    def __init__(self, script: str, args: Sequence[str]) -> None:
        self.argv = [script, *args]
        self.path0 = os.path.dirname(os.path.abspath(script))

    def __enter__(self) -> None:
        self.saved = (sys.argv, list(sys.path))
        sys.argv = self.argv
        sys.path.insert(0, self.path0)

    def __exit__(self, *exc_info: Any) -> None:
        sys.argv, sys.path[:] = self.saved


def _explain(error: BaseException) -> tuple[str, bool]:
    """("ValueError: message (from file:line)", whether fabriclite's setup raised it)."""
    frames = traceback.extract_tb(error.__traceback__)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    at_setup = any(f.filename == os.path.join(package, "fabric.py") and f.name in _SETUP_CALLS for f in frames)
    user = [f for f in frames if not f.filename.startswith(package) and "site-packages" not in f.filename]
    where = f" (from {os.path.relpath(user[-1].filename)}:{user[-1].lineno})" if user else ""
    return f"{type(error).__name__}: {error}{where}", at_setup
