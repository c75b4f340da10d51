"""A Lightning Fabric script for `fabric run`/torchrun: it never calls fabric.launch(). Run with
`fabriclite run --accelerator cpu --devices 2 no_launch.py`; prints "PASS <rank> <name>" per check."""

import os

import torch
from torch import nn

from fabriclite import Fabric

fabric = Fabric()  # accelerator and devices come from `fabriclite run`
rank = fabric.global_rank
torch.manual_seed(0)
model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
for step in range(3):
    loss = model(torch.full((2, 4), float(rank + step))).pow(2).mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
weights = fabric.all_gather(model.module.weight.detach())
fabric.launch()  # harmless where the processes exist already
ok = fabric.world_size == 2 and torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], torch.zeros(1, 4))
os.write(1, f"{'PASS' if ok else 'FAIL'} {rank} trained on 2 processes without launch\n".encode())
