"""A small training loop that preemption notices reach at awkward moments (tests/test_signals.py sends them).

Every step trains, then reads `fabric.preempted`; when it is True the rank saves `step-N.ckpt`, prints "RANK saved at
step N on preemption" and exits 75. Prints "step N" (rank 0) after each step. Modes:

- "setup": the notice comes during 4 s of setup after the Fabric exists (printed "setting up"), before any read.
- "imports": 4 s pass before the Fabric exists (printed "importing"), as while torch imports on a loaded machine.
- "workers": batches come from a DataLoader with 2 worker processes (SLURM signals every process of the step).
- "slow-save" / "slow-save-async": the save at step 3 takes 8 s (a slow CheckpointIO; printed "saving"),
  synchronous or asynchronous; the loop goes on after it.
- "busy-ranks" (2 processes through fabric.launch()): rank 0's save at step 3 takes 14 s, while rank 1 waits in
  the save's collective (printed "saving").

Usage: `python notices.py FOLDER MODE`.
"""

import os
import sys
import time
from pathlib import Path

mode = sys.argv[2]
if mode == "imports":
    print("importing", flush=True)
    time.sleep(4)

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from fabriclite import Fabric  # noqa: E402
from fabriclite.checkpoint import TorchCheckpointIO  # noqa: E402


class SlowIO(TorchCheckpointIO):
    """Writes step-3.ckpt slowly, as a large checkpoint on a slow disk is written."""

    seconds = 14 if mode == "busy-ranks" else 8

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        if Path(path).name == "step-3.ckpt":
            print("saving", flush=True)
            time.sleep(self.seconds)
        super().save_checkpoint(checkpoint, path, storage_options)


class Numbers(Dataset):
    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        time.sleep(0.01)
        return torch.full((4,), float(index))


folder = Path(sys.argv[1])
devices = 2 if mode == "busy-ranks" else 1
fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", plugins=[SlowIO()])
fabric.launch()
rank = fabric.global_rank
print(f"pid {rank} {os.getpid()}", flush=True)
if mode == "setup":
    print("setting up", flush=True)
    time.sleep(4)
model = fabric.setup(torch.nn.Linear(4, 4))
workers = 2 if mode == "workers" else 0
batches = iter(DataLoader(Numbers(), batch_size=4, num_workers=workers))
for step in range(1, 400):
    fabric.backward(model(next(batches)).sum())
    fabric.print(f"step {step}", flush=True)
    state = {"model": model, "step": step}
    if step == 3 and mode.startswith(("slow-save", "busy-ranks")):
        fabric.save(folder / "step-3.ckpt", state, asynchronous=mode == "slow-save-async")
    if fabric.preempted:
        fabric.save(folder / f"step-{step}.ckpt", state)
        print(f"{rank} saved at step {step} on preemption", flush=True)
        sys.exit(75)
    time.sleep(0.05)
print("never preempted", flush=True)
