"""FSDP on 2 processes: a flipped byte in rank 1's shard is refused on both ranks (each rank checks a share of the
files, all learn the result) before any weight changes, and a save that fails on rank 0 alone raises the same
CheckpointError on both ranks instead of leaving rank 1 waiting. Prints "PASS <rank> <name>".

Usage: `python fsdp_damaged.py OUT_DIR`.
"""

import sys
from pathlib import Path

import torch
from check_report import report
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError
from fabriclite.strategies import FSDPStrategy

out = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="sharded"))
fabric.launch()
rank = fabric.global_rank
model = fabric.setup(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
path = out / "sharded.ckpt"
fabric.save(path, {"model": model})
fabric.barrier()
if rank == 0:
    shard = path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
fabric.barrier()
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(1.0)
changed = [p.to_local().detach().clone() for p in model.parameters()]
try:
    fabric.load(path, {"model": model})
    error = None
except CheckpointError as caught:
    error = caught
report(
    rank,
    "a flipped byte in another rank's shard is refused",
    error is not None and error.reason == "corrupt",
    repr(error),
)
report(rank, "the error names the damaged shard", error is not None and "__1_0.distcp" in str(error), repr(error))
report(rank, "no weight changed", all(torch.equal(p.to_local(), c) for p, c in zip(model.parameters(), changed)))

(out / "a_file").write_text("not a folder")
try:
    fabric.save(out / "a_file" / "last.ckpt", {"model": model})  # rank 0 cannot make the folder: a file is there
    error = None
except CheckpointError as caught:
    error = caught
report(rank, "a save failing on rank 0 raises on every rank", error is not None and "a_file" in str(error), repr(error))
fabric.barrier()
print(f"DONE {rank}", flush=True)
