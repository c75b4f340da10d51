"""Compares fabriclite's pl_worker_init_function with Lightning's on the same base seeds, workers and ranks; in its
own process, since importing Lightning patches torch.compile process-wide. Prints "PASS 0 <name>"."""

import os
import random
import sys

import numpy as np
import torch

from fabriclite.seed import pl_worker_init_function as ours

theirs = __import__(sys.argv[1], fromlist=["x"]).fabric.utilities.seed.pl_worker_init_function


def draws(init, base_seed, worker_id, rank):
    torch.manual_seed(base_seed + worker_id)  # what a DataLoader does in worker worker_id
    init(worker_id, rank=rank)
    return torch.rand(3).tolist(), random.random(), np.random.rand(3).tolist()


cases = [(0, 0, 0), (42, 1, 0), (42, 0, 3), (2**40 + 7, 5, 1), (123456789, 7, 15)]
same = all(draws(ours, *case) == draws(theirs, *case) for case in cases)
os.write(1, f"{'PASS' if same else 'FAIL'} 0 the same seeds as Lightning's\n".encode())
