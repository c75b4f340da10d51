"""The pretend world a plan runs in (``fabriclite/plan/world.py``): rank 0 of the planned world on torch's fake
process group, every tensor fake, values read as healthy stand-ins and noted, the script stopped after its steps,
and everything given back afterwards."""

import os

import pytest
import torch
import torch.distributed as dist

from fabriclite._versions_fake import is_fake
from fabriclite.plan.world import FakeWorld, PlanStop


def test_the_world_is_rank_0_of_the_planned_size_and_everything_is_given_back():
    before = dict(os.environ)
    with FakeWorld(world_size=1024, settings={"FABRICLITE_CLI_DEVICES": "8"}):
        assert dist.get_world_size() == 1024 and dist.get_rank() == 0 and dist.get_backend() == "fake"
        assert os.environ["WORLD_SIZE"] == "1024" and os.environ["FABRICLITE_CLI_DEVICES"] == "8"
        weights = torch.empty(1_000_000, 1_000)  # 4 GB that are never allocated
        assert is_fake(weights)
    assert not dist.is_initialized() and dict(os.environ) == before
    assert not is_fake(torch.empty(2))


def test_another_rank_is_planned_where_the_launcher_would_place_it():
    with FakeWorld(world_size=16, settings={"FABRICLITE_CLI_DEVICES": "8"}, rank=13):
        assert dist.get_rank() == 13 and dist.get_world_size() == 16
        assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["NODE_RANK"]) == ("13", "5", "1")
    with pytest.raises(ValueError, match=r"rank=16 is not a rank of a world of 16: expected 0 to 15"):
        FakeWorld(world_size=16, rank=16)


def test_values_read_from_fake_tensors_are_those_a_healthy_run_sees_and_each_read_is_noted():
    with FakeWorld(world_size=2) as world:
        loss = torch.randn(4).pow(2).mean()
        norm = torch.linalg.vector_norm(torch.randn(10))
        assert loss.item() == 0.0
        assert bool(torch.isfinite(norm)) is True
        assert bool(torch.isnan(norm)) is False
        assert bool(~torch.isfinite(norm).all()) is False
        assert bool(torch.logical_or(norm.isnan(), norm.isinf())) is False
        steps = torch.tensor(0.0)  # a small constant keeps its value, as an optimizer's step count does
        steps += 1
        assert steps.item() == 1.0
    assert len(world.reads) == 5
    assert all(read.where.startswith(os.path.join("tests", "plan", "test_world.py")) for read in world.reads)
    assert [read.given for read in world.reads] == [0.0, True, False, False, False]


def test_the_script_stops_after_the_planned_optimizer_steps():
    with FakeWorld(world_size=4, steps=2) as world:
        weight = torch.nn.Parameter(torch.randn(8))
        optimizer = torch.optim.AdamW([weight])
        weight.grad = torch.randn(8)
        optimizer.step()
        with pytest.raises(PlanStop):
            optimizer.step()
    assert world.observed.steps == 2


def test_ops_on_real_tensors_stay_real_and_ops_making_or_touching_fake_ones_are_fake():
    from fabriclite._versions_fake import real_tensors

    with FakeWorld(world_size=8):
        with real_tensors():
            ranks = torch.arange(8).view(2, 4)  # a device mesh's rank numbers
        coordinates = (ranks == 5).nonzero()  # what FSDP2 asks of a mesh it builds: fake tensors cannot answer
        assert not is_fake(coordinates) and coordinates.tolist() == [[1, 1]]
        weights = torch.zeros(4)
        assert is_fake(weights) and is_fake(ranks[0] + weights)
