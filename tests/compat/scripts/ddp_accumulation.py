"""Two DDP processes with gradient accumulation: no_backward_sync skips the all-reduce on the steps in between."""

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
fabric.launch()
seed_everything(42)
model = mlp()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
model, optimizer = fabric.setup(model, optimizer)
dataloader = fabric.setup_dataloaders(loader(batch_size=4))
accumulate = 2

for epoch in range(2):
    for i, (x, y) in enumerate(dataloader):
        is_accumulating = (i + 1) % accumulate != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss / accumulate)
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
        report(fabric, epoch * 100 + i, loss)
