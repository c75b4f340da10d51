"""One process whose every step ends with an asynchronous save (keep_last=2) and whose script ends right after the
last: the process must exit 0 with the last two checkpoints complete, never abort at exit with a write pending.

Usage: `python async_save_at_exit.py FOLDER`.
"""

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric

fabric = Fabric(accelerator="cpu", devices=1)
fabric.launch()
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.randn(64, 1024)), batch_size=8))
state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
for (x,) in loader:
    fabric.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    state["step"] += 1
    fabric.save(f"{sys.argv[1]}/step-{state['step']}.ckpt", state, asynchronous=True, keep_last=2)
    if fabric.preempted:
        sys.exit(75)
