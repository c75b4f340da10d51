"""What a rank hands to collectives, per step, and what it writes of a checkpoint (``fabriclite/plan/traffic.py``),
on torch's fake process group in the plan's pretend world, where each figure follows from the tensors' shapes."""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fabriclite.plan.traffic import CollectiveCounter, collective_name
from fabriclite.plan.world import FakeWorld


def test_each_collective_counts_what_this_rank_hands_in_and_what_a_ring_sends_per_step():
    counter = CollectiveCounter()
    with FakeWorld(world_size=4, trackers=(counter,)):
        grads = torch.ones(1000)  # 4,000 bytes
        dist.all_reduce(grads)
        counter.on_step_end(None)  # the first optimizer step ends
        dist.all_gather_into_tensor(torch.empty(4000), grads)  # hands in its 4,000-byte shard
        dist.reduce_scatter_tensor(torch.empty(250), grads)  # hands in the whole 4,000 bytes
        funcol.all_reduce(grads, "sum", dist.group.WORLD)  # DTensor's path: counted as the same collective
        dist.barrier()  # sends no tensor
    assert counter.by_collective(step=0) == [
        {"collective": "all_reduce", "group": 4, "calls": 1, "bytes_in": 4000, "bytes_sent": 6000}
    ]
    second = {row["collective"]: row for row in counter.by_collective(step=1)}
    assert second.keys() == {"all_gather", "reduce_scatter", "all_reduce"}
    assert second["all_gather"]["bytes_sent"] == 3 * 4000  # the shard to each of 3 peers
    assert second["reduce_scatter"]["bytes_sent"] == 3000  # 3/4 of it
    assert second["all_reduce"]["bytes_in"] == 4000 and second["all_reduce"]["bytes_sent"] == 6000  # 2 (n-1)/n


def test_op_names_map_onto_the_collectives_they_are():
    names = ["allreduce_", "_allgather_base_", "allgather_into_tensor_coalesced_", "_reduce_scatter_base_",
             "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast_"]  # fmt: skip
    assert [collective_name(n) for n in names] == [
        "all_reduce", "all_gather", "all_gather", "reduce_scatter", "reduce_scatter", "all_gather", "all_to_all",
        "broadcast",
    ]  # fmt: skip
