"""A 2-process DDP run in which rank 1 stops taking part: the stall watchdog's and the interrupt guard's subject.

    python stalls.py hang [stall_timeout]   rank 1 sleeps after two steps; rank 0 goes on and waits in backward
    python stalls.py deaf [stall_timeout]   the same, and rank 1 ignores SIGINT (a rank an interrupt cannot end)
    python stalls.py spawn_hang             the same under ddp_spawn, rank 0 waiting in fabric.all_reduce
    python stalls.py fork_hang              the same under ddp_notebook (processes forked)
    python stalls.py join [stall_timeout]   no launch(): joins the job the environment names (stale variables,
                                            torchrun); "join_deaf": and rank 1 ignores SIGINT

Each rank prints "PID <rank> <pid>" once it runs, and "WAITING <rank>" before the step it will wait in.
"""

import faulthandler
import os
import signal
import sys
import time

import torch

from fabriclite import Fabric
from fabriclite.strategies import DDPStrategy

# SIGUSR2 prints every thread's stack: what a test shows when a rank does not end.
faulthandler.register(signal.SIGUSR2, all_threads=True)


def train(fabric: Fabric, deaf: bool) -> None:
    print(f"PID {fabric.global_rank} {os.getpid()}", flush=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(1000):
        if fabric.global_rank == 1 and step == 2:
            if deaf:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            time.sleep(3600)  # the hung rank
        if step == 2:
            print(f"WAITING {fabric.global_rank}", flush=True)
        loss = model(torch.ones(2, 4)).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def all_reduce_forever(fabric: Fabric) -> None:
    print(f"PID {fabric.global_rank} {os.getpid()}", flush=True)
    if fabric.global_rank == 1:
        time.sleep(3600)
    print(f"WAITING {fabric.global_rank}", flush=True)
    while True:
        fabric.all_reduce(torch.ones(1))


if __name__ == "__main__":
    mode = sys.argv[1]
    stall_timeout = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    if mode in ("spawn_hang", "fork_hang"):
        strategy = DDPStrategy(start_method=mode[: -len("_hang")], stall_timeout=stall_timeout)
        Fabric(accelerator="cpu", devices=2, strategy=strategy).launch(all_reduce_forever)
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(stall_timeout=stall_timeout))
        if not mode.startswith("join"):
            fabric.launch()
        train(fabric, deaf=mode.endswith("deaf"))
