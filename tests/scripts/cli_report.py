"""Started by `fabriclite run` in tests/test_cli.py: a Fabric() with no arguments, so every setting comes from the
command line. Each rank prints what it got, its script arguments and an all_reduce over every rank."""

import ctypes
import os
import signal
import sys

import torch

# Test hygiene only: if the test kills `fabriclite run` with SIGKILL, torchrun cannot stop its workers (they run in
# their own sessions), so each worker asks the kernel to kill it when its parent dies.
ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG

from fabriclite import Fabric  # noqa: E402

fabric = Fabric()
fabric.launch()
total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum").item()
line = (
    f"rank {fabric.global_rank} of {fabric.world_size} node {fabric.node_rank} accelerator {fabric.accelerator.name} "
    f"precision {fabric._precision.name} args {sys.argv[1:]} sum {total:g}\n"
)
os.write(1, line.encode())  # one write: the ranks share one pipe, and print() writes the newline separately
