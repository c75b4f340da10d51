"""On a 2 MB file system (a tmpfs the test mounts): a small checkpoint saves, a 4 MB one fails with a
CheckpointError that says the disk is full and names the path; the small one still loads and nothing else is left
in the folder. Prints "PASS disk full".

Usage: `python checkpoint_disk_full.py DISK file|sharded`.
"""

import os
import sys
from pathlib import Path

import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError
from fabriclite.strategies import FSDPStrategy

disk, kind = Path(sys.argv[1]), sys.argv[2]
if kind == "file":
    fabric = Fabric(accelerator="cpu")
else:
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
small = fabric.setup(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
big = fabric.setup(nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)))  # 8 MB of parameters
path = disk / "c.ckpt"
fabric.save(path, {"model": small, "version": 1})
try:
    fabric.save(path, {"model": big, "version": 2})
except CheckpointError as error:
    message = str(error)
    assert error.reason == "disk full", message
    assert "no space left on device" in message and str(path) in message and "intact" in message, message
else:
    raise AssertionError("saving 8 MB onto a 2 MB disk did not fail")
assert sorted(os.listdir(disk)) == ["c.ckpt"], os.listdir(disk)
state = {"model": small, "version": 0}
with torch.no_grad():
    for p in small.parameters():
        p.zero_()
fabric.load(path, state)
assert state["version"] == 1 and any(bool(p.abs().sum() > 0) for p in small.parameters())
print("PASS disk full", flush=True)
