"""Save and resume the way the docs teach: a state dict of model, optimizer and counters through fabric.save/load."""

import sys
from pathlib import Path

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything

folder = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()


def build():
    seed_everything(42)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return fabric.setup(model, optimizer)


def train(model, optimizer, steps, first_step):
    batches = iter(fabric.setup_dataloaders(loader(shuffle=False)))
    for step in range(first_step, first_step + steps):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        report(fabric, step, loss)


model, optimizer = build()
train(model, optimizer, 3, 0)
state = {"model": model, "optimizer": optimizer, "step": 3}
fabric.save(folder / "checkpoint.ckpt", state)
train(model, optimizer, 2, 100)  # what an uninterrupted run does next

model, optimizer = build()  # a fresh process would start here
state = {"model": model, "optimizer": optimizer, "step": 0}
fabric.load(folder / "checkpoint.ckpt", state)
if fabric.global_rank == 0:
    print(f"RESUMED at step {state['step']}", flush=True)
train(model, optimizer, 2, 200)  # must repeat steps 100 and 101
