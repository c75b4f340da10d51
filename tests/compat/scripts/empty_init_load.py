"""init_module(empty_init=True): build without initialising the weights, then load them from a checkpoint."""

import sys
from pathlib import Path

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything

folder = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
seed_everything(42)
torch.save(mlp().state_dict(), folder / "weights.pt")

with fabric.init_module(empty_init=True):
    model = mlp()
model.load_state_dict(torch.load(folder / "weights.pt", weights_only=True))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
model, optimizer = fabric.setup(model, optimizer)
for step, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    report(fabric, step, loss)
