"""A 2-process run in which one rank fails: "crash" raises on rank 1, "kill" SIGKILLs rank 1, "hang" stalls rank 1
forever while rank 0 waits in a collective with a 3 s timeout, "late" lets rank 0 finish while rank 1 exits with
code 3 afterwards, and "kill-late" has rank 0 raise while rank 1 SIGKILLs itself a moment later (as when a dying peer
breaks rank 0's collective before rank 0 can see the peer exit), and "kill-redirected" SIGKILLs rank 1 while rank 0
writes sys.stderr into a buffer (as torch's excepthook does while the launcher's runs). Each process prints its PID
first, so the test can look for orphans."""

import io
import os
import signal
import sys
import time
from datetime import timedelta

import torch

from fabriclite import Fabric
from fabriclite.strategies import DDPStrategy

mode = sys.argv[1]
fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=3)))
fabric.launch()
print(f"PID {fabric.global_rank} {os.getpid()}", flush=True)
fabric.barrier()
if mode == "late":
    if fabric.global_rank == 1:
        time.sleep(1)
        sys.exit(3)
    sys.exit(0)
if mode == "kill-late":
    if fabric.global_rank == 0:
        raise RuntimeError("rank 0 fails on purpose")
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "kill-redirected":
    if fabric.global_rank == 0:
        sys.stderr = io.StringIO()
        time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)
if fabric.global_rank == 1:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "crash":
        raise RuntimeError("rank 1 fails on purpose")
    time.sleep(3600)
fabric.all_reduce(torch.ones(1))
print("unreachable", flush=True)
