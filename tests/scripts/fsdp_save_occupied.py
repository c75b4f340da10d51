"""FSDP on 2 processes saves onto paths that hold the user's files (a folder of files, a text file): every rank raises
the same CheckpointError ("occupied") and every file is kept byte for byte, in the sharded and the full format; our
own checkpoint folder and file are replaced. Loading a sharded checkpoint into a model of another shape raises a
CheckpointError that is also a RuntimeError, naming the shapes. Prints "PASS <rank> <name>".

Usage: `python fsdp_save_occupied.py OUT_DIR`.
"""

import sys
from pathlib import Path

from check_report import report
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError
from fabriclite.strategies import FSDPStrategy


def files_under(folder):
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def attempt(call, *args):
    """The CheckpointError ``call(*args)`` raised, or None."""
    try:
        call(*args)
    except CheckpointError as error:
        return error
    return None


out = Path(sys.argv[1])
sharded = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="sharded"))
sharded.launch()
full = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full"))
full.launch()
rank = sharded.global_rank
users = out / "users"
if rank == 0:
    (users / "data").mkdir(parents=True)
    (users / "notes.txt").write_text("my notes")
    (users / "data" / "table.csv").write_bytes(b"a,b\n1,2\n")
    (out / "log.txt").write_text("epoch 1 loss 0.3\n")
sharded.barrier()
before = files_under(users)

for name, fabric in [("sharded", sharded), ("full", full)]:
    model = fabric.setup(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))
    error = attempt(fabric.save, users, {"model": model})
    report(
        rank,
        f"{name}: a folder of user files is refused on every rank",
        error is not None and error.reason == "occupied" and "notes.txt" in str(error),
        repr(error),
    )
    fabric.barrier()
    report(rank, f"{name}: the user's files are kept byte for byte", files_under(users) == before)

error = attempt(sharded.save, out / "log.txt", {"step": 1})
report(
    rank,
    "sharded: a text file is refused on every rank",
    error is not None and "text file" in str(error) and (out / "log.txt").read_text() == "epoch 1 loss 0.3\n",
    repr(error),
)

path = out / "last.ckpt"
for step in range(2):
    sharded.save(path, {"step": step})
report(rank, "our own checkpoint folder is replaced", path.is_dir() and sharded.load(path)["step"] == 1)
full.save(path, {"step": 2})
full.save(path, {"step": 3})
report(rank, "our own checkpoint file is replaced", path.is_file() and full.load(path)["step"] == 3)

path = out / "model.ckpt"
sharded.save(path, {"model": sharded.setup(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)))})
wider = sharded.setup(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)))
error = attempt(sharded.load, path, {"model": wider})
report(
    rank,
    "sharded: loading into a model of another shape is a CheckpointError and a RuntimeError naming the shapes",
    isinstance(error, RuntimeError) and "0.weight is [16, 16] in the checkpoint, [32, 16] in the model" in str(error),
    repr(error),
)
sharded.barrier()
print(f"DONE {rank}", flush=True)
