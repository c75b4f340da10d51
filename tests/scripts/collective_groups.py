"""Three processes split as Lightning's reinforcement-learning example splits them: rank 0 a player, ranks 1 and 2
trainers under ``DDPStrategy(process_group=...)`` over their own group, ``TorchCollective`` objects for the world
and for the player with the first trainer. Prints "PASS <rank> <name>" per check.

Usage: ``fabriclite run --accelerator cpu --devices 3 collective_groups.py``.
"""

import os

import torch
import torch.distributed as dist
from check_report import report

from fabriclite import Fabric
from fabriclite.plugins.collectives import TorchCollective
from fabriclite.plugins.collectives.collective import CollectibleGroup
from fabriclite.strategies import DDPStrategy
from fabriclite._versions import process_groups

world = TorchCollective()
pair = TorchCollective()
world.setup(backend="gloo")
world.create_group()
pair.create_group(ranks=[0, 1])
trainers_pg = world.new_group(ranks=[1, 2])
rank = world.rank
check = lambda name, condition, detail="": report(rank, name, condition, detail)  # noqa: E731

check("world", world.world_size == 3 and rank == int(os.environ["RANK"]) and isinstance(world.group, CollectibleGroup))

# The world's collectives, with ops by name and by ReduceOp.
total = world.all_reduce(torch.tensor(rank + 1), op="sum")
lowest = world.all_reduce(torch.tensor(rank + 1), op=dist.ReduceOp.MIN)
gathered = world.all_gather([torch.zeros(2, dtype=torch.long) for _ in range(3)], torch.tensor([rank, 10 * rank]))
check("all_reduce", total.item() == 6 and lowest.item() == 1)
check("all_gather", [t.tolist() for t in gathered] == [[0, 0], [1, 10], [2, 20]])
out = [None]
world.scatter_object_list(out, [{"to": r} for r in range(3)] if rank == 0 else [None] * 3, src=0)
check("scatter_object_list", out == [{"to": rank}])
objects = world.broadcast_object_list([{"from": rank}], src=0)
check("broadcast_object_list", objects == [{"from": 0}])

# The pair's group: rank 2 is outside it, and its barrier returns at once.
if rank in (0, 1):
    weights = pair.broadcast(torch.full((3,), float(rank)), src=1)
    check("pair broadcast", weights.tolist() == [1.0, 1.0, 1.0] and pair.world_size == 2)
pair.barrier()

if rank == 0:
    fabric = Fabric(accelerator="cpu")  # the player joins no model; it waits for the trainers' weights
    received = torch.zeros(4)
    pair.broadcast(received, src=1)
    check("weights from the trainers", torch.equal(received, torch.full((4,), 0.5)))
else:
    # The trainers average their gradients over their own group only.
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(process_group=trainers_pg))
    module = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(module.weight)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.0))
    loss = model(torch.full((1, 4), float(rank))).sum()  # gradient of rank r: r in every entry; mean 1.5
    fabric.backward(loss)
    check("trainer gradients averaged over 2", torch.allclose(model.weight.grad, torch.full((1, 4), 1.5)))
    if rank == 1:
        pair.broadcast(torch.full((4,), 0.5), src=1)

world.barrier()
owned = [pair.group, world.group]
pair.teardown()
world.teardown()
# The player's last group gone, its default group goes too; the trainers still have theirs, so theirs stays.
gone = not any(group in process_groups() for group in owned)
check("teardown", gone and dist.is_initialized() == (rank != 0), f"initialized: {dist.is_initialized()}")
os.write(1, f"DONE {rank}\n".encode())
