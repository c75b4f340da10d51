"""Asynchronous saves on 2 processes (DDP, gloo) while the loop goes on at once: the checkpoint rank 0 writes is bit
for bit the synchronous one taken at the same point, though the next steps change the parameters, BatchNorm's
running statistics (forward) and AdamW's state; and a parameter changed in place before the next step makes that
save fail with reason "changed" on both ranks, writing nothing. Under FSDP (state_dict_type="full") the sharded
tensors are gathered at the call, so only the first check applies. Prints "PASS <rank> <check>" for each check.

Usage: `python async_save_exact.py FOLDER [ddp|fsdp]`.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.checkpoint import CheckpointError
from fabriclite.strategies import FSDPStrategy

folder = Path(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else "ddp"
fabric = Fabric(
    accelerator="cpu", devices=2, strategy=FSDPStrategy(state_dict_type="full") if name == "fsdp" else "ddp"
)
fabric.launch()
rank = fabric.global_rank
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 2048))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "history": [1.0]}


def train_step():
    loss = model(torch.randn(32, 256) + rank).square().mean()
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()


def same_bits(a, b):
    if isinstance(a, torch.Tensor):
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


for _ in range(2):
    train_step()
fabric.save(folder / "sync.ckpt", state)
fabric.save(folder / "step-2.ckpt", state, asynchronous=True)
state["history"].append(2.0)
for _ in range(3):
    train_step()
fabric.load_latest(folder / "none", {})  # waits for the write
saved, expected = fabric.load(folder / "step-2.ckpt"), fabric.load(folder / "sync.ckpt")
assert same_bits(saved, expected), "the asynchronous checkpoint differs from the synchronous one"
fabric.save(folder / "now.ckpt", state)  # the loop did change what the checkpoint holds: the check could fail
now = fabric.load(folder / "now.ckpt")
assert not same_bits(expected["model"]["1.running_mean"], now["model"]["1.running_mean"])
assert not same_bits(expected["model"]["3.weight"], now["model"]["3.weight"])
print(f"PASS {rank} asynchronous equals synchronous bit for bit", flush=True)
if name == "fsdp":
    sys.exit(0)

fabric.save(folder / "step-5.ckpt", state, asynchronous=True)
with torch.no_grad():
    model.module[3].weight.mul_(0.5)  # on every rank, and not the optimizer's step
train_step()
try:
    fabric.save(folder / "step-6.ckpt", state, asynchronous=True)
except CheckpointError as error:
    assert error.reason == "changed" and "state['model']['3.weight']" in str(error), str(error)
    print(f"PASS {rank} a change before the step fails the save on every rank", flush=True)
else:
    raise AssertionError(f"rank {rank}: the save after a change in place did not raise")
fabric.load_latest(folder / "none", {})
assert not (folder / "step-5.ckpt").exists()
print(f"PASS {rank} nothing written for the changed save", flush=True)
