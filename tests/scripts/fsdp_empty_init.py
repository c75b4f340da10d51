"""init_module(empty_init=True) under FSDP on 2 CPU processes: the model is built on the meta device on every rank,
and setup gives each rank its shards only, filled by reset_parameters() or by a checkpoint; prints "PASS <rank>
<name>" per check."""

import os
import sys
import warnings
from pathlib import Path

import torch
from check_report import report
from torch import nn
from torch.distributed.tensor import DTensor

from fabriclite import Fabric, seed_everything


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + self.linear(self.norm(x))


class Net(nn.Module):
    def __init__(self, width=8, depth=3):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 2)

    def forward(self, x):
        return self.head(self.blocks(x))


class WithOwnParameter(Net):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))  # initialised here, and no reset_parameters() to do it again


def full(module):
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in module.state_dict().items()}


def main():
    folder = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    fabric.launch()
    rank = fabric.global_rank

    seed_everything(3, verbose=False)
    with fabric.init_module(empty_init=True):
        model = Net()
    report(rank, "empty_init builds on the meta device on every rank", all(p.is_meta for p in model.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # over the meta parameters, passed with the model
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every module here has reset_parameters: no warning
        model, optimizer = fabric.setup(model, optimizer)
    weights = full(model)
    report(rank, "each rank holds its shards only", all(p.to_local().shape[0] <= 4 for p in model.parameters()))
    norms = [weights[f"blocks.{i}.norm.weight"] for i in range(3)]
    report(rank, "reset_parameters filled the shards", all(torch.equal(w, torch.ones(8)) for w in norms))
    linear = weights["blocks.0.linear.weight"]
    bound = 1 / 8**0.5
    report(rank, "a Linear gets its usual init", bool(linear.abs().max() <= bound) and linear.std() > bound / 4)
    report(rank, "the shards of one weight are not copies of each other", not torch.equal(linear[:4], linear[4:]))
    sums = fabric.all_gather(torch.stack([t.sum() for t in weights.values()]))
    report(rank, "every rank holds slices of the same weights", torch.equal(sums[0], sums[1]))
    loss = model(torch.randn(4, 8)).pow(2).mean()
    fabric.backward(loss)
    optimizer.step()
    report(rank, "an optimizer built over meta parameters and set up with the model steps the shards", True)

    seed_everything(4, verbose=False)
    fabric.save(folder / "real.ckpt", {"model": fabric.setup(Net())})
    with fabric.init_module(empty_init=True):
        loaded = Net()
    loaded = fabric.setup(loaded)
    fabric.load(folder / "real.ckpt", {"model": loaded})
    seed_everything(4, verbose=False)
    report(
        rank,
        "a checkpoint load fills an empty-init model",
        all(torch.equal(full(loaded)[k], v) for k, v in full(Net()).items()),
    )

    with fabric.init_module(empty_init=True):
        lone = Net()
    try:
        fabric.setup_optimizers(torch.optim.SGD(lone.parameters(), lr=0.1))
        refused = ""
    except RuntimeError as error:
        refused = str(error)
    report(
        rank,
        "an optimizer over meta parameters of a model not set up is refused in Lightning's words",
        "The optimizer has references to the model's meta-device parameters" in refused,
        refused,
    )

    with fabric.init_module(empty_init=True):
        partial = WithOwnParameter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.setup(partial)
    said = " ".join(str(w.message) for w in caught)
    report(
        rank,
        "a module without reset_parameters is named in Lightning's warning",
        (rank != 0 or "Parameter initialization incomplete" in said and "WithOwnParameter" in said),
        said,
    )
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
