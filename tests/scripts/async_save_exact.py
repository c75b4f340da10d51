"""Asynchronous saves on 2 processes (gloo) while the loop goes on at once: the checkpoint is bit for bit the
synchronous one taken at the same point, though right after the call the loop changes the parameters through
``.data`` and in place (as weight clipping, masks and EMAs do), and the next steps change them, BatchNorm's running
statistics (forward) and AdamW's state. The model's head is tied to its embedding. Under DDP and FSDP with
``state_dict_type="full"`` rank 0 writes one file (the tied weight written once); under FSDP with "sharded" every
rank writes its shards, on a process group of the checkpointer's own, while the loop's collectives go on. Prints
"PASS <rank> <check>" for each check.

Usage: `python async_save_exact.py FOLDER [ddp|fsdp|fsdp-sharded]`.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy

folder = Path(sys.argv[1])
name = sys.argv[2] if len(sys.argv) > 2 else "ddp"
strategies = {
    "ddp": "ddp",
    "fsdp": FSDPStrategy(state_dict_type="full"),
    "fsdp-sharded": FSDPStrategy(state_dict_type="sharded"),
}
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategies[name])
fabric.launch()
rank = fabric.global_rank


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 256)
        self.body = nn.Sequential(nn.Linear(256, 2048), nn.BatchNorm1d(2048), nn.ReLU(), nn.Linear(2048, 256))
        self.head = nn.Linear(256, 512, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.body(self.embed(tokens)))


torch.manual_seed(0)
model = Tied()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = fabric.setup(model, optimizer)
state = {"model": model, "optimizer": optimizer, "history": [1.0]}


def train_step():
    loss = model(torch.randint(0, 512, (32,)) + 0 * rank).square().mean()
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
model.body[3].weight.data.mul_(0.5)  # right after the call, not through the optimizer, no version counter moved
with torch.no_grad():
    model.embed.weight.clamp_(-0.01, 0.01)
state["history"].append(2.0)
for _ in range(3):
    train_step()
fabric.load_latest(folder / "none", {})  # waits for the write
saved, expected = fabric.load(folder / "step-2.ckpt"), fabric.load(folder / "sync.ckpt")
assert same_bits(saved, expected), "the asynchronous checkpoint differs from the synchronous one"
fabric.save(folder / "now.ckpt", state)  # the loop did change what the checkpoint holds: the check could fail
now = fabric.load(folder / "now.ckpt")
assert not same_bits(expected["model"]["body.1.running_mean"], now["model"]["body.1.running_mean"])
assert not same_bits(expected["model"]["body.3.weight"], now["model"]["body.3.weight"])
print(f"PASS {rank} asynchronous equals synchronous bit for bit", flush=True)

if name != "fsdp-sharded":
    written = torch.load(folder / "step-2.ckpt", weights_only=True)["model"]
    shared = written["embed.weight"].untyped_storage().data_ptr() == written["head.weight"].untyped_storage().data_ptr()
    assert shared and (folder / "step-2.ckpt").stat().st_size == (folder / "sync.ckpt").stat().st_size
    print(f"PASS {rank} the tied weight is written once", flush=True)
