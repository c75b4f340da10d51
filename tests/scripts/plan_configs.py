"""A small training script whose configuration is chosen by its first argument, for comparing what `fabriclite plan`
says about it with what a real launch (`fabriclite run --devices 2`) does:

- ``hybrid-mesh``: FSDP's hybrid sharding on a (3, 2) mesh, which does not divide a world of 2: setup raises.
- ``tp-missing-layer``: tensor parallel with a plan naming a layer the model lacks: torch warns and skips it.
- ``fine``: plain FSDP; trains.

Prints ``TRAINED <steps>`` after its loop.
"""

import sys

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


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
}


def main() -> None:
    fabric = Fabric(accelerator="cpu", strategy=STRATEGIES[sys.argv[1]]())
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    for step in range(3):  # noqa: B007 (printed after the loop)
        loss = model(torch.randn(8, 32, device=fabric.device)).pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print(f"TRAINED {step + 1}", flush=True)


if __name__ == "__main__":
    main()
