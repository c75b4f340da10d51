"""Collectives over ``torch.distributed``, shared by the strategies (``fabric.all_reduce``, ``fabric.all_gather``...)
and the metrics: the one table of reduce operations and the one all-gather of tensors whose first dimension differs
between ranks.

Deadlock-freedom rests on one rule: the sequence of collectives depends only on what every rank knows alike (the
arguments every rank passes, and tables that were themselves all-gathered), never on a rank's local data. That is
why a rank with nothing to contribute still joins every gather, and why shapes are exchanged first.

A DTensor (FSDP's parameters, tensor-parallel outputs) takes part with its full value: ``full_value`` turns it into
the plain tensor ``.full_tensor()`` gives (itself a collective, so every rank must pass its DTensor), and the
collective runs on that. So ``all_reduce(sum(p.sum() for p in model.parameters()), "sum")`` gives under FSDP what
it gives under DDP, and every result is a plain tensor.

Usage::

    total = all_reduce(loss, "sum")
    per_rank = all_gather_uneven([preds], device=preds.device)[0]   # every rank's rows, in rank order
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

from fabriclite._collections import apply_to_collection
from fabriclite._versions_fake import real_tensors

REDUCE_OPS = ("mean", "sum", "max", "min")
# "mean" is a sum divided by the number of ranks afterwards.
_TORCH_OPS = {"mean": "SUM", "sum": "SUM", "max": "MAX", "min": "MIN"}

# A tensor's description in the shape exchange: [rows, dtype code, ndim of a row, row shape padded with -1].
# Row shapes deeper than this are rare enough that a clear error beats a second protocol.
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
    torch.complex64,
    torch.complex128,
)


def check_reduce_op(reduce_op: Any) -> str:
    """Return the lower-case name of a reduce operation, or raise a ``ValueError`` listing the valid ones.

    Usage: ``check_reduce_op("SUM") == "sum"``.
    """
    if not isinstance(reduce_op, str) or reduce_op.lower() not in REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported. Valid choices: {', '.join(REDUCE_OPS)}.")
    return reduce_op.lower()


def full_value(data: Any) -> Any:
    """``data`` with every DTensor in it replaced by its full value as a plain tensor (a collective: every rank of
    the DTensor's mesh must call it); anything else unchanged. Usage: ``full_value(model.weight)``.
    """
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before it is imported
    if tensor_module is None:
        return data
    return apply_to_collection(data, tensor_module.DTensor, lambda t: t.full_tensor())


# The group metrics sync over when given none: the whole world (None), or under ModelParallelStrategy this rank's
# data-parallel group, since the ranks of one tensor-parallel group see the same batch and would count it once each.
_metric_group: Any = None


def set_metric_group(group: Any) -> None:
    """Make ``group`` the default group of metric syncs (None: the whole world). Set by the strategy."""
    global _metric_group
    _metric_group = group


def metric_group() -> Any:
    """The default group of metric syncs; see ``set_metric_group``."""
    return _metric_group


def is_distributed(group: Any = None) -> bool:
    """Whether there is more than one process to exchange data with."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_reduce(tensor: torch.Tensor, reduce_op: str = "mean", group: Any = None) -> torch.Tensor:
    """A new tensor reduced over every rank of ``group`` (``tensor`` itself is left as it was); "mean" of an
    integer tensor is a float tensor.

    Usage: ``all_reduce(torch.tensor(3.0), "max")``.
    """
    result = tensor.clone()
    if reduce_op == "mean" and not (result.is_floating_point() or result.is_complex()):
        result = result.float()
    dist.all_reduce(result, op=getattr(dist.ReduceOp, _TORCH_OPS[reduce_op]), group=group)
    if reduce_op == "mean":
        result /= dist.get_world_size(group)
    return result


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor | list[torch.Tensor]:
    """Every rank's ``tensor`` stacked along a new first dimension; when the first dimensions differ between
    ranks, the list of every rank's tensor instead. ``sync_grads`` lets gradients flow back to each rank's input.

    Usage: ``all_gather(torch.tensor([rank]))`` -> ``tensor([[0], [1]])`` on two ranks.
    """
    scalar = tensor.dim() == 0
    parts = all_gather_uneven([tensor.reshape(1) if scalar else tensor], group, tensor.device, sync_grads)[0]
    if parts is None:  # every rank holds an empty tensor
        return torch.stack([tensor] * dist.get_world_size(group))
    if scalar:
        return torch.cat(parts)
    if all(part.shape == parts[0].shape for part in parts):
        return torch.stack(parts)
    return parts


def all_gather_uneven(
    local: list[torch.Tensor | None], group: Any = None, device: Any = None, sync_grads: bool = False
) -> list[list[torch.Tensor] | None]:
    """All-gather each tensor of ``local`` along its first dimension, when ranks hold different numbers of rows (or
    none at all: ``None``, or zero rows, says nothing about dtype and row shape). Returns, per tensor, every rank's
    rows in rank order, or ``None`` when no rank had any.

    Sizes go first (one all-gather of a small table for all tensors); then each tensor, padded to the longest rank
    when the counts differ, is gathered and trimmed. Ranks whose rows differ in dtype or row shape make every rank
    raise the same ``RuntimeError``, so nobody is left waiting.
    Usage: ``per_rank = all_gather_uneven([rows], device=rows.device)[0]``.
    """
    if not local:
        return []
    if device is None:
        device = next((t.device for t in local if t is not None), torch.device("cpu"))
    world = dist.get_world_size(group)
    table = torch.tensor([_describe(rows) for rows in local], dtype=torch.int64, device=device)
    tables = [torch.empty_like(table) for _ in range(world)]
    dist.all_gather(tables, table, group=group)
    per_rank = torch.stack(tables).tolist()  # world x tensors x fields, identical on every rank

    out: list[list[torch.Tensor] | None] = []
    for i, rows in enumerate(local):
        descriptions = [per_rank[rank][i] for rank in range(world)]
        known = [d for d in descriptions if d[1] >= 0]
        if not known:
            out.append(None)
            continue
        if any(d[1:] != known[0][1:] for d in known):
            raise RuntimeError(
                "Ranks hold tensors of different dtype or row shape, which cannot be gathered: "
                + ", ".join(f"rank {r}: {_explain(d)}" for r, d in enumerate(descriptions))
            )
        dtype = _DTYPES[known[0][1]]
        row_shape = known[0][3 : 3 + known[0][2]]
        counts = [d[0] for d in descriptions]
        out.append(_gather_padded(rows, counts, dtype, row_shape, group, device, sync_grads))
    return out


def _gather_padded(
    rows: torch.Tensor | None,
    counts: list[int],
    dtype: torch.dtype,
    row_shape: list[int],
    group: Any,
    device: Any,
    sync_grads: bool,
) -> list[torch.Tensor]:
    longest = max(counts)
    wire_dtype = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool collectives; bytes carry the same
    if rows is not None and rows.shape[0] == longest and rows.dtype == wire_dtype and rows.device == device:
        padded = rows.contiguous()  # the common case: nothing to pad, and a graph to keep for sync_grads
    else:
        padded = torch.zeros((longest, *row_shape), dtype=wire_dtype, device=device)
        if rows is not None and rows.shape[0]:
            padded[: rows.shape[0]] = rows.to(device=device, dtype=wire_dtype)
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as all_gather_with_grad

        received = list(all_gather_with_grad(padded, group=group or dist.group.WORLD))
    else:
        received = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(received, padded, group=group)
    return [part[:n].to(dtype) for part, n in zip(received, counts)]


def _describe(rows: torch.Tensor | None) -> list[int]:
    if rows is None or rows.shape[0] == 0:
        return [0, -1, -1] + [-1] * _MAX_ROW_DIMS
    row_shape = list(rows.shape[1:])
    if len(row_shape) > _MAX_ROW_DIMS:
        raise ValueError(f"A gathered tensor may have at most {_MAX_ROW_DIMS + 1} dims, got shape {tuple(rows.shape)}")
    if rows.dtype not in _DTYPES:
        raise TypeError(f"Tensors of dtype {rows.dtype} cannot be gathered; valid dtypes: {list(_DTYPES)}.")
    return (
        [rows.shape[0], _DTYPES.index(rows.dtype), len(row_shape)] + row_shape + [-1] * (_MAX_ROW_DIMS - len(row_shape))
    )


def _explain(description: list[int]) -> str:
    if description[1] < 0:
        return "empty"
    return f"{description[0]} rows of {_DTYPES[description[1]]} shaped {tuple(description[3 : 3 + description[2]])}"


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Rank ``src``'s picklable ``obj``, on every rank. Usage: ``path = broadcast_object(path)``."""
    box = [obj]
    with real_tensors():  # pickled bytes, also in a script that `fabriclite plan` runs on fake tensors
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order. Usage: ``states = all_gather_object(rng_state)``."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    with real_tensors():  # pickled bytes, also in a script that `fabriclite plan` runs on fake tensors
        dist.all_gather_object(gathered, obj, group=group)
    return gathered
