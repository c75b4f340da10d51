"""Collectives that own a process group, at Lightning's path ``plugins.collectives``: TorchCollective over real gloo
processes split into groups as Lightning's reinforcement-learning example splits them, and the answers of a world
of one."""

import os
import socket

import pytest
import torch
import torch.distributed as dist

from fabriclite.plugins.collectives import SingleDeviceCollective, TorchCollective
from fabriclite.plugins.collectives.collective import CollectibleGroup
from fabriclite.utilities.types import ReduceOp
from helpers import SCRIPTS, assert_passed, run_python

EVERY_RANK = [
    "world",
    "all_reduce",
    "all_gather",
    "scatter_object_list",
    "broadcast_object_list",
    "teardown",
]


def test_a_player_and_two_trainers_exchange_through_their_own_groups():
    script = str(SCRIPTS / "collective_groups.py")
    output = run_python("-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "3", script, timeout=300)
    assert_passed(output.stdout, EVERY_RANK, ranks=("0", "1", "2"))
    assert_passed(output.stdout, ["pair broadcast"], ranks=("0", "1"))
    assert_passed(output.stdout, ["trainer gradients averaged over 2"], ranks=("1", "2"))
    assert_passed(output.stdout, ["weights from the trainers"], ranks=("0",))


@pytest.mark.parametrize(
    ("op", "expected"),
    [("sum", ReduceOp.SUM), ("BoR", ReduceOp.BOR), ("avg", ReduceOp.AVG), ("premul_sum", ReduceOp.PREMUL_SUM)],
)
def test_a_reduce_op_is_named_in_any_case_or_passed_as_it_is(op, expected):
    assert TorchCollective._convert_to_native_op(op) == expected
    assert TorchCollective._convert_to_native_op(expected) is expected


def test_a_reduce_op_that_is_not_one_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match="Unsupported op 1 of type int"):
        TorchCollective._convert_to_native_op(1)
    with pytest.raises(ValueError, match="op 'MEAN' is not a member of `ReduceOp`. Valid names .*avg"):
        TorchCollective._convert_to_native_op("mean")


def test_a_collective_without_a_group_says_so_and_owns_at_most_one():
    collective = SingleDeviceCollective()
    with pytest.raises(RuntimeError, match="SingleDeviceCollective` does not own a group"):
        _ = collective.group
    with pytest.raises(RuntimeError, match="owns no group to destroy"):
        collective.teardown()
    collective.create_group()
    with pytest.raises(RuntimeError, match="already owns a group"):
        collective.create_group()
    assert collective.teardown()._group is None


def test_a_world_of_one_answers_as_one_process_would():
    collective = SingleDeviceCollective().setup()
    tensor = torch.arange(3)
    assert (collective.rank, collective.world_size) == (0, 1)
    assert collective.all_reduce(tensor, op="sum") is tensor and collective.all_gather([], tensor) == [tensor]
    assert collective.scatter(torch.zeros(3), [tensor]) is tensor


def test_setup_lends_the_main_address_for_the_join_and_the_last_teardown_closes_the_default_group(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not dist.is_initialized()
    collective = TorchCollective().setup(main_address="127.0.0.1", main_port=port, backend="gloo", rank=0, world_size=1)
    try:
        assert dist.is_initialized() and TorchCollective.manages_default_group
        assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
        assert isinstance(collective.group, CollectibleGroup) and collective.group == dist.GroupMember.WORLD
        assert collective.all_reduce(torch.tensor(3.0), op="max").item() == 3.0
        collective.teardown()
        assert not dist.is_initialized() and not TorchCollective.manages_default_group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        TorchCollective.manages_default_group = False
