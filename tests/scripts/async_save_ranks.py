"""Asynchronous saves on 2 processes (DDP, gloo), where only rank 0 writes: a write that fails raises its
CheckpointError on both ranks at the next save, a user's file at the target is refused on both ranks at once and left
as it was, staging that fails on rank 0 alone (its host memory refused: mocked, since a real allocation failure
cannot be made to happen here, or a value of its state that cannot be copied) raises on both ranks at that call and
leaves them in step, and afterwards both ranks save again and agree on the newest complete checkpoint. Prints "PASS <rank> <check>" for each check on each
rank.

Usage: `python async_save_ranks.py FOLDER`.
"""

import errno
import sys
import threading
from pathlib import Path

import torch

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError, TorchCheckpointIO


class FullDiskIO(TorchCheckpointIO):
    """Writes fail with "no space left" for a path named step-2.ckpt."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if Path(path).name == "step-2.ckpt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        super().save_checkpoint(checkpoint, path, storage_options)


folder = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[FullDiskIO()])
fabric.launch()
rank = fabric.global_rank
weight = torch.full((4,), float(rank))


def save(step, **more):
    fabric.save(folder / f"step-{step}.ckpt", {"step": step, "weight": weight, **more}, asynchronous=True)


def save_fails(step, reason, text, check, raised=CheckpointError, **more):
    try:
        save(step, **more)
    except raised as error:
        assert getattr(error, "reason", reason) == reason and text in str(error), str(error)
        print(f"PASS {rank} {check}", flush=True)
    else:
        raise AssertionError(f"rank {rank}: saving step-{step}.ckpt did not raise ({check})")


save(1)
save(2)  # returns before rank 0's write fails
save_fails(3, "disk full", "step-2.ckpt", "failed write raises on every rank")
if fabric.is_global_zero:
    (folder / "step-4.ckpt").write_text("a user's notes\n")
fabric.barrier()
save_fails(4, "occupied", "Will not save", "occupied target refused on every rank")
if fabric.is_global_zero:
    fabric._checkpointer._buffer = lambda *args, **kwargs: (_ for _ in ()).throw(MemoryError("no pinned memory left"))
save_fails(5, "unwritable", "no pinned memory left", "a staging failure on rank 0 alone raises on every rank")
fabric._checkpointer.__dict__.pop("_buffer", None)
fabric.all_reduce(weight)  # the ranks are still in step
lock = {"handle": threading.Lock()} if fabric.is_global_zero else {}
copy_refused = "a value rank 0 cannot copy raises on every rank"
save_fails(6, "unwritable", "cannot be copied", copy_refused, (TypeError, CheckpointError), **lock)
save(7)
newest = fabric.load_latest(folder, {"step": 0, "weight": weight})
assert newest == folder / "step-7.ckpt", newest
assert (folder / "step-4.ckpt").read_text() == "a user's notes\n"
assert sorted(path.name for path in folder.iterdir()) == ["step-1.ckpt", "step-4.ckpt", "step-7.ckpt"]
print(f"PASS {rank} newest agreed after failures", flush=True)
