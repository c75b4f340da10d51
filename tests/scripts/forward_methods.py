"""Methods other than forward on a model set up under DDP or FSDP, on 2 CPU processes; prints "PASS <rank> <name>".
Usage: ``python forward_methods.py ddp|fsdp``.

Rank 0 feeds ones, rank 1 twos, to a bias-free Linear(4, 1) with unit weights: a loss averaged across the ranks has
the weight gradient 1.5 on both; a loss that bypasses the synchronisation would leave 1.0 on rank 0, 2.0 on rank 1.
"""

import os
import sys

import torch
from check_report import report
from torch import nn

from fabriclite import Fabric


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1, bias=False)
        nn.init.ones_(self.layer.weight)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch):  # the LightningModule style: calls the model itself
        return self(batch).sum()

    def doubled_loss(self, batch):  # a custom method calling forward directly
        return 2 * self.forward(batch).sum()

    def unmarked_loss(self, batch):
        return self.layer(batch).sum()

    def count_parameters(self):  # runs no layer: allowed as it is
        return sum(p.numel() for p in self.parameters())


strategy = sys.argv[1]
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
rank = fabric.global_rank
model = fabric.setup(Net())
batch = torch.full((1, 4), float(rank + 1))


def weight_grad():
    grad = model.module.layer.weight.grad
    grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    model.module.layer.weight.grad = None
    return grad


fabric.backward(model.training_step(batch))
grad = weight_grad()
gathered = fabric.all_gather(grad)
report(rank, "training_step gradients are averaged", torch.equal(gathered[0], gathered[1]) and torch.all(grad == 1.5))

model.mark_forward_method("doubled_loss")
fabric.backward(model.doubled_loss(batch))
report(rank, "a marked method's gradients are averaged", torch.all(weight_grad() == 3.0))

try:
    model.unmarked_loss(batch)
    refused = ""
except RuntimeError as error:
    refused = str(error)
report(rank, "an unmarked method that runs the model is refused", "mark_forward_method('unmarked_loss')" in refused)
report(rank, "a method that runs no layer works", model.count_parameters() == 4)
report(rank, "forward is itself again", "forward" not in model.module.__dict__ and model(batch).shape == (1, 1))
os.write(1, b"DONE\n")
