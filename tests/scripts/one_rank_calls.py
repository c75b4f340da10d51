"""Two processes (fabric.launch(), gloo) in which only rank 0 makes a call that every rank must make, as
Lightning's reports do it (``if fabric.global_rank == 0: fabric.save(...)``); rank 1 goes on training, or ends.

    python one_rank_calls.py FOLDER STRATEGY CALL [end]

STRATEGY is ddp or fsdp; CALL is save, barrier, all_reduce or load (of a checkpoint both ranks saved first into
FOLDER). With "end", the call comes after the last step, and rank 1 ends its script instead of training on. Each
rank prints "PID <rank> <pid>" once it runs and "STEP <rank> <n>" after each step; rank 0 prints "CALLING" first.
"""

import os
import sys

import torch

from fabriclite import Fabric

STEPS = 4

if __name__ == "__main__":
    folder, strategy, call = sys.argv[1:4]
    ends = sys.argv[4:] == ["end"]
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    print(f"PID {fabric.global_rank} {os.getpid()}", flush=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = {"model": model, "optimizer": optimizer}
    checkpoint = os.path.join(folder, "both.ckpt")
    if call == "load":
        fabric.save(checkpoint, state)  # on every rank, as it should be
    for step in range(STEPS if ends else 1000):
        loss = model(torch.ones(4, 8)).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print(f"STEP {fabric.global_rank} {step}", flush=True)
        if step == (STEPS - 1 if ends else 1) and fabric.global_rank == 0:
            print("CALLING", flush=True)
            if call == "save":
                fabric.save(os.path.join(folder, "rank0.ckpt"), state)
            elif call == "barrier":
                fabric.barrier()
            elif call == "all_reduce":
                fabric.all_reduce(loss.detach())
            elif call == "load":
                fabric.load(checkpoint, state)
            print("CALLED", flush=True)
