"""Kinds of rank. Ranks that hold shards of the same shapes run the same ops on tensors of the same shapes, so one
plan serves them all; a dimension that does not divide by the ranks sharding it (the last ranks of an uneven
split get a smaller shard, or none) or a tensor-parallel position that gets another part makes another kind. Read
off the set-up models' DTensor parameters: for every rank, the shape of its shard of each, as DTensor computes it
for its own rank. A parameter that is not a DTensor (DDP, one process) is the same on every rank.

Usage: ``kinds = rank_kinds(shards_of(observed.modules), world_size, planned_rank)``; ``kinds[0]["ranks"]``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from fabriclite._versions_fake import local_shape


@dataclass
class Shards:
    """How the set-up models' parameters are split: for each distinct placement, the parameters' ``names``, the
    global ``shape``, the mesh's ``mesh_shape`` and rank ``layout`` (rank numbers as nested lists) and the
    ``placements``; ``whole``: elements of the parameters every rank holds whole (not DTensors)."""

    placed: list[tuple[list[str], tuple, tuple, Any, tuple]]
    whole: int


def shards_of(modules: list[Any]) -> Shards:
    """Read while the plan's process group lives (a mesh holding part of the world finds its ranks through it).
    Usage: ``shards = shards_of(world.observed.modules)``."""
    from torch.distributed.tensor import DTensor

    placed: dict[tuple, list[str]] = {}
    layouts: dict[int, Any] = {}  # id of a mesh -> its rank numbers
    whole = 0
    for wrapped in modules:
        for name, param in wrapped._original_module.named_parameters():
            if not isinstance(param, DTensor):
                whole += param.numel()
                continue
            mesh = param.device_mesh
            key = (tuple(param.shape), tuple(mesh.shape), tuple(param.placements), id(mesh))
            placed.setdefault(key, []).append(name)
            layouts.setdefault(id(mesh), mesh.mesh.tolist())
    return Shards([(names, key[0], key[1], layouts[key[3]], key[2]) for key, names in placed.items()], whole)


def rank_kinds(shards: Shards, world_size: int, planned_rank: int) -> list[dict[str, Any]] | None:
    """The kinds of rank of the world, in the order of their lowest rank: for each, its ``ranks`` (sorted), the
    parameters it ``holds`` (elements) and, for the kinds other than ``planned_rank``'s, the parameters whose shard
    ``differs`` from that rank's: ``(name, its shard's shape, the planned rank's)``, at most three. None where a
    mesh does not tile the world in a way this can follow. Run it outside the plan's dispatch modes: it computes a
    shard's shape for every rank (0.14 s for 1,024 ranks and 12 placements)."""
    coordinates = [_coordinates(layout, mesh_shape, world_size) for _, _, mesh_shape, layout, _ in shards.placed]
    if any(found is None for found in coordinates):
        return None
    kinds: dict[tuple, list[int]] = {}  # the shapes of a rank's shards -> the ranks holding shards of those shapes
    for rank in range(world_size):
        signature = tuple(
            local_shape(shape, mesh_shape, found[rank], placements)
            for (_, shape, mesh_shape, _, placements), found in zip(shards.placed, coordinates)
        )
        kinds.setdefault(signature, []).append(rank)
    planned = next(signature for signature, ranks in kinds.items() if planned_rank in ranks)
    names = [names for names, *_ in shards.placed]
    found = []
    for signature, ranks in kinds.items():
        holds = sum(math.prod(local) * len(named) for local, named in zip(signature, names))
        differs = [(named[0], local, mine) for local, mine, named in zip(signature, planned, names) if local != mine]
        found.append({"ranks": ranks, "holds": holds + shards.whole, "differs": differs[:3]})
    return found


def rank_ranges(ranks: list[int], most: int = 4) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``; past ``most`` ranges, ``", ..."``. Usage: in the report."""
    ranges = []
    for _, run in itertools.groupby(enumerate(ranks), lambda pair: pair[1] - pair[0]):
        run = [rank for _, rank in run]
        ranges.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(ranges[:most]) + (", ..." if len(ranges) > most else "")


def _coordinates(layout: Any, mesh_shape: tuple, world_size: int) -> dict[int, list[int]] | None:
    """Each rank of the world -> its coordinate on the mesh of ``layout``, or on the slice of the world like it that
    holds the rank (a tensor-parallel mesh holds this rank's group only; the other groups are the same pattern
    moved along: the lowest rank not yet placed starts the next). None where the world is not tiled so."""
    positions = list(itertools.product(*(range(size) for size in mesh_shape)))
    ranks = []
    for coordinate in positions:
        entry = layout
        for index in coordinate:
            entry = entry[index]
        ranks.append(entry)
    offsets = [rank - min(ranks) for rank in ranks]
    found: dict[int, list[int]] = {}
    for start in range(world_size):
        if start in found:
            continue
        for offset, coordinate in zip(offsets, positions):
            if start + offset >= world_size or start + offset in found:
                return None
            found[start + offset] = list(coordinate)
    return found
