"""Started by torchrun in tests/test_torchelastic.py: a DDP run that resumes with `load_latest`, saves every 2 steps,
and whose rank 1 raises once, at step 3, while rank 0 waits for it in a collective (the first attempt only: a marker
file in FOLDER remembers it). Prints "attempt A resumed at step S" (rank 0) and "done" at the end.

Usage: ``torchrun ... torchrun_restarts.py FOLDER [DEVICES NUM_NODES]`` (default 2 devices, 1 node).
"""

import os
import sys
from pathlib import Path

import torch
from torch import nn

from fabriclite import Fabric

folder = Path(sys.argv[1])
devices, num_nodes = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (2, 1)
fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy="ddp")
fabric.launch()
torch.manual_seed(0)
model, optimizer = fabric.setup(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Linear(4, 1)))
state = {"model": model, "optimizer": optimizer, "step": 0}
fabric.load_latest(folder, state)
fabric.print(f"attempt {os.environ['TORCHELASTIC_RESTART_COUNT']} resumed at step {state['step']}", flush=True)
while state["step"] < 6:
    fabric.backward(model(torch.ones(2, 4)).sum())  # rank 0 waits here for rank 1, and fails once it is gone
    optimizer.step()
    optimizer.zero_grad()
    state["step"] += 1
    if state["step"] % 2 == 0:
        fabric.save(folder / f"step-{state['step']:03d}.ckpt", state)
    if state["step"] == 3 and fabric.global_rank == 1 and not (folder / "failed-once").exists():
        (folder / "failed-once").touch()
        raise RuntimeError("rank 1 fails once, at step 3")
fabric.print("done", flush=True)
