"""Saves a large checkpoint per step with fabric.save (step-N.ckpt in a folder) until killed; each step's payload is
filled with its number. Usage: python save_steps.py FOLDER [--asynchronous] [--keep-last K]."""

import argparse
from pathlib import Path

import torch

from fabriclite import Fabric

parser = argparse.ArgumentParser()
parser.add_argument("folder", type=Path)
parser.add_argument("--asynchronous", action="store_true")
parser.add_argument("--keep-last", type=int, default=None)
args = parser.parse_args()

fabric = Fabric(accelerator="cpu", devices=1)
payload = torch.empty(16 * 1024 * 1024)  # 64 MB, so a write takes long enough to be interrupted
step = 0
while True:
    step += 1
    payload.fill_(float(step))
    state = {"step": step, "payload": payload}
    fabric.save(args.folder / f"step-{step}.ckpt", state, keep_last=args.keep_last, asynchronous=args.asynchronous)
    print(f"saved {step}", flush=True)
