"""Runs on 4 CPU processes on a 2x2 mesh and checks that training equals one process on the full batch, step by
step, and that a save/load resumes identically. `python mesh_checks.py OUT_DIR MODES [cli]`, MODES a comma-separated
list of "tp" (ModelParallelStrategy: tensor parallel x FSDP2), "hsdp" (FSDPStrategy(sharding_strategy="HYBRID_SHARD"))
and "noshard" ("NO_SHARD": a (4, 1) mesh); "cli" when `fabriclite run --num-nodes 2 --devices 2` started it. Prints
"PASS <rank> <mode>: <name>" per check."""

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric
from fabriclite.metrics import SumMetric
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy

STEPS, SAVED_AT, BATCH, TOLERANCE = 6, 3, 8, 1e-5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.down(torch.relu(self.up(x)))))


def parallelize(model, mesh):
    # Tensor parallel first (colwise up, rowwise down: one all-reduce per block), FSDP2 on the data-parallel ranks last.
    parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def data():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(STEPS * BATCH, 8, generator=generator), torch.randint(
        0, 3, (STEPS * BATCH,), generator=generator
    )


def one_process_losses():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    xs, ys = data()
    losses = []
    for step in range(STEPS):
        loss = F.cross_entropy(model(xs[step * BATCH : (step + 1) * BATCH]), ys[step * BATCH : (step + 1) * BATCH])
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return losses


def build(fabric):
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return fabric.setup(model, optimizer)


def train(fabric, model, optimizer, batches, steps):
    losses = []
    for _, (x, y) in zip(range(steps), batches):
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def strategy_for(mode, from_cli):
    # From `fabriclite run --num-nodes 2 --devices 2` the defaults must give the 2x2 mesh: nodes x devices per node.
    if mode == "tp":
        return ModelParallelStrategy(parallelize) if from_cli else ModelParallelStrategy(parallelize, 2, 2)
    if mode == "hsdp":
        hybrid = {} if from_cli else {"device_mesh": (2, 2)}
        return FSDPStrategy(sharding_strategy="HYBRID_SHARD", **hybrid)
    return FSDPStrategy(sharding_strategy="NO_SHARD")


def run(mode, out, from_cli):
    fabric = Fabric(strategy=strategy_for(mode, from_cli), **({} if from_cli else {"accelerator": "cpu", "devices": 4}))
    fabric.launch()
    rank = fabric.global_rank

    def check(name, condition, detail=""):
        if not condition:
            raise AssertionError(f"rank {rank}: {mode}: {name} failed {detail}")
        os.write(1, f"PASS {rank} {mode}: {name}\n".encode())

    expected = one_process_losses()
    shape, shards = {"tp": ((2, 2), 2), "hsdp": ((2, 2), 4), "noshard": ((4, 1), 4)}[mode]
    check("the mesh has the expected shape", tuple(fabric.device_mesh.shape) == shape, fabric.device_mesh)
    model, optimizer = build(fabric)
    check("parameters are DTensors on the mesh", all(isinstance(p, DTensor) for p in model.parameters()))
    placements = [type(p).__name__ for p in model.module.up.weight.placements]
    if mode == "tp":  # FSDP over data parallel (strided, since tensor parallel split the rows first), then TP
        check("up is split over both dimensions", placements == ["_StridedShard", "Shard"], placements)
    else:
        check("replicated across groups, sharded within", placements == ["Replicate", "Shard"], placements)

    xs, ys = data()
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(xs, ys), batch_size=BATCH // shards))
    batches = iter(loader)
    losses = train(fabric, model, optimizer, batches, SAVED_AT)
    fabric.save(out / "mid.ckpt", {"model": model, "optimizer": optimizer, "loader": loader})
    losses += train(fabric, model, optimizer, batches, STEPS - SAVED_AT)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    check("every step's loss equals one process on the full batch", worst < TOLERANCE, f"{losses} vs {expected}")

    model, optimizer = build(fabric)
    loader = fabric.setup_dataloaders(DataLoader(TensorDataset(xs, ys), batch_size=BATCH // shards))
    fabric.load(out / "mid.ckpt", {"model": model, "optimizer": optimizer, "loader": loader})
    resumed = train(fabric, model, optimizer, iter(loader), STEPS - SAVED_AT)
    check(
        "a loaded checkpoint resumes with the same losses",
        resumed == losses[SAVED_AT:],
        f"{resumed} vs {losses[SAVED_AT:]}",
    )

    if mode == "tp" and (out.parent / "hsdp" / "mid.ckpt").exists():
        # DCP reshards by global offsets: HSDP's (replicate, shard) layout loads into tensor parallel x FSDP2.
        model, optimizer = build(fabric)
        fabric.load(out.parent / "hsdp" / "mid.ckpt", {"model": model, "optimizer": optimizer})
        batches = iter(fabric.setup_dataloaders(DataLoader(TensorDataset(xs, ys), batch_size=BATCH // shards)))
        for _ in range(SAVED_AT):
            next(batches)
        resumed = train(fabric, model, optimizer, batches, STEPS - SAVED_AT)
        worst = max(abs(a - b) for a, b in zip(resumed, expected[SAVED_AT:]))
        check("a checkpoint of the hsdp mesh resumes here", worst < TOLERANCE, f"{resumed} vs {expected[SAVED_AT:]}")

    # init_module(empty_init=True): rank 0 builds the weights, the others nothing; after parallelizing, every rank
    # holds its slices of rank 0's, so the model equals one built normally with the same seed.
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        empty = Net()
    empty = fabric.setup_module(empty)
    torch.manual_seed(0)
    reference = Net()
    full = {name: t.full_tensor() for name, t in empty.module.state_dict().items()}
    check("an empty init equals a normal one", all(torch.equal(full[n], t) for n, t in reference.state_dict().items()))

    # A metric over one epoch counts each sample once: under tp, both ranks of a tensor-parallel group read it.
    rows = SumMetric()
    for x, _ in fabric.setup_dataloaders(DataLoader(TensorDataset(xs, ys), batch_size=BATCH // shards)):
        rows.update(torch.ones(len(x)))
    check("a metric counts every sample once", rows.compute().item() == len(xs), rows.compute())

    if mode == "tp":
        strategy = fabric.strategy
        for name, function, error in [
            ("a parallelize_fn returning nothing is refused", lambda m, mesh: None, "returned NoneType"),
            ("a parallelize_fn sharding nothing is refused", lambda m, mesh: m, "still a plain tensor"),
            (
                "a mesh dimension name that does not exist is named",
                lambda m, mesh: parallelize_module(m, mesh["tp"], {}),
                "('data_parallel', 'tensor_parallel')",
            ),
        ]:
            strategy.parallelize_fn = function
            try:
                fabric.setup_module(Net())
                message = ""
            except (TypeError, ValueError) as err:
                message = str(err)
            check(name, error in message, message)
    fabric.barrier()


def main():
    out, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    for mode in modes:
        run(mode, out / mode, from_cli=sys.argv[3:] == ["cli"])


if __name__ == "__main__":
    main()
