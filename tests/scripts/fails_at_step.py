"""Started by `fabriclite run --devices 2 --max-restarts N` in tests/test_long_runs.py: a run whose rank 1 raises
the same error at the same step of every attempt (MODE "same"), two errors by turns at that step (MODE
"alternating"), or at a later step after a new checkpoint in each attempt (MODE "later"), while rank 0 is in a
collective with it (and fails on the closed connection).

Saves every 5 steps; rank 1 raises at step 7 (+ 5 per attempt with MODE "later").
Usage: ``fabriclite run --accelerator cpu --devices 2 --max-restarts N fails_at_step.py same|alternating|later FOLDER``
(also with ``--num-nodes 2``, MODE "same", in tests/test_long_runs_nodes.py).
"""

import os
import sys
from pathlib import Path

import torch

from fabriclite import Fabric

mode, folder = sys.argv[1], Path(sys.argv[2])
fabric = Fabric()
fabric.launch()
state = {"step": 0}
resumed = fabric.load_latest(folder, state)
# `fabriclite run` on one machine counts the attempts; across machines, torch's agent of each node counts its own.
attempt = int(os.environ.get("FABRICLITE_RESTART_COUNT", os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
fabric.print(f"attempt {attempt} resumed at step {state['step']}", flush=True)
fail_at = 7 + (5 * attempt if mode == "later" else 0)
error = "this batch cannot be trained on" if mode != "alternating" or attempt % 2 == 0 else "nor can this one"
while state["step"] < 30:
    state["step"] += 1
    if fabric.global_rank == 1 and state["step"] == fail_at:
        raise ValueError(error)
    fabric.all_reduce(torch.ones(1))  # rank 0 waits here for rank 1, and fails once it is gone
    if state["step"] % 5 == 0:
        fabric.save(folder / f"step-{state['step']:03d}.ckpt", state)
fabric.print("done", flush=True)
