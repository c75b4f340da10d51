"""Saves a sharded checkpoint on 2 processes in a loop until killed; version v fills every parameter with v.
With a checkpoint already there, loads it first and continues from its version. Prints "saved <v>" per save.
"""

import os
import sys

import torch
from torch import nn

from fabriclite import Fabric

path = sys.argv[1]
fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
fabric.launch()
print(f"PID {fabric.global_rank} {os.getpid()}", flush=True)
# 64 MB of parameters, 32 MB per rank, so a save takes long enough to be interrupted.
model = fabric.setup(nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(4))))
state = {"model": model, "version": 0}
if os.path.exists(path):
    fabric.load(path, state)
    fabric.print(f"resumed {state['version']}", flush=True)
while True:
    state["version"] += 1
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float(state["version"]))
    fabric.save(path, state)
    fabric.print(f"saved {state['version']}", flush=True)
