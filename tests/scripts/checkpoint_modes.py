"""Saves a checkpoint file, a sharded folder (FSDP on one process) and a consolidated file under the given umask,
then prints "MODE <path relative to FOLDER> <octal mode>" for everything it created.

Usage: `python checkpoint_modes.py FOLDER 0o022`.
"""

import os
import sys
from pathlib import Path

from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import consolidate
from fabriclite.strategies import FSDPStrategy

folder, umask = Path(sys.argv[1]), int(sys.argv[2], 8)
os.umask(umask)
Fabric(accelerator="cpu").save(folder / "single.ckpt", {"model": nn.Linear(4, 4)})
fabric = Fabric(accelerator="cpu", devices=1, strategy=FSDPStrategy(state_dict_type="sharded"))
fabric.launch()
model = fabric.setup(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
fabric.save(folder / "nested" / "sharded.ckpt", {"model": model})
fabric.save(folder / "nested" / "sharded.ckpt", {"model": model})  # replacing a folder
consolidate(folder / "nested" / "sharded.ckpt", folder / "consolidated.pt")
for path in sorted(folder.rglob("*")):
    print("MODE", path.relative_to(folder), oct(path.stat().st_mode & 0o777), flush=True)
