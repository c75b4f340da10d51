"""The conversion Lightning's docs start with: a plain PyTorch loop, three lines changed."""

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything

fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
fabric.launch()
seed_everything(42)
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
dataloader = fabric.setup_dataloaders(loader())

step = 0
for _epoch in range(2):
    for x, y in dataloader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        report(fabric, step, loss)
        step += 1
