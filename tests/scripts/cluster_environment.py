"""One srun task: SLURM's variables say rank and world size, and stale torchrun-style RANK variables say otherwise;
Fabric(plugins=[SLURMEnvironment()]) must follow SLURM. Prints "PASS <rank> <name>"."""

import os

import torch

from fabriclite import Fabric
from fabriclite.plugins.environments import SLURMEnvironment

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[SLURMEnvironment()])
rank = fabric.global_rank
ranks = fabric.all_gather(torch.tensor(rank))
ok = rank == int(os.environ["SLURM_PROCID"]) and ranks.tolist() == [0, 1]
os.write(1, f"{'PASS' if ok else 'FAIL'} {rank} joined as SLURM says\n".encode())
fabric.barrier()
