"""Syncing metric states across processes: one function, ``sync_states``, that every rank calls with states of the
same names in the same order.

Deadlock-freedom rests on one rule: the sequence of collectives depends only on what every rank knows alike (the
state names, their reductions, and tables that were themselves all-gathered), never on a rank's local data. That is
why a rank with nothing in a ``cat`` state still joins every gather, and why the shapes are exchanged first.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch
import torch.distributed as dist

Reduction = Union[str, Callable[[torch.Tensor], torch.Tensor], None]
State = Union[torch.Tensor, list]

_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX"}

# A state's description in the shape exchange: [rows, dtype code, ndim of a row, row shape padded with -1].
# Row shapes deeper than this are rare enough for metric states that a clear error beats a second protocol.
_MAX_ROW_DIMS = 6
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def distributed_available(group: Any = None) -> bool:
    """Whether there is more than one process to sync with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def sync_states(
    states: dict[str, State], reductions: dict[str, Reduction], group: Any, device: torch.device
) -> dict[str, State]:
    """Return the states reduced over every rank of ``group``; the inputs are left untouched (unsync restores them).

    Usage: ``synced = sync_states({"tp": tp, "preds": [p1, p2]}, {"tp": "sum", "preds": "cat"}, None, tp.device)``.
    ``sum``/``mean``/``min``/``max`` tensors are all-reduced; ``cat`` states (lists or tensors) become the rows of every
    rank, in rank order; ``None`` gathers without reducing (tensors stacked, lists concatenated) and a callable
    reduction gets the stacked tensors.
    """
    gathered_names = [name for name in states if reductions[name] not in _REDUCE_OPS]
    gathered = _gather_rows([_rows(states[name], reductions[name]) for name in gathered_names], group, device)
    from_gather = dict(zip(gathered_names, gathered))

    synced: dict[str, State] = {}
    for name, value in states.items():
        fx = reductions[name]
        if fx in _REDUCE_OPS:
            reduced = value.clone()  # all_reduce works in place; the local state must survive for unsync
            dist.all_reduce(reduced, op=getattr(dist.ReduceOp, _REDUCE_OPS[fx]), group=group)
            synced[name] = reduced / dist.get_world_size(group) if fx == "mean" else reduced
            continue
        rows = from_gather[name]
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


def _describe(rows: torch.Tensor | None) -> list[int]:
    # A rank with no rows says nothing about dtype or shape: an empty default (``torch.tensor([])``) must not
    # clash with the (n, C) rows of the others.
    if rows is None or rows.shape[0] == 0:
        return [0, -1, -1] + [-1] * _MAX_ROW_DIMS
    row_shape = list(rows.shape[1:])
    if len(row_shape) > _MAX_ROW_DIMS:
        raise ValueError(
            f"A gathered metric state may have at most {_MAX_ROW_DIMS + 1} dims, got shape {tuple(rows.shape)}"
        )
    return (
        [rows.shape[0], _DTYPES.index(rows.dtype), len(row_shape)] + row_shape + [-1] * (_MAX_ROW_DIMS - len(row_shape))
    )


def _gather_rows(local: list[torch.Tensor | None], group: Any, device: torch.device) -> list[torch.Tensor | None]:
    """All-gather each tensor along dim 0 when every rank holds a different number of rows, or none at all.

    Sizes first (one all_gather of a small table for all states), then each state padded to the longest rank,
    gathered, and trimmed. Returns None for a state that is empty on every rank.
    """
    if not local:
        return []
    world = dist.get_world_size(group)
    table = torch.tensor([_describe(rows) for rows in local], dtype=torch.int64, device=device)
    tables = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(tables, table, group=group)
    per_rank = torch.stack(tables).tolist()  # world x states x fields, identical on every rank

    out: list[torch.Tensor | None] = []
    for i, rows in enumerate(local):
        descriptions = [per_rank[rank][i] for rank in range(world)]
        known = [d for d in descriptions if d[1] >= 0]
        if not known:
            out.append(None)
            continue
        if any(d[1:] != known[0][1:] for d in known):
            # Every rank sees the same table, so every rank raises here together: no one is left waiting.
            raise RuntimeError(
                "Ranks hold metric states of different dtype or row shape and cannot be gathered: "
                + ", ".join(f"rank {r}: {_explain(d)}" for r, d in enumerate(descriptions))
            )
        dtype = _DTYPES[known[0][1]]
        row_shape = known[0][3 : 3 + known[0][2]]
        counts = [d[0] for d in descriptions]
        longest = max(counts)
        if longest == 0:
            out.append(torch.empty((0, *row_shape), dtype=dtype, device=device))
            continue
        # gloo has no bool collectives; bytes carry the same values
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        padded = torch.zeros((longest, *row_shape), dtype=wire_dtype, device=device)
        if rows is not None and rows.shape[0]:
            padded[: rows.shape[0]] = rows.to(device=device, dtype=wire_dtype)
        received = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(received, padded, group=group)
        out.append(torch.cat([r[:n] for r, n in zip(received, counts)]).to(dtype))
    return out


def _explain(description: list[int]) -> str:
    if description[1] < 0:
        return "empty"
    return f"{description[0]} rows of {_DTYPES[description[1]]} shaped {tuple(description[3 : 3 + description[2]])}"
