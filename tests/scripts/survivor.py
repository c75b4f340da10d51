"""Two ranks started as srun starts them (RANK, WORLD_SIZE and MASTER_* set by the test), FSDP: both read
`fabric.preempted`; rank 1 prints "ready" and sleeps until the test SIGKILLs it; rank 0 reads `fabric.preempted`
once more (an all-reduce rank 1 never joins, left in flight), prints "waiting", and ends its script normally once
the test has created the file GO (after the kill). Usage: ``python survivor.py GO``."""

import sys
import time
from pathlib import Path

import torch

from fabriclite import Fabric

go = Path(sys.argv[1])
fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
model = fabric.setup(torch.nn.Linear(4, 4))
assert fabric.preempted is False
if fabric.global_rank == 1:
    print("ready", flush=True)
    time.sleep(300)
assert fabric.preempted is False  # starts an all-reduce that rank 1, killed, never joins
print("waiting", flush=True)
deadline = time.monotonic() + 120
while not go.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
print("end of script", flush=True)
