"""What a plan found, as a ``Plan``: the configuration fabriclite resolved (read off the objects the script's
``Fabric`` built), the memory of the planned rank (``memory.MemoryTracker``), the kinds of rank (``ranks.py``),
the error the run would raise, the values the script read from fake tensors, and what the plan does not estimate
yet. ``Plan.format()`` is what ``fabriclite plan``
prints.

Usage: ``print(plan.format())``; ``plan.peak_bytes``, ``plan.memory["gradients"]``, ``plan.error``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from fabriclite.plan.memory import KINDS
from fabriclite.plan.ranks import rank_ranges

# Figures the issue asks for that no plan computes yet, and why: printed as such, never as numbers.
NOT_ESTIMATED = (
    ("torch.compile, Fabric(kernels=True)", "planned as eager torch ops: compiled kernels may keep less"),
    (
        "collectives DTensor runs inside an op (partial norms while clipping, redistributing an op's input)",
        "torch runs them below the dispatch modes the plan counts with: their bytes and buffers are not counted",
    ),
    (
        "a GPU's attention kernels",
        "activations are those of this machine's kernels (on a CPU, attention's math path); flash attention on "
        "a GPU keeps less",
    ),
)


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``. Usage: ``format_bytes(plan.peak_bytes)``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


@dataclass
class Plan:
    """The outcome of planning one script for one world (``world_size`` = devices x num_nodes), seen from one
    global ``rank``."""

    script: str
    world_size: int
    devices: int
    num_nodes: int
    rank: int = 0
    steps: int = 0  # optimizer steps traced
    configuration: list[tuple[str, str]] = field(default_factory=list)
    memory: dict[str, int] | None = None  # bytes per kind at the peak of the steps (None: no step ran)
    peak_bytes: int | None = None  # the peak of the steps
    setup_peak_bytes: int | None = None  # the peak while the model was built and set up
    device_memory: int | None = None
    error: str | None = None  # "ValueError: ..." that the script raised, with where
    error_at_setup: bool = False
    limit: str | None = None  # what fake tensors could not do, where: the plan stopped there (no error of the run)
    exit_code: int | None = None  # the script called sys.exit(code) before the plan's end
    reads: list[Any] = field(default_factory=list)
    collectives: list[dict[str, Any]] | None = None  # traffic.CollectiveCounter.by_collective of the last step
    checkpoint: dict[str, Any] | None = None  # traffic.checkpoint_bytes: {"sharded", "total", "rank"}
    warnings: list[str] = field(default_factory=list)  # "UserWarning: message", each once, as the run shows them
    batch: dict[str, Any] | None = None  # batch.largest_batch: the largest micro-batch that fits device_memory
    # Where the script checkpoints activations, the plan traced again without: {"peak_bytes", "activations"}.
    without_checkpointing: dict[str, int] | None = None
    kinds: list[dict[str, Any]] | None = None  # ranks.rank_kinds: ranks holding shards of the same shapes
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the plan traced its steps without an error (and the peak fits ``device_memory``, if given)."""
        fits = self.device_memory is None or (self.peak_bytes or 0) <= self.device_memory
        done = self.error is None and self.limit is None and self.exit_code in (None, 0)
        return done and self.memory is not None and fits

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain values (``fabriclite plan --json``): bytes as ints, the configuration as a dict."""
        return {
            "script": self.script,
            "world_size": self.world_size,
            "devices": self.devices,
            "num_nodes": self.num_nodes,
            "rank": self.rank,
            "steps": self.steps,
            "configuration": dict(self.configuration),
            "memory": self.memory,
            "peak_bytes": self.peak_bytes,
            "setup_peak_bytes": self.setup_peak_bytes,
            "device_memory": self.device_memory,
            "error": self.error,
            "error_at_setup": self.error_at_setup,
            "limit": self.limit,
            "exit_code": self.exit_code,
            "collectives": self.collectives,
            "checkpoint": self.checkpoint,
            "values_read": [read.where for read in self.reads],
            "warnings": self.warnings,
            "batch": self.batch,
            "without_activation_checkpointing": self.without_checkpointing,
            "kinds_of_rank": self.kinds,
            "not_estimated": dict(NOT_ESTIMATED),
            "seconds": round(self.seconds, 2),
            "ok": self.ok,
        }

    def format(self) -> str:
        """The report ``fabriclite plan`` prints."""
        lines = [
            f"fabriclite plan: {self.script} as rank {self.rank} of {self.world_size} processes "
            f"({self.devices} per node x {self.num_nodes} node{'s' if self.num_nodes > 1 else ''}), "
            f"{self.steps} optimizer step{'s' if self.steps != 1 else ''} traced on fake tensors in {self.seconds:.1f} s",
            "",
        ]
        if self.error is not None:
            when = "at setup" if self.error_at_setup else "while the steps ran"
            lines += [f"ERROR the real run raises this {when}:", f"  {self.error}", ""]
        elif self.limit is not None:
            lines += [
                "NOT PLANNED past this point: the script needs what fake tensors cannot give (a limit of the plan, "
                "not an error of the run):",
                f"  {self.limit}",
                "",
            ]
        elif self.exit_code not in (None, 0):
            lines += [f"ERROR the script exited with code {self.exit_code} before its steps.", ""]
        if self.configuration:
            lines.append("configuration")
            width = max(len(name) for name, _ in self.configuration)
            lines += [f"  {name:<{width}}  {value}" for name, value in self.configuration]
            lines.append("")
        lines += self._memory_lines()
        lines += self._kind_lines()
        lines += self._batch_lines()
        lines += self._traffic_lines()
        if self.warnings:
            lines.append("warnings the run shows")
            lines += [f"  {_shorten(text)}" for text in self.warnings]
            lines.append("")
        if self.reads:
            places = Counter(read.where for read in self.reads)
            lines.append(
                f"values read: the script read {len(self.reads)} value(s) computed on fake tensors; each got a stand-in "
                "(0, or for a truth value what a healthy run sees), so any number it printed is not a result:"
            )
            lines += [f"  {count} x {where}" for where, count in places.most_common(5)]
            lines.append("")
        lines.append("not estimated")
        lines += [f"  {what}: {why}" for what, why in NOT_ESTIMATED]
        return "\n".join(lines)

    def _memory_lines(self) -> list[str]:
        if self.memory is None:
            return ["memory per rank: not estimated (no optimizer step ran)", ""]
        lines = [f"memory of rank {self.rank} at the peak of the steps: {format_bytes(self.peak_bytes)}"]
        for kind in KINDS:
            lines.append(f"  {kind:<28} {format_bytes(self.memory[kind]):>12}")
        if self.without_checkpointing is not None:
            lines.append(
                f"  (without activation checkpointing: activations and temporaries "
                f"{format_bytes(self.without_checkpointing['activations'])}, a peak of "
                f"{format_bytes(self.without_checkpointing['peak_bytes'])})"
            )
        lines.append(f"  (peak while building and setting up the model: {format_bytes(self.setup_peak_bytes)})")
        if self.device_memory is not None:
            peak = max(self.peak_bytes, self.setup_peak_bytes)
            left = self.device_memory - peak
            verdict = (
                f"fits, {format_bytes(left)} to spare" if left >= 0 else f"does NOT fit: {format_bytes(-left)} over"
            )
            lines.append(f"  device memory {format_bytes(self.device_memory)}: {verdict}")
        lines.append("")
        return lines

    def _kind_lines(self) -> list[str]:
        if self.kinds is None:
            if self.memory is None:
                return []
            return ["kinds of rank: not told apart (a mesh does not tile the world as this plan can follow)", ""]
        if len(self.kinds) == 1:
            return [f"kinds of rank: one; every rank holds shards of the same shapes as rank {self.rank}", ""]
        lines = [
            f"kinds of rank: {len(self.kinds)} (ranks holding shards of the same shapes run the same ops on the "
            "same shapes; a kind differs where a dimension does not divide by the ranks sharding it)"
        ]
        for kind in self.kinds:
            ranks = kind["ranks"]
            if self.rank in ranks:
                note = "planned here"
            else:
                note = "; ".join(f"{name} {list(its)}, not {list(mine)}" for name, its, mine in kind["differs"])
            count = f"{len(ranks):,} rank{'s' if len(ranks) > 1 else ''}"
            lines.append(
                f"  rank{'s' if len(ranks) > 1 else ' '} {rank_ranges(ranks):<18} {count:>12}  "
                f"{kind['holds']:>15,} parameters  {note}"
            )
        other = next(kind["ranks"][0] for kind in self.kinds if self.rank not in kind["ranks"])
        lines += [f"  plan another kind as it is: fabriclite plan --rank {other} ... (the same options)", ""]
        return lines

    def _batch_lines(self) -> list[str]:
        if self.batch is None:
            return []
        batch = self.batch
        lines = [f"micro-batch per rank (the loaders' batch size; the script's: {batch['script']})"]
        for row in batch["traced"]:
            if row["peak_bytes"] is None:
                lines.append(f"  traced at {row['batch']:<6} did not trace (below)")
                continue
            peak = format_bytes(row["peak_bytes"])
            lines.append(f"  traced at {row['batch']:<6} peak {peak:>12}{'' if row['fits'] else '  (does not fit)'}")
        if batch["largest"]:
            peak = next(row["peak_bytes"] for row in batch["traced"] if row["batch"] == batch["largest"])
            lines.append(
                f"  largest that fits {format_bytes(self.device_memory)}: {batch['largest']} "
                f"(traced: peak {format_bytes(peak)})"
            )
        elif batch["largest"] == 0 and batch["changes"]:
            lines.append(f"  not even batch 1 fits {format_bytes(self.device_memory)}; what to change:")
            lines += [f"    - {change}" for change in batch["changes"]]
        if batch.get("note"):
            lines.append(f"  {batch['note']}")
        lines.append("")
        return lines

    def _traffic_lines(self) -> list[str]:
        if self.collectives is None or self.checkpoint is None:
            return [
                "collectives per step, checkpoint size: not estimated (the plan did not trace its last step whole)",
                "",
            ]
        lines = [
            f"collectives of rank {self.rank} in step {self.steps} (bytes handed in; sent: on the wire over a ring)"
        ]
        if not self.collectives:
            lines.append("  none")
        for row in self.collectives:
            sent = "not estimated (no ring model)" if row["bytes_sent"] is None else format_bytes(row["bytes_sent"])
            lines.append(
                f"  {row['collective']:<15} group of {row['group']:<6} {row['calls']:>5} calls "
                f"{format_bytes(row['bytes_in']):>12} in, {sent} sent"
            )
        kind = "sharded: every rank writes its shards" if self.checkpoint["sharded"] else "full: rank 0 writes it"
        lines += [
            "",
            f"checkpoint of the models and optimizers ({kind}): {format_bytes(self.checkpoint['total'])} of tensors "
            f"in all, {format_bytes(self.checkpoint['rank'])} written by rank {self.rank}",
            "",
        ]
        return lines


def _shorten(text: str, limit: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------- the configuration, read off the objects
def describe(observed: Any) -> list[tuple[str, str]]:
    """(name, value) lines for what the script's Fabric resolved: strategy, mesh, sharding units, precision of
    parameters, gradients and optimizer state, read off the set-up models and optimizers ``observed`` holds."""
    lines: list[tuple[str, str]] = []
    strategy = next((o._strategy for o in observed.optimizers if o._strategy is not None), None)
    if strategy is not None:
        lines.append(
            ("strategy", f"{type(strategy).__name__}, {strategy.world_size} processes on {strategy.root_device.type}")
        )
        lines += _strategy_lines(strategy)
    for index, wrapped in enumerate(observed.modules):
        lines += _model_lines(wrapped, f"model {index}" if len(observed.modules) > 1 else "model")
    for index, wrapped in enumerate(observed.optimizers):
        lines += _optimizer_lines(wrapped, f"optimizer {index}" if len(observed.optimizers) > 1 else "optimizer")
    return lines


def _strategy_lines(strategy: Any) -> list[tuple[str, str]]:
    lines = []
    mesh = getattr(strategy, "mesh", None)
    if mesh is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        lines.append(("device mesh", " x ".join(f"{name} {size}" for name, size in zip(names, mesh.shape))))
    policy = getattr(strategy, "checkpoint_policy", None)
    if policy is not None:
        lines.append(("activation checkpointing", f"activation_checkpointing_policy={_policy(policy.policy)}"))
    if hasattr(strategy, "reshard_after_forward"):
        sharding = {"flat": "over every rank", "hybrid": "within a group, replicated across", "replicate": "none"}
        lines.append(
            (
                "sharding",
                f"{sharding.get(strategy.mesh_kind, strategy.mesh_kind)}; "
                f"reshard after forward: {strategy.reshard_after_forward}; cpu offload: {strategy.cpu_offload}",
            )
        )
    if hasattr(strategy, "ddp_kwargs"):
        kwargs = strategy.ddp_kwargs
        lines.append(
            (
                "DDP",
                f"gradient buckets of {kwargs.get('bucket_cap_mb', 25)} MiB; gradient_as_bucket_view="
                f"{kwargs.get('gradient_as_bucket_view', False)}; find_unused_parameters="
                f"{kwargs.get('find_unused_parameters', False)}",
            )
        )
    precision = getattr(strategy, "precision", None)
    if precision is not None:
        compute = getattr(precision, "param_dtype", None) or getattr(precision, "dtype", None) or torch.float32
        lines.append(
            (
                "precision",
                f"{precision.name}: forward computes in {_dtype(compute)}"
                f"{'; loss scaler' if precision.scaler is not None else ''}",
            )
        )
    return lines


def _model_lines(wrapped: Any, name: str) -> list[tuple[str, str]]:
    from torch.distributed.fsdp import FSDPModule

    module = wrapped._original_module
    params = list(module.parameters())
    total = sum(p.numel() for p in params)
    local = sum(_local(p).numel() for p in params)
    lines = [
        (
            name,
            f"{_user_class(module)}, {total:,} parameters; this rank holds {local:,} "
            f"({_dtypes(_local(p) for p in params)})",
        )
    ]
    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if units:
        kinds = Counter(_user_class(m) for m in units if m is not module)
        listed = ", ".join(f"{count} x {kind}" for kind, count in kinds.items())
        largest = max(_gathered(unit, units) for unit in units)
        lines.append(
            (
                "FSDP units",
                f"{len(units)}: {listed}{', ' if listed else ''}the root; the largest gathers {largest:,} parameters",
            )
        )
    grads = [_local(p.grad) for p in params if p.grad is not None]
    if grads:
        lines.append((f"{name} gradients", _dtypes(grads)))
    lines.append((f"{name} compile", _compile_line(wrapped, module)))
    kernels = Counter(type(m).__name__ for m in module.modules() if type(m).__module__.startswith("fabriclite.kernels"))
    if kernels:
        listed = ", ".join(f"{count} x {kind}" for kind, count in kernels.items())
        lines.append((f"{name} kernels", f"fabriclite's Triton kernels in place of torch's modules: {listed}"))
    return lines


def _compile_line(wrapped: Any, module: Any) -> str:
    """What torch.compile will do for the model, as fabric.setup arranged it (the plan runs it as eager ops)."""
    watch = getattr(wrapped, "_watch", None)
    if watch is None:
        return "off (eager)"
    backend = getattr(watch._backend, "__name__", "backend")
    if watch.regions:
        kinds = Counter(type(module.get_submodule(name)).__name__ for name in watch.regions)
        listed = ", ".join(f"{count} x {kind}" for kind, count in kinds.items())
        what = f"regional: {len(watch.regions)} blocks compiled in place ({listed}), one graph per block class"
    else:
        what = "the whole model"
    return f"torch.compile, {what}, backend {backend}; planned as eager ops"


def _policy(policy: Any) -> str:
    """A policy as the script wrote it: ``{Block}`` for a set of classes, else its repr."""
    if isinstance(policy, (set, frozenset, list, tuple)) and all(isinstance(c, type) for c in policy):
        names = sorted(c.__name__ for c in policy)
        return f"{{{', '.join(names)}}}" if isinstance(policy, (set, frozenset)) else f"[{', '.join(names)}]"
    return repr(policy)


def _user_class(module: Any) -> str:
    """The model's own class name (FSDP2 puts each unit in a subclass of FSDPModule and it)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule)).__name__


def _gathered(unit: Any, units: list[Any]) -> int:
    """The parameters ``unit`` all-gathers: its own, less those of the units inside it."""
    inner = {id(m) for m in units if m is not unit}
    below = {id(p) for m in unit.modules() if id(m) in inner for p in m.parameters()}
    return sum(p.numel() for p in unit.parameters() if id(p) not in below)


def _optimizer_lines(wrapped: Any, name: str) -> list[tuple[str, str]]:
    inner = wrapped.optimizer
    states = [_local(t) for state in inner.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    big = [t for t in states if t.dim() > 0]
    value = f"{type(inner).__name__}; state {_dtypes(big) if big else 'none yet'}"
    return [(name, value)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtypes(tensors: Any) -> str:
    counts = Counter(_dtype(t.dtype) for t in tensors)
    return ", ".join(counts) if counts else "none"
