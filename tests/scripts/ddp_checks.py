"""Runs on 2 CPU processes under DDP and checks the distributed behaviour; prints "PASS <rank> <name>" per check.

Started as a plain `python ddp_checks.py`: fabric.launch() starts the second process itself.
"""

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import MixedPrecision

precision = sys.argv[1] if len(sys.argv) > 1 else "32-true"
# "16-mixed" through the plugin: on a CPU the string means bf16, and these checks are about fp16's loss scaler.
fp16 = {"plugins": [MixedPrecision("16-mixed", "cpu")]} if precision == "16-mixed" else {"precision": precision}
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", **fp16)
fabric.launch()
rank = fabric.global_rank


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"rank {rank}: {name} failed {detail}")
    os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe


check(
    "layout",
    (fabric.world_size, fabric.local_rank, fabric.node_rank) == (2, rank, 0) and fabric.is_global_zero == (rank == 0),
)
check("threads", torch.get_num_threads() == max(1, (os.cpu_count() or 1) // 2) or "OMP_NUM_THREADS" in os.environ)

# Collectives.
gathered = fabric.all_gather(torch.tensor([rank, 10 + rank]))
check("all_gather stacks a world dimension", torch.equal(gathered, torch.tensor([[0, 10], [1, 11]])))
nested = fabric.all_gather({"a": torch.tensor(float(rank)), "b": [torch.ones(2) * rank]})
check("all_gather of a dict", torch.equal(nested["a"], torch.tensor([0.0, 1.0])) and nested["b"][0].shape == (2, 2))
uneven = fabric.all_gather(torch.arange(rank * 2 + 1))
check("all_gather of uneven lengths gives a list", [t.tolist() for t in uneven] == [[0], [0, 1, 2]])
empty = fabric.all_gather(torch.arange(rank * 3))
check("all_gather with an empty rank", [t.tolist() for t in empty] == [[], [0, 1, 2]])
value = torch.tensor(float(rank + 1))
check("all_reduce mean", fabric.all_reduce(value).item() == 1.5 and value.item() == rank + 1)
check(
    "all_reduce sum/max/min",
    [fabric.all_reduce(value, reduce_op=op).item() for op in ("sum", "max", "min")] == [3.0, 2.0, 1.0],
)
check("broadcast", fabric.broadcast({"from": rank}) == {"from": 0})
mesh = init_device_mesh("cpu", (2,))  # a DTensor of the user's own under DDP: collectives see its full value
sharded = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
check(
    "all_reduce of a DTensor reduces its full value",
    torch.equal(fabric.all_reduce(sharded, reduce_op="sum"), 2 * torch.arange(4.0)),
)
fabric.barrier()

# Data: each rank gets its own shard, reshuffled every epoch, padded to equal length.
data = TensorDataset(torch.arange(21).float().unsqueeze(1))
loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
epochs = [[int(v) for batch in loader for v in batch[0].flatten()] for _ in range(2)]
every = fabric.all_gather(torch.tensor(epochs))
check(
    "shards are disjoint and cover the data",
    sorted(set(every[:, 0].flatten().tolist())) == list(range(21)) and len(epochs[0]) == 11,
)
check("set_epoch reshuffles every epoch", epochs[0] != epochs[1])
# A user's sampler keeps its own randomness (Lightning's DistributedSamplerWrapper): seeded alike, every rank draws
# the order one process draws, and takes every second index of it (the 7 samples padded to 8 with the first).
seed_everything(3, verbose=False)
alone = [
    int(v) for batch in DataLoader(data, batch_size=2, sampler=SubsetRandomSampler(range(0, 21, 3))) for v in batch[0]
]
seed_everything(3, verbose=False)
subset = SubsetRandomSampler(list(range(0, 21, 3)))
sub_loader = fabric.setup_dataloaders(DataLoader(data, batch_size=2, sampler=subset))
mine = [int(v) for batch in sub_loader for v in batch[0].flatten()]
seen = fabric.all_gather(torch.tensor(mine))
check("a user's sampler is sharded", sorted(set(seen.flatten().tolist())) == list(range(0, 21, 3)))
check("a user's sampler keeps its own order", mine == (alone + alone[:1])[rank::2], f"{mine} of {alone}")
# Metrics: 21 samples on 2 ranks means one sample is seen twice; fabriclite's metrics drop it.
from fabriclite.metrics import Accuracy  # noqa: E402

labels = (torch.arange(21) % 3 == 0).long()
accuracy, with_duplicates = Accuracy(task="binary"), Accuracy(task="binary", drop_padding=False)
for (x,) in fabric.setup_dataloaders(DataLoader(data, batch_size=4)):
    guess = (x.flatten() < 11).long()  # right on some samples, wrong on others
    target = labels[x.flatten().long()]
    accuracy.update(guess, target)
    with_duplicates.update(guess, target)
single = ((torch.arange(21) < 11).long() == labels).float().mean()
check("a metric under DDP equals the single-process value", torch.allclose(accuracy.compute(), single))
check("counting the duplicate would differ", not torch.allclose(with_duplicates.compute(), single))
raw_loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4), use_distributed_sampler=False)
check("use_distributed_sampler=False keeps the whole data", len(raw_loader) == 6)

