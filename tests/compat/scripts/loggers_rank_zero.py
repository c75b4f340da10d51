"""Logging the way the docs teach: a CSVLogger, fabric.log_dict, and rank_zero_only for prints, on 2 processes."""

import csv
import sys
from pathlib import Path

import torch
from common import loader, mlp, report

from fabriclite import Fabric, seed_everything
from fabriclite.loggers import CSVLogger
from fabriclite.utilities import rank_zero_only


@rank_zero_only
def announce(text: str) -> None:
    print(f"ANNOUNCE {text} rank {rank_zero_only.rank}", flush=True)


folder = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", loggers=CSVLogger(folder, name="run"))
fabric.launch()
seed_everything(42)
model = mlp()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer = fabric.setup(model, optimizer)
announce("training starts")
for step, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    fabric.log_dict({"loss": loss.item(), "lr": optimizer.param_groups[0]["lr"]}, step=step)
    report(fabric, step, loss)
fabric.logger.finalize("success")
fabric.barrier()
if fabric.global_rank == 0:
    rows = list(csv.DictReader(open(next(folder.rglob("metrics.csv")))))
    print(f"CSV rows {len(rows)} columns {sorted(rows[0])} last loss {float(rows[-1]['loss']):.6f}", flush=True)
