"""The largest micro-batch that fits a device's memory, and what to change when none does: the plan traces the
script again with its loaders' batch size changed (``fabriclite.data.planned_batch_size``), as if it had been given
``--batch-size N``: at half the script's batch first, then at each batch the line through the two traces nearest the
memory says fits (activations grow with the batch; parameters, gradients and optimizer state do not), until the
largest batch that fits and the next, which does not, have both been traced. The batch reported is always one
traced, never only extrapolated.

Usage: ``plan.batch = largest_batch(plan, script_sizes, trace)``, where ``trace(n)`` plans the script at batch ``n``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fabriclite.plan.report import Plan, format_bytes

_TRACES = 8  # traces at most besides the script's own: a search on a large model costs a plan each


def _needs(plan: Plan) -> int:
    """The memory a device needs for this plan: its peak while setting up or stepping, whichever is higher."""
    return max(plan.peak_bytes or 0, plan.setup_peak_bytes or 0)


def largest_batch(first: Plan, script_sizes: list[int | None], trace: Callable[[int], Plan]) -> dict[str, Any]:
    """What ``Plan.batch`` holds: the script's micro-batch, each batch traced with its peak and whether it fits,
    the largest batch traced that fits (0: not even 1 fits), the smallest traced that does not (``largest + 1``
    when the search ended exact), and, when batch 1 does not fit, the changes that would make it fit.

    Between traces the next batch to try is extrapolated along the line through the two traces nearest the
    device's memory (the peak grows with the activations, which grow with the batch); the peak can grow faster
    past a point (it moves from the optimizer's step to the forward), which the next trace corrects."""
    memory = first.device_memory
    sizes = [size for size in script_sizes if size is not None]
    result: dict[str, Any] = {"script": sizes[0] if sizes else None, "traced": [], "largest": None, "changes": []}
    if not sizes:
        result["note"] = (
            "not searched: the script sets up no loader with torch's BatchSampler through fabric.setup_dataloaders, "
            "so the plan cannot change its batch"
        )
        return result
    script = sizes[0]
    traced = {script: first}
    failed: dict[int, str] = {}  # batches whose steps did not trace (a data set smaller than the batch), and why
    guess = script // 2 if script >= 2 else 2
    for _ in range(_TRACES):
        traced[guess] = plan = trace(guess)
        if plan.steps != first.steps or plan.error is not None or plan.limit is not None:
            failed[guess] = _why(plan)
            if guess < script:  # not the batch size: the script fails at smaller batches than its own
                result["note"] = f"the plan at batch {guess} did not trace its steps ({failed[guess]})"
                return _with_traced(result, traced, memory, failed)
        guess = _next_guess(traced, memory, failed)
        if guess is None:
            break
    fitting = [batch for batch, plan in traced.items() if _fits(batch, traced, memory, failed)]
    over = [batch for batch in traced if batch not in fitting]
    result["largest"] = max(fitting, default=0)
    result["first_over"] = min(over, default=None)
    if result["first_over"] is None:
        result["note"] = (
            f"every batch traced fits, up to {result['largest']}: the peak does not grow with the loaders' batch as "
            "far as the search went"
        )
    elif result["first_over"] != result["largest"] + 1:
        result["note"] = (
            f"the search stopped after {_TRACES} traces: between {result['largest']} and {result['first_over']}"
        )
    if failed:
        first_failed = min(failed)
        why = f"the plan did not trace the steps at a batch of {first_failed}: {failed[first_failed]}"
        result["note"] = why if "note" not in result else f"{why}; {result['note']}"
    if result["first_over"] == 1 and 1 not in failed:
        result["changes"] = changes(traced[1])
    return _with_traced(result, traced, memory, failed)


def _fits(batch: int, traced: dict[int, Plan], memory: int, failed: dict[int, str]) -> bool:
    return batch not in failed and _needs(traced[batch]) <= memory


def _next_guess(traced: dict[int, Plan], memory: int, failed: dict[int, str]) -> int | None:
    """The next batch to trace, or None when the largest that fits is known (or cannot be: the peak not growing)."""
    fitting = sorted(batch for batch in traced if _fits(batch, traced, memory, failed))
    over = sorted(batch for batch in traced if batch not in fitting)
    low, high = (fitting[-1] if fitting else 0), (over[0] if over else None)
    if high == low + 1:
        return None
    if high in failed:  # no peak to draw a line to: halve the interval
        return None if (low + high) // 2 in traced else (low + high) // 2
    if fitting and over:
        a, b = low, high
    else:  # all on one side: the two traces nearest the memory
        a, b = fitting[-2:] if fitting else over[:2]
    growth = (_needs(traced[b]) - _needs(traced[a])) / (b - a)
    if growth <= 0:  # flat: something else holds the peak (the shuffle's permutation, the model's state)
        if high is not None:  # every trace over: try 1
            return None if 1 in traced else 1
        flat = len({_needs(traced[batch]) for batch in fitting[-3:]}) == 1
        return None if flat and len(fitting) >= 3 else 2 * low  # double, until three traces in a row held the same
    guess = max(a + math.floor((memory - _needs(traced[a])) / growth), low + 1)
    if high is not None:
        guess = min(guess, high - 1)
        if guess in traced:  # the line leads back to a trace: halve the interval instead
            guess = (low + high) // 2
    return None if guess in traced else guess


def _with_traced(
    result: dict[str, Any], traced: dict[int, Plan], memory: int, failed: dict[int, str]
) -> dict[str, Any]:
    result["traced"] = [
        {"batch": batch, "peak_bytes": None if batch in failed else _needs(plan),
         "fits": _fits(batch, traced, memory, failed)}
        for batch, plan in sorted(traced.items())
    ]  # fmt: skip
    return result


def _why(plan: Plan) -> str:
    if plan.error or plan.limit:
        return plan.error or plan.limit
    return f"{plan.steps} optimizer step(s) traced; exit code {plan.exit_code}"


def changes(plan: Plan) -> list[str]:
    """What would bring the peak of ``plan`` (traced at batch 1) under its device memory, each with its figures:
    sharding the model's state over more ranks, activation checkpointing, a lower precision of optimizer state."""
    memory, need, parts = plan.device_memory, _needs(plan), plan.memory
    state = parts["parameters"] + parts["gradients"] + parts["optimizer state"]
    rest = need - state
    over = need - memory
    lines = [f"at batch 1 the peak is {format_bytes(need)}, {format_bytes(over)} over {format_bytes(memory)}"]
    if plan.setup_peak_bytes and plan.setup_peak_bytes > memory:
        lines.append(
            f"before the steps (the model built and set up, the data the script holds) the peak is "
            f"{format_bytes(plan.setup_peak_bytes)}: building the model in fabric.init_module(empty_init=True) has "
            "each rank hold only its shard"
        )
    if state:
        factor = next((k for k in (2, 4, 8, 16, 32, 64, 128) if rest + state / k <= memory), None)
        shard = (
            f"sharding them over {factor} times as many ranks (FSDP2 over more ranks, larger HSDP shard groups, "
            f"or tensor parallel x FSDP2) leaves {format_bytes(state / factor)}, a peak of about "
            f"{format_bytes(rest + state / factor)} (estimated: the rest taken as unchanged)"
            if factor
            else f"sharding them alone cannot fit: the rest of the peak is {format_bytes(rest)}"
        )
        lines.append(f"parameters, gradients and optimizer state hold {format_bytes(state)} on this rank; {shard}")
    activations = parts["activations and temporaries"]
    if activations:
        lines.append(
            f"activations and temporaries hold {format_bytes(activations)} at batch 1: activation checkpointing "
            "(FSDPStrategy(activation_checkpointing_policy={YourBlock})) keeps only each block's input and "
            "recomputes the rest in backward; plan again with it set for its figure"
        )
    if parts["optimizer state"] and "float32" in dict(plan.configuration).get("optimizer", ""):
        lines.append(
            f"optimizer state holds {format_bytes(parts['optimizer state'])} in float32: in bfloat16 it would hold "
            f"{format_bytes(parts['optimizer state'] / 2)}"
        )
    return lines