# Training: DDP averages gradients, so both ranks end with the same weights, equal to one process on both shards.
seed_everything(0, verbose=False)
reference = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
model.load_state_dict(reference.state_dict())
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
model, optimizer = fabric.setup(model, optimizer)
ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
torch.manual_seed(1)
xs, ys = torch.randn(2, 5, 4, 3), torch.randint(0, 2, (2, 5, 4))  # [rank, step, batch, ...]
for step in range(5):
    loss = F.cross_entropy(model(xs[rank, step]), ys[rank, step])
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
    ref_loss = F.cross_entropy(reference(xs[:, step].reshape(-1, 3)), ys[:, step].reshape(-1))
    ref_optimizer.zero_grad()
    ref_loss.backward()
    ref_optimizer.step()
weights = fabric.all_gather(model.module[0].weight.detach())
check("weights identical across ranks", torch.equal(weights[0], weights[1]))
tolerance = 1e-5 if precision == "32-true" else 2e-2  # fp16 autocast rounds the forward
check(
    "DDP equals one process on the whole batch",
    torch.allclose(model.module[0].weight, reference[0].weight, atol=tolerance),
)

# no_backward_sync: gradients stay local inside the block, and are averaged again outside it.
optimizer.zero_grad()
with fabric.no_backward_sync(model):
    fabric.backward(model(xs[rank, 0]).mean())
grads = fabric.all_gather(model.module[0].weight.grad)
check("no_backward_sync keeps gradients local", not torch.equal(grads[0], grads[1]))
optimizer.zero_grad()
fabric.backward(model(xs[rank, 0]).mean())
grads = fabric.all_gather(model.module[0].weight.grad)
check("gradients are averaged outside no_backward_sync", torch.equal(grads[0], grads[1]))

# Clip: the norm is the same on every rank (the gradients are).
norm = fabric.clip_gradients(model, optimizer, max_norm=1e-3)
norms = fabric.all_gather(norm.reshape(1))
check("clip_gradients norm agrees across ranks", torch.equal(norms[0], norms[1]))
optimizer.step()  # a clip unscales the gradients for the coming step; the step must follow
optimizer.zero_grad()
if fabric._precision.scaler is not None:
    # An overflow on one rank only: every rank must skip the same step and keep identical weights.
    scaler = fabric._precision.scaler
    before = model.module[0].weight.detach().clone()
    scale = scaler.get_scale()
    optimizer.zero_grad()
    loss = model(xs[rank, 1]).float().mean()
    fabric.backward(loss * float("inf") if rank == 1 else loss)
    optimizer.step()
    check("an inf on one rank makes every rank skip", torch.equal(model.module[0].weight, before))
    check("every rank backs off the scale", scaler.get_scale() == scale * 0.5)
    optimizer.zero_grad()
    fabric.backward(model(xs[rank, 1]).float().mean())
    optimizer.step()
    weights = fabric.all_gather(model.module[0].weight.detach())
    check(
        "after a skip the next step applies on every rank",
        not torch.equal(weights[0], before) and torch.equal(weights[0], weights[1]),
    )
os.write(1, f"DONE {rank}\n".encode())
