"""A small training script whose configuration is chosen by its first argument, for comparing what `fabriclite plan`
says about it with what a real launch (`fabriclite run --devices 2`) does:

- ``hybrid-mesh``: FSDP's hybrid sharding on a (3, 2) mesh, which does not divide a world of 2: setup raises.
- ``tp-missing-layer``: tensor parallel with a plan naming a layer the model lacks: torch warns and skips it.
- ``fine``: plain FSDP; trains.
- ``checkpointed``: FSDP checkpointing the activations of each block; trains.
- ``uneven``: plain FSDP of a model with a layer of 9 outputs: over 4 ranks, ranks 0-2 hold 3 rows of its weight
  each and rank 3 none, so rank 3 is a kind of rank of its own; trains.
- ``unsplittable-batches``: FSDP on batches from a batch sampler of the script's own that fabriclite cannot split
  between the ranks (it has no ``.sampler``): ``setup_dataloaders`` raises.

A second argument, BATCH, trains on batches of BATCH rows from a loader set up by Fabric instead of 8 random rows.

Prints ``TRAINED <steps>`` after its loop.
"""

import sys

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Rows(Dataset):
    """100,000 rows of 32 values, each made when it is read: no memory held for the data set."""

    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.full((32,), index / len(self))


def parallelize(model: nn.Module, mesh) -> nn.Module:
    for block in model:
        parallelize_module(block, mesh["tensor_parallel"], {"up": ColwiseParallel(), "gate": ColwiseParallel()})
        parallelize_module(block, mesh["tensor_parallel"], {"down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])


STRATEGIES = {
    "hybrid-mesh": lambda: FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(3, 2)),
    "tp-missing-layer": lambda: ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2),
    "fine": lambda: FSDPStrategy(),
    "checkpointed": lambda: FSDPStrategy(activation_checkpointing_policy={Block}),
    "unsplittable-batches": lambda: FSDPStrategy(),
    "uneven": lambda: FSDPStrategy(),
}


class Chunks:
    """Batches of 8 consecutive rows, drawn by a batch sampler with no ``.sampler`` for fabriclite to shard."""

    def __iter__(self):
        return (list(range(start, start + 8)) for start in range(0, 64, 8))

    def __len__(self) -> int:
        return 8


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy=STRATEGIES[sys.argv[1]]())
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    if sys.argv[1] == "uneven":
        model = nn.Sequential(nn.Linear(32, 4096), nn.ReLU(), nn.Linear(4096, 9), nn.Linear(9, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    batches = (torch.randn(8, 32, device=fabric.device) for _ in range(3))
    if len(sys.argv) > 2 or sys.argv[1] == "unsplittable-batches":
        loader = (
            DataLoader(Rows(), batch_size=int(sys.argv[2]))
            if len(sys.argv) > 2
            else DataLoader(Rows(), batch_sampler=Chunks())
        )
        loader = fabric.setup_dataloaders(loader)
        batches = (x for _ in range(3) for x in loader)
    for step, x in zip(range(3), batches):  # noqa: B007 (printed after the loop)
        loss = model(x).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"TRAINED {step + 1}", flush=True)


if __name__ == "__main__":
    main()
