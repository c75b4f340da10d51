"""Runs on 2 CPU processes under FSDP2: fsdp_overlap_step_with_backward (Lightning's import path) steps each
optimizer inside the backward and trains as stepping after it; gradient accumulation, refusals. Prints
"PASS <rank> <name>" per check."""

import copy
import gc
import os

import torch
import torch.nn.functional as F
from fsdp_models import Block, ViT
from torch.distributed.tensor import DTensor

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import MixedPrecision
from fabriclite.strategies import FSDPStrategy
from fabriclite.strategies.fsdp import fsdp_overlap_step_with_backward


def full(module):
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in module.state_dict().items()}


def same(a, b, atol=0.0):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def main():
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}))
    fabric.launch()
    rank = fabric.global_rank
    mine = slice(rank * 4, rank * 4 + 4)

    def check(name, condition, detail=""):
        if not condition:
            raise AssertionError(f"rank {rank}: {name} failed {detail}")
        os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe

    torch.manual_seed(1)
    xs, ys = torch.randn(4, 8, 4, 8), torch.randint(0, 3, (4, 8))  # [step, global batch, ...]
    seed_everything(0, verbose=False)
    initial = ViT()

    # The plain loop: one Adam, stepped after backward.
    model = fabric.setup(copy.deepcopy(initial))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False))
    for step in range(3):
        fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
        optimizer.step()
        optimizer.zero_grad()
    plain = full(model)

    # Lightning's recipe: one optimizer per parameter, no step() after backward.
    model = fabric.setup(copy.deepcopy(initial))
    optimizers = fabric.setup_optimizers(*[torch.optim.Adam([p], lr=1e-2, foreach=False) for p in model.parameters()])
    last = model.module.blocks[-1].qkv.weight  # its unit's backward runs first
    last_optimizer = next(o for o in optimizers if o.param_groups[0]["params"][0] is last)
    seen = []  # how often the last block's optimizer had stepped when the backward reached the first layer
    model.module.embed.register_full_backward_pre_hook(
        lambda *_: seen.append(int(last_optimizer.state[last]["step"]) if last_optimizer.state else 0)
    )
    for step in range(3):
        loss = F.cross_entropy(model(xs[step, mine]), ys[step, mine])
        with fsdp_overlap_step_with_backward(optimizers, model):
            fabric.backward(loss)
    check("a block's optimizer steps before the backward reaches the first layer", seen == [1, 2, 3], str(seen))
    check("no gradient is left after the block", all(p.grad is None for p in model.parameters()))
    check("overlapping the step with backward trains as stepping after it", same(full(model), plain, 1e-6))

    # Gradient accumulation: the first micro-batch inside no_backward_sync, the second syncs.
    model = fabric.setup(copy.deepcopy(initial))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False))
    for step in (0, 2):
        with fabric.no_backward_sync(model):
            fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
        fabric.backward(F.cross_entropy(model(xs[step + 1, mine]), ys[step + 1, mine]))
        optimizer.step()
        optimizer.zero_grad()
    accumulated = full(model)
    model = fabric.setup(copy.deepcopy(initial))
    optimizers = fabric.setup_optimizers(*[torch.optim.Adam([p], lr=1e-2, foreach=False) for p in model.parameters()])
    for step in (0, 2):
        with fabric.no_backward_sync(model), fsdp_overlap_step_with_backward(optimizers, model):
            fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
        with fsdp_overlap_step_with_backward(optimizers, model):
            fabric.backward(F.cross_entropy(model(xs[step + 1, mine]), ys[step + 1, mine]))
    check("under no_backward_sync the steps wait for the backward that syncs", same(full(model), accumulated, 1e-6))

    # One optimizer over the whole model works too (nothing is freed early then).
    model = fabric.setup(copy.deepcopy(initial))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False))
    for step in range(3):
        with fsdp_overlap_step_with_backward(optimizer, model):
            fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
    check("one optimizer over the whole model steps once per backward", same(full(model), plain, 1e-6))

    # Refusals.
    other = fabric.setup_optimizers(torch.optim.SGD(ViT().parameters(), lr=0.1))
    try:
        with fsdp_overlap_step_with_backward([other], model):
            pass
    except ValueError as error:
        check("an optimizer over another model's parameters is refused", "not the sharded model's" in str(error))
    scaled = Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[MixedPrecision("16-mixed", "cpu")])
    scaled.launch()
    model = copy.deepcopy(initial)
    model, optimizer = scaled.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        with fsdp_overlap_step_with_backward(optimizer, model):
            pass
    except RuntimeError as error:
        check("a loss scaler is refused, saying what to use", "precision='bf16-mixed'" in str(error))
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
    gc.collect()  # free the sharded modules before leaving the process group (pytorch/pytorch#190489)
    torch.distributed.destroy_process_group()
