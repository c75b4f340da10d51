"""Syncing metric states across processes: one function, ``sync_states``, that every rank calls with states of the
same names in the same order. Its collectives are ``fabriclite.collectives``' (whose docstring says why they cannot
deadlock): first one ``all_gather_uneven`` of every state that gathers, which a rank with nothing in a ``cat`` state
still joins, then one ``all_reduce`` per reduced state, in the states' order.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch

from fabriclite.collectives import REDUCE_OPS, all_gather_uneven, all_reduce

Reduction = Union[str, Callable[[torch.Tensor], torch.Tensor], None]
State = Union[torch.Tensor, list]


def sync_states(
    states: dict[str, State], reductions: dict[str, Reduction], group: Any, device: torch.device
) -> dict[str, State]:
    """Return the states reduced over every rank of ``group``; the inputs are left untouched (unsync restores them).

    Usage: ``synced = sync_states({"tp": tp, "preds": [p1, p2]}, {"tp": "sum", "preds": "cat"}, None, tp.device)``.
    ``sum``/``mean``/``min``/``max`` tensors are all-reduced; ``cat`` states (lists or tensors) become the rows of every
    rank, in rank order; ``None`` gathers without reducing (tensors stacked, lists concatenated) and a callable
    reduction gets the stacked tensors.
    """
    gathered_names = [name for name in states if reductions[name] not in REDUCE_OPS]
    gathered = all_gather_uneven([_rows(states[name], reductions[name]) for name in gathered_names], group, device)
    from_gather = dict(zip(gathered_names, gathered))

    synced: dict[str, State] = {}
    for name, value in states.items():
        fx = reductions[name]
        if fx in REDUCE_OPS:
            synced[name] = all_reduce(value, fx, group)  # a new tensor: the local state survives for unsync
            continue
        parts = from_gather[name]
        rows = None if parts is None else torch.cat(parts)
        if isinstance(value, list):
            synced[name] = [] if rows is None else [rows]
        elif fx == "cat":
            synced[name] = value[:0] if rows is None else rows
        else:  # tensor gathered as one row per rank
            synced[name] = rows if fx is None else fx(rows)
    return synced


def _rows(value: State, fx: Reduction) -> torch.Tensor | None:
    """What a gathered state contributes: its rows along dim 0, or None for an empty list (shape unknown here)."""
    if isinstance(value, list):
        if not value:
            return None
        return torch.cat([v.reshape(1) if v.ndim == 0 else v for v in value])
    if fx == "cat":
        return value.reshape(1) if value.ndim == 0 else value
    return value.unsqueeze(0)  # a fixed-shape tensor reduced by None or a callable: one row per rank, then stacked
