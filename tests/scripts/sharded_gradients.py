"""Runs on 2 CPU processes: FSDP, HSDP (2 replicas of 1 shard, and 1 replica of 2 shards) and tensor parallelism
each train the same small model for a few steps; the gradients of the first backward and the weights after each
step must equal those of one process training on the whole batch (fp32, to 1e-6). Then each saves a checkpoint
(sharded, or one full file for "hsdp 2x1"), loads it into a fresh model and optimizer, and one more step of both
must agree exactly. Prints "TORCH <version>", then "PASS <rank> <mode>: <check>" per check. `python
sharded_gradients.py OUT_DIR` (the checkpoints go there).

This is what catches a torch whose FSDP2 sums the ranks' gradients where it should average them (torch 2.8 on
gloo: exactly 2x the one-process gradients). Started as a plain `python sharded_gradients.py`: fabric.launch()
starts the second process; each mode's Fabric reuses the two processes.
"""

import copy
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy

STEPS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tensor_parallel(model, mesh):
    for block in model.blocks:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


MODES = {  # name -> (strategy, whether each rank trains on its half of the batch)
    "fsdp": (lambda: FSDPStrategy(), True),
    "hsdp 2x1": (
        lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 1), state_dict_type="full"),
        True,
    ),
    "hsdp 1x2": (lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(1, 2)), True),
    "tp": (lambda: ModelParallelStrategy(tensor_parallel, data_parallel_size=1, tensor_parallel_size=2), False),
}


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def check(rank, name, condition, detail=""):
    if not condition:
        raise AssertionError(f"rank {rank}: {name} failed {detail}")
    os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe


def weights(model):
    return {name: full(p).detach().clone() for name, p in model.module.named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def main():
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    reference = Net()
    xs, ys = torch.randn(STEPS, 8, 8), torch.randint(0, 3, (STEPS, 8))  # [step, global batch, ...]
    one_process = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(one_process.parameters(), lr=0.1, momentum=0.9)
    expected_grads, expected_weights = None, []
    for step in range(STEPS):
        F.cross_entropy(one_process(xs[step]), ys[step]).backward()
        if step == 0:
            expected_grads = {name: p.grad.clone() for name, p in one_process.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        expected_weights.append({name: p.detach().clone() for name, p in one_process.named_parameters()})

    for mode, (strategy, split_batch) in MODES.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy())
        fabric.launch()
        rank = fabric.global_rank
        if rank == 0 and mode == "fsdp":
            os.write(1, f"TORCH {torch.__version__}\n".encode())
        model = copy.deepcopy(reference)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)
        mine = slice(rank * 4, rank * 4 + 4) if split_batch else slice(None)
        for step in range(STEPS):
            fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
            if step == 0:
                grads = {name: full(p.grad) for name, p in model.module.named_parameters()}
                ratio = (grads["head.weight"].norm() / expected_grads["head.weight"].norm()).item()
                worst = max((grads[n] - g).abs().max().item() for n, g in expected_grads.items())
                check(
                    rank, f"{mode}: gradients equal one process's", worst < 1e-6, f"(ratio {ratio:.3f}, off by {worst})"
                )
            optimizer.step()
            optimizer.zero_grad()
            now = weights(model)
            worst = max((now[n] - w).abs().max().item() for n, w in expected_weights[step].items())
            check(rank, f"{mode}: weights after step {step + 1} equal one process's", worst < 1e-6, f"(off by {worst})")

        path = out / mode.replace(" ", "-")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
        resumed = copy.deepcopy(reference)
        resumed_optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9)
        resumed, resumed_optimizer = fabric.setup(resumed, resumed_optimizer)
        left = fabric.load(path, {"model": resumed, "optimizer": resumed_optimizer})
        check(
            rank,
            f"{mode}: a checkpoint loads the weights saved",
            left == {"step": STEPS} and same(weights(resumed), now),
        )
        for m, o in ((model, optimizer), (resumed, resumed_optimizer)):  # the momentum came back too
            fabric.backward(F.cross_entropy(m(xs[0, mine]), ys[0, mine]))
            o.step()
            o.zero_grad()
        check(
            rank,
            f"{mode}: the loaded model and optimizer step as the saved ones",
            same(weights(model), weights(resumed)),
        )
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
