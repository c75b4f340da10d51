"""FSDP with the policies the docs teach: each block its own unit, activation checkpointing on the blocks."""

import torch
from common import Block, loader, report
from torch import nn

from fabriclite import Fabric, seed_everything
from fabriclite.strategies import FSDPStrategy


strategy = FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
seed_everything(42)
with fabric.init_module(empty_init=False):
    model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 1))
model = fabric.setup_module(model)
optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.01))
for step, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad()
    report(fabric, step, loss)
