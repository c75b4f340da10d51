"""Which ranks come to be where SLURM's variables are set (tests/test_environment.py starts it as srun's tasks, in
a batch script, an salloc shell or an `srun --pty` shell): Fabric(accelerator="cpu", devices=2, strategy="ddp"),
fabric.launch(), then every rank prints "rank R of W pid P procid X gathered [...]" once the ranks have exchanged
their numbers (X: the process's SLURM_PROCID, or None).

Usage: python slurm_ranks.py [--plugin] (--plugin: Fabric(plugins=[SLURMEnvironment()]) instead of detecting)
"""

import os
import sys

import torch

from fabriclite import Fabric
from fabriclite.plugins.environments import SLURMEnvironment

plugins = [SLURMEnvironment()] if "--plugin" in sys.argv else []
fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugins)
fabric.launch()
ranks = fabric.all_gather(torch.tensor(fabric.global_rank)).tolist()
procid = os.environ.get("SLURM_PROCID")
os.write(
    1, f"rank {fabric.global_rank} of {fabric.world_size} pid {os.getpid()} procid {procid} gathered {ranks}\n".encode()
)
fabric.barrier()
