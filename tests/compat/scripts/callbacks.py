"""Callbacks the way the docs teach: objects with hook methods, called by name with fabric.call."""

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything


class LossHistory:
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, loss, batch_idx):
        self.losses.append(round(loss.item(), 8))

    def on_train_epoch_end(self, epoch):
        print(f"EPOCH {epoch} batches {len(self.losses)}", flush=True)


history = LossHistory()
fabric = Fabric(accelerator="cpu", devices=1, callbacks=[history])
seed_everything(42)
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
dataloader = fabric.setup_dataloaders(loader())
step = 0
for epoch in range(2):
    for batch_idx, (x, y) in enumerate(dataloader):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.call("on_train_batch_end", loss=loss, batch_idx=batch_idx)
        report(fabric, step, loss)
        step += 1
    fabric.call("on_train_epoch_end", epoch=epoch)
