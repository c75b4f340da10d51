"""Kinds of rank (``fabriclite/plan/ranks.py``): ranks told apart by the shapes of the shards they hold, on meshes
that cover the world and on meshes that hold one group of it (tensor parallel), and another rank planned after
the first in the same process. DTensor's shard shapes and its caches are private torch parts: every torch CI tests."""

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from helpers import SCRIPTS

from fabriclite._versions_fake import real_tensors
from fabriclite.plan import plan_script
from fabriclite.plan.ranks import rank_kinds, rank_ranges, shards_of
from fabriclite.plan.world import FakeWorld


pytestmark = pytest.mark.torch_versions


class Wrapped:  # what rank_kinds reads of a set-up model
    def __init__(self, module: nn.Module) -> None:
        self._original_module = module


def test_rank_ranges_are_written_as_runs():
    assert rank_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert rank_ranges([3]) == "3"
    assert rank_ranges([0, 2, 4, 6, 8, 10], most=4) == "0, 2, 4, 6, ..."


def sharded(mesh, rows: int) -> nn.Module:
    """A layer whose weight of ``rows`` rows is sharded over ``mesh`` (this rank's chunk, as torch.chunk cuts)."""
    chunk = -(-rows // mesh.size())
    mine = max(0, min(chunk, rows - mesh.get_local_rank() * chunk))
    module = nn.Module()
    weight = DTensor.from_local(torch.zeros(mine, 4), mesh, [Shard(0)], run_check=False, shape=(rows, 4), stride=(4, 1))
    module.weight = nn.Parameter(weight)
    module.plain = nn.Parameter(torch.zeros(3))  # not a DTensor: every rank holds it whole
    return module


def test_ranks_of_a_mesh_covering_the_world_are_told_apart_by_their_shards():
    with FakeWorld(world_size=4, rank=2):
        with real_tensors():
            mesh = init_device_mesh("cpu", (4,))
        shards = shards_of([Wrapped(sharded(mesh, 9))])
    kinds = rank_kinds(shards, world_size=4, planned_rank=2)
    # 9 rows over 4: 3, 3, 3 and none.
    assert [kind["ranks"] for kind in kinds] == [[0, 1, 2], [3]]
    assert [kind["holds"] for kind in kinds] == [3 * 4 + 3, 3]
    assert kinds[0]["differs"] == [] and kinds[1]["differs"] == [("weight", (0, 4), (3, 4))]
    with FakeWorld(world_size=4):
        with real_tensors():
            mesh = init_device_mesh("cpu", (4,))
        shards = shards_of([Wrapped(sharded(mesh, 8))])
    assert [kind["ranks"] for kind in rank_kinds(shards, 4, 0)] == [[0, 1, 2, 3]]


def test_a_mesh_holding_one_group_of_the_world_stands_for_every_group_like_it():
    # Rank 5 of (2 data-parallel x 4 tensor-parallel): its tensor-parallel mesh holds ranks 4-7 only; ranks 0-3 are
    # the other group, at the same positions. 6 rows over 4 positions: 2, 2, 2 and none.
    with FakeWorld(world_size=8, rank=5):
        with real_tensors():
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))["tp"]
        assert sorted(mesh.mesh.tolist()) == [4, 5, 6, 7]
        shards = shards_of([Wrapped(sharded(mesh, 6))])
    kinds = rank_kinds(shards, world_size=8, planned_rank=5)
    assert [kind["ranks"] for kind in kinds] == [[0, 1, 2, 4, 5, 6], [3, 7]]


def test_a_second_rank_planned_in_the_same_process_is_planned_as_itself():
    # DTensor caches the specs of its ops by mesh, and meshes of different ranks compare equal: without emptying
    # the caches, the second plan's parameters took the first rank's mesh and setup failed on a shape mismatch.
    script = str(SCRIPTS / "plan_configs.py")
    first, last = (plan_script(script, ["uneven"], devices=4, rank=rank) for rank in (0, 3))
    assert first.ok and last.ok, (first.error, last.error)
    assert [kind["ranks"] for kind in last.kinds] == [[0, 1, 2], [3]]
    assert first.memory["optimizer state"] - last.memory["optimizer state"] == 2 * 4 * (3 * 4096 + 3)
