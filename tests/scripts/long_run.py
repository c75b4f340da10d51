"""A run that survives restarts and preemption, started by `fabriclite run --devices 2` in tests/test_long_runs.py:
`load_latest` at the top, a checkpoint every few steps, `fabric.preempted` checked every step.

Prints "pid RANK PID" at the start, "step N" (rank 0) after every step, "RANK saved at step N on preemption" when
preempted (then exits with 75), and writes rank 0's final weights to --out.
Usage: fabriclite run --accelerator cpu --devices 2 long_run.py FOLDER --out W.pt [--asynchronous] [--sleep S]
[--slow-io S] (each checkpoint file takes S seconds longer to write; "saving" is printed first)
[--requeue-signal NAME] [--no-auto-requeue] (Fabric(plugins=[SLURMEnvironment(auto_requeue=..., requeue_signal=...)]))
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.checkpoint import TorchCheckpointIO
from fabriclite.plugins.environments import SLURMEnvironment
from fabriclite.processes.preemption import PREEMPTED_EXIT_CODE
from noisy_step import noisy_step

parser = argparse.ArgumentParser()
parser.add_argument("folder", type=Path)
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save-every", type=int, default=10)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--asynchronous", action="store_true")
parser.add_argument("--slow-io", type=float, default=0.0)
parser.add_argument("--accelerator", default="auto")  # run without `fabriclite run`, which sets them otherwise
parser.add_argument("--devices", default="auto")
parser.add_argument("--requeue-signal")  # e.g. SIGUSR2
parser.add_argument("--no-auto-requeue", action="store_true")
args = parser.parse_args()

seed_everything(7, verbose=False)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = TensorDataset(torch.randn(400, 8), torch.randint(0, 4, (400,)))
loader = DataLoader(data, batch_size=8, shuffle=True)


class SlowIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        print("saving", flush=True)
        time.sleep(args.slow_io)
        super().save_checkpoint(checkpoint, path, storage_options)


plugins = [SlowIO()] if args.slow_io else []
if args.requeue_signal:
    plugins.append(
        SLURMEnvironment(auto_requeue=not args.no_auto_requeue, requeue_signal=getattr(signal, args.requeue_signal))
    )
fabric = Fabric(accelerator=args.accelerator, devices=args.devices, plugins=plugins)
fabric.launch()
print(f"pid {fabric.global_rank} {os.getpid()}", flush=True)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(loader)
state = {"model": model, "optimizer": optimizer, "loader": loader, "epoch": 0, "step": 0}
resumed = fabric.load_latest(args.folder, state)
fabric.print(f"resumed from {resumed.name} at step {state['step']}" if resumed else "fresh start", flush=True)


def save():
    path = args.folder / f"step-{state['step']:04d}.ckpt"
    fabric.save(path, state, keep_last=2, asynchronous=args.asynchronous)


# The first read installs the signal handlers (a collective, so on every rank) before any "step" line: a notice the
# tests send on seeing one is then always noted, never the signal's default death.
preempted = fabric.preempted
for epoch in range(state["epoch"], args.epochs):
    state["epoch"] = epoch
    for x, y in loader:
        noisy_step(fabric, model, optimizer, x, y)
        state["step"] += 1
        if state["step"] % args.save_every == 0:
            save()
        fabric.print(f"step {state['step']}", flush=True)
        if fabric.preempted:  # after the step: the batch the loader gave is trained on before the loader is saved
            save()
            print(f"{fabric.global_rank} saved at step {state['step']} on preemption", flush=True)
            preempted = True
            break
        time.sleep(args.sleep)
    if preempted:
        break

if not preempted:
    # FSDP's parameters are DTensors: every rank takes part in gathering their full values.
    weights = {name: getattr(value, "full_tensor", lambda v=value: v)() for name, value in model.state_dict().items()}
    if fabric.is_global_zero:
        torch.save(weights, args.out)
fabric.print("done" if not preempted else "stopped for preemption", flush=True)
if preempted:
    sys.exit(PREEMPTED_EXIT_CODE)  # 75, "preempted, resumable": the same under `fabriclite run`, srun or torchrun
