"""precision="fp8-mixed" (torchao's float8 layers, emulated on the CPU) on 2 CPU processes under DDP or FSDP2;
prints "PASS <rank> <name>" per check. Arguments: the strategy ("ddp" or "fsdp"), a folder for checkpoints, the
recipe ("tensorwise": float8 all-gathers under FSDP; "rowwise": bf16 ones), and "compile" to compile the blocks."""

import os
import sys
import warnings
from pathlib import Path

import torch
from check_report import report
from torch import nn
from torch.distributed.tensor import DTensor

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import Float8Precision
from fabriclite.strategies import FSDPStrategy

WIDTH = 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.head(self.blocks(x))


def full(module):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).float() for k, v in module.state_dict().items()}


def train(fabric, model, optimizer, steps, seed):
    torch.manual_seed(seed + fabric.global_rank)  # each rank its own batch, the same at each step: the loss falls
    x, y = torch.randn(8, WIDTH), torch.randint(0, 4, (8,))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main():
    kind, folder, recipe = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    compile = sys.argv[4:] == ["compile"]
    strategy = FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full") if kind == "fsdp" else "ddp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao's notes about its CUDA-only kernels
        fabric = Fabric(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            plugins=[Float8Precision(recipe, emulate=True)],
            compile=compile,
        )
    fabric.launch()
    rank = fabric.global_rank
    precision = fabric._precision

    seed_everything(0, verbose=False)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    names = sorted(precision.converted)
    report(
        rank,
        "the blocks' Linear layers run in float8, the head stays",
        names == [f"blocks.{i}.{p}" for i in (0, 1) for p in ("down", "up")],
        names,
    )
    weight = model.module.blocks[0].up.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    float8_weight = type(local).__name__ == "WeightWithDynamicFloat8CastTensor"
    report(
        rank,
        "float8 all-gather is on exactly when sharded with tensorwise scales",
        float8_weight == (kind == "fsdp" and recipe == "tensorwise"),
        type(local).__name__,
    )
    report(rank, "parameters stay fp32", all(p.dtype == torch.float32 for p in model.parameters()))

    losses = train(fabric, model, optimizer, 6, seed=1)
    report(rank, "the loss goes down", losses[-1] < losses[0], losses)
    if compile:
        (compiled,) = fabric.compile_report()
        whole = compiled["graphs"] == 2 and compiled["graph_breaks"] == compiled["recompiles"] == 0
        report(rank, "the float8 blocks compile whole, once each", whole, compiled)
    states = [s for group in optimizer.state.values() for s in group.values() if torch.is_tensor(s) and s.ndim]
    if float8_weight:  # torchao's advice: every weight's scale in one all-reduce after the step, not per layer
        shard = model.module.blocks[0].up.weight._local_tensor  # where torchao keeps it (to_local() is a new view)
        report(rank, "the float8 weight scales are computed after each step", shard._precomputed_scale is not None)
    stepped = [optimizer.state[p] for p in model.module.parameters()]
    report(rank, "the optimizer steps every parameter, the float8 weights too", all(stepped))
    report(rank, "optimizer state stays fp32", states and all(s.dtype == torch.float32 for s in states))
    weights = full(model)
    sums = fabric.all_gather(torch.stack([w.double().sum() for w in weights.values()]))
    report(rank, "every rank holds the same weights", torch.equal(sums[0], sums[1]))

    if kind == "ddp":
        x = torch.randn(4, WIDTH)
        with fabric.no_backward_sync(model, enabled=True):
            fabric.backward(model(x + rank).sum())
        grad = model.module.blocks[0].up.weight.grad.clone()
        gathered = fabric.all_gather(grad)
        report(
            rank, "no_backward_sync keeps each rank's own float8 gradients", not torch.equal(gathered[0], gathered[1])
        )
        optimizer.zero_grad()

    # Full and sharded checkpoints, loaded back; the full one into a bf16-mixed model in one process (rank 0).
    fabric.save(folder / "full.ckpt", {"model": model, "optimizer": optimizer})
    if kind == "fsdp":
        fabric.strategy.state_dict_type = "sharded"
        fabric.save(folder / "sharded", {"model": model, "optimizer": optimizer})
        seed_everything(5, verbose=False)
        other = Net()
        other_optimizer = torch.optim.AdamW(other.parameters(), lr=1e-2)
        other, other_optimizer = fabric.setup(other, other_optimizer)
        fabric.load(folder / "sharded", {"model": other, "optimizer": other_optimizer})
        loaded = full(other)
        report(rank, "a sharded checkpoint loads back", all(torch.equal(loaded[k], v) for k, v in weights.items()))
        after = train(fabric, other, other_optimizer, 2, seed=7)
        again = train(fabric, model, optimizer, 2, seed=7)
        report(rank, "training goes on the same from a sharded checkpoint", after == again, (after, again))
        precision.ignore_modules = {"blocks"}  # the same model unconverted, as a bf16-mixed run holds it
        plain = fabric.setup(Net())
        precision.ignore_modules = set()
        fabric.load(folder / "sharded", {"model": plain})
        unconverted = full(plain)
        report(
            rank,
            "a sharded fp8 checkpoint loads into an unconverted model",
            not precision.converted and all(torch.equal(unconverted[k], v) for k, v in weights.items()),
        )
        with torch.no_grad():
            for p in plain.parameters():
                p.add_(1.0)
        fabric.save(folder / "plain", {"model": plain})
        fabric.load(folder / "plain", {"model": other})
        loaded, changed = full(other), full(plain)
        report(
            rank,
            "a sharded checkpoint of an unconverted model loads into an fp8 one",
            all(torch.equal(loaded[k], v) for k, v in changed.items()),
        )
    if rank == 0:
        state = torch.load(folder / "full.ckpt", weights_only=True)["model"]
        plain = Net()
        plain.load_state_dict(state)
        report(
            rank,
            "the full checkpoint holds plain fp32 tensors",
            all(type(t) is torch.Tensor and t.dtype == torch.float32 for t in state.values()),
        )
        report(
            rank,
            "the full checkpoint loads into an unconverted model",
            all(torch.equal(plain.state_dict()[k], v) for k, v in weights.items()),
        )
    else:
        report(rank, "the full checkpoint holds plain fp32 tensors", True)
        report(rank, "the full checkpoint loads into an unconverted model", True)
    if kind == "fsdp":
        with fabric.init_module(empty_init=True):
            empty = Net()
        empty = fabric.setup(empty)
        materialized = not any(p.is_meta for p in empty.parameters())
        loss = empty(torch.randn(4, WIDTH)).float().pow(2).mean()
        fabric.backward(loss)
        report(
            rank,
            "an empty_init model is converted, filled in setup and trains",
            materialized and torch.isfinite(loss).item() and len(precision.converted) == 4,
        )
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
