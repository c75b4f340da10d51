"""A run whose ``except KeyboardInterrupt:`` saves a last checkpoint through storage so slow that the save stays
at one line for 15 s, longer than the interrupt grace (``signals.INTERRUPT_GRACE_S``): the Ctrl-C tests' subject.

    python last_save.py FOLDER 1    one process
    python last_save.py FOLDER 2    two processes (fabric.launch(), DDP): rank 1 waits for rank 0's write in save's
                                    last collective, then both meet at a barrier

Each rank prints "PID <rank> <pid>" once it runs, "READY <rank>" once it waits for the Ctrl-C, "SAVING <rank>" in
its handler and "SAVED <rank> <step>" at its end.
"""

import os
import sys
import time

import torch

from fabriclite import Fabric
from fabriclite.checkpoint import TorchCheckpointIO

SLOW_S = 15.0


class SlowStorage(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        time.sleep(SLOW_S)  # network storage on a bad day: one line, longer than the grace
        super().save_checkpoint(checkpoint, path, storage_options)


if __name__ == "__main__":
    folder, devices = sys.argv[1], int(sys.argv[2])
    strategy = "ddp" if devices > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=[SlowStorage()])
    fabric.launch()
    rank = fabric.global_rank
    print(f"PID {rank} {os.getpid()}", flush=True)
    model = torch.nn.Linear(4, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    step = 0
    try:
        for step in range(3):  # noqa: B007 (saved by the Ctrl-C handler)
            fabric.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
        fabric.barrier()
        print(f"READY {rank}", flush=True)
        while True:  # the loop the Ctrl-C stops, between steps on every rank
            time.sleep(0.1)
    except KeyboardInterrupt:
        print(f"SAVING {rank}", flush=True)
        fabric.save(os.path.join(folder, "last.ckpt"), {"model": model, "step": step})
        fabric.barrier()
        print(f"SAVED {rank} {step}", flush=True)
