"""A training script that checkpoints every few steps and resumes from its checkpoint when one exists.

Prints "step N" after every step so a test can SIGKILL it at a chosen moment.
"""

import argparse
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import MixedPrecision
from noisy_step import noisy_step

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--precision", default="32-true")
parser.add_argument("--num-workers", type=int, default=0)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-every", type=int, default=4)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--devices", type=int, default=1)
args = parser.parse_args()

seed_everything(3, verbose=False)
model = nn.Sequential(nn.Linear(6, 24), nn.ReLU(), nn.Dropout(0.25), nn.Linear(24, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=50)
data = TensorDataset(torch.randn(100, 6), torch.randint(0, 3, (100,)))
loader = DataLoader(data, batch_size=8, shuffle=True, num_workers=args.num_workers)

# "16-mixed" through the plugin: on a CPU the string means bf16, and the run should resume fp16's loss scaler too.
fp16 = (
    {"plugins": [MixedPrecision("16-mixed", "cpu")]} if args.precision == "16-mixed" else {"precision": args.precision}
)
fabric = Fabric(accelerator="cpu", devices=args.devices, **fp16)
fabric.launch()
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(loader)
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "epoch": 0, "step": 0}
if os.path.exists(args.ckpt):
    fabric.load(args.ckpt, state)
    fabric.print(f"resumed at step {state['step']} epoch {state['epoch']}", flush=True)

for epoch in range(state["epoch"], args.epochs):
    state["epoch"] = epoch
    for x, y in loader:
        noisy_step(fabric, model, optimizer, x, y)
        scheduler.step()
        state["step"] += 1
        if state["step"] % args.save_every == 0:
            fabric.save(args.ckpt, state)
        fabric.print(f"step {state['step']}", flush=True)
        time.sleep(args.sleep)

if fabric.is_global_zero:
    torch.save(model.state_dict(), args.out)
fabric.print("done", flush=True)
