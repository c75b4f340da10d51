"""A LightningModule under fabriclite, as under Lightning Fabric: self.log, self.log_dict, self.logger,
self.fabric and self.optimizers() inside it go through the Fabric. Usage: ``python lightning_module.py lightning``
(or ``pytorch_lightning``); prints "PASS 0 <name>" per check. In its own process: importing Lightning patches
``torch.compile`` process-wide.
"""

import csv
import importlib
import os
import sys
import tempfile

import torch
from check_report import report

from fabriclite import Fabric
from fabriclite.loggers import CSVLogger

LightningModule = importlib.import_module(sys.argv[1]).LightningModule


class LitNet(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch):
        loss = self(batch).pow(2).mean()
        self.log("loss", loss)
        self.log_dict({"a": 1.0, "b": torch.tensor(2.0)})
        self.logger.log_metrics({"direct": 3.0}, step=9)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


folder = tempfile.mkdtemp()
fabric = Fabric(accelerator="cpu", loggers=CSVLogger(folder))
net = LitNet()
model, optimizer = fabric.setup(net, net.configure_optimizers())
report(0, "the module knows its Fabric", net.fabric is fabric and net.logger is fabric.logger)
report(0, "self.optimizers() is the optimizer setup returned", net.optimizers() is optimizer)
loss = model.training_step(torch.ones(3, 2))
fabric.backward(loss)
optimizer.step()
fabric.logger.save()
with open(os.path.join(fabric.logger.log_dir, "metrics.csv"), newline="") as file:
    rows = list(csv.DictReader(file))
logged = {key: float(value) for row in rows for key, value in row.items() if value and key != "step"}
report(0, "self.log and self.log_dict reach the loggers", logged.keys() == {"loss", "a", "b", "direct"})
report(0, "the logged loss is the step's loss", abs(logged["loss"] - loss.item()) < 1e-6 and logged["b"] == 2.0)
report(0, "the module hears the Fabric's hooks", net in fabric._callbacks)
