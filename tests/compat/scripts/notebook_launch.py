"""What a notebook cell does: define a training function, then launch it on 2 forked processes."""

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything


def train(fabric, lr):
    seed_everything(42)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = fabric.setup(model, optimizer)
    for step, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        report(fabric, step, loss)
    return "finished"


result = Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(train, 0.05)
print(f"RESULT {result}", flush=True)
