"""Runs on 2 CPU processes under FSDP2 and checks sharding, training, precision, the loss scaler and checkpoints;
prints "PASS <rank> <name>" per check. Writes its checkpoints into the folder given as the first argument, for the
one-process loading checks that run after it (fsdp_load_one.py).

Started as a plain `python fsdp_checks.py OUT_DIR`: fabric.launch() starts the second process itself. Several
Fabric objects (fp32, bf16-mixed, 16-mixed, a configured FSDPStrategy) share the two processes, to start once.
"""

import os
import copy
import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from fsdp_models import ViT
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import FSDPPrecision, MixedPrecision
from fabriclite.strategies import FSDPStrategy


def full(module):
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in module.state_dict().items()}


def same(a, b, atol=0.0):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def main():
    out = Path(sys.argv[1])
    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp")
    fabric.launch()
    rank = fabric.global_rank

    def check(name, condition, detail=""):
        if not condition:
            raise AssertionError(f"rank {rank}: {name} failed {detail}")
        os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe

    torch.manual_seed(1)
    xs, ys = torch.randn(6, 8, 4, 8), torch.randint(0, 3, (6, 8))  # [step, global batch, ...]
    mine = slice(rank * 4, rank * 4 + 4)

    # ---------------------------------------------------------------- sharding, and training equal to one process/DDP
    seed_everything(0, verbose=False)
    reference = ViT()
    initial = copy.deepcopy(reference)
    model = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # built on the unsharded model
    model, optimizer = fabric.setup(model, optimizer)

    check("parameters are DTensors", all(isinstance(p, DTensor) for p in model.parameters()))
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    counts = fabric.all_gather(torch.tensor(local))
    check("each rank holds about half of the parameters", counts.sum() == total and abs(local / total - 0.5) < 0.05)

    # Collectives given DTensors work on their full value: the same results as the plain tensors under DDP.
    reduced = fabric.all_reduce(sum(p.sum() for p in model.parameters()), reduce_op="sum")
    expected = 2 * sum(p.sum() for p in reference.parameters())
    check(
        "all_reduce of a DTensor reduces its full value",
        type(reduced) is torch.Tensor and torch.allclose(reduced, expected, atol=1e-4),
    )
    gathered = fabric.all_gather(model.module.head.weight)
    check(
        "all_gather of a DTensor gathers its full value",
        type(gathered) is torch.Tensor and torch.equal(gathered, torch.stack([reference.head.weight.detach()] * 2)),
    )
    sent = fabric.broadcast({"weight": model.module.head.weight}, src=1)["weight"]
    check(
        "broadcast of a DTensor sends its full value",
        type(sent) is torch.Tensor and torch.equal(sent, reference.head.weight),
    )
    check(
        "the repeated blocks are the sharding units",
        all(isinstance(b, FSDPModule) for b in model.module.blocks)
        and isinstance(model.module, FSDPModule)
        and not any(
            isinstance(m, FSDPModule) for m in (model.module.embed, model.module.head, *model.module.blocks[0].mlp)
        ),
    )
    check(
        "an optimizer built before setup steps the shards",
        [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
        and optimizer.param_groups[0]["momentum"] == 0.9,
    )
    ddp = DistributedDataParallel(copy.deepcopy(initial))
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
        optimizer.step()
        ddp_optimizer.zero_grad()
        F.cross_entropy(ddp(xs[step, mine]), ys[step, mine]).backward()
        ddp_optimizer.step()
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(xs[step]), ys[step]).backward()
        ref_optimizer.step()
    check("FSDP equals one process on the whole batch", same(full(model), reference.state_dict(), atol=1e-5))
    check("FSDP equals DDP", same(full(model), ddp.module.state_dict(), atol=1e-5))

    # ---------------------------------------------------------------- no_backward_sync and clipping
    reference.load_state_dict(full(model))
    optimizer.zero_grad()
    with fabric.no_backward_sync(model):
        fabric.backward(F.cross_entropy(model(xs[3, mine]), ys[3, mine]))
    check("no_backward_sync reduces nothing", all(p.grad is None for p in model.parameters()))
    fabric.backward(F.cross_entropy(model(xs[4, mine]), ys[4, mine]))
    reference.zero_grad()
    (F.cross_entropy(reference(xs[3]), ys[3]) + F.cross_entropy(reference(xs[4]), ys[4])).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.module.named_parameters()}
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}
    check(
        "gradients accumulated under no_backward_sync equal the unsharded sum",
        same(grads, ref_grads, atol=1e-5),
        {k: (grads[k] - ref_grads[k]).abs().max().item() for k in grads},
    )
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.05)
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=0.05)
    check("clip_gradients returns the unsharded norm", torch.allclose(norm, ref_norm, rtol=1e-5), f"{norm} {ref_norm}")
    grads = {n: p.grad.full_tensor() for n, p in model.module.named_parameters()}
    check(
        "clip_gradients clips every shard by it",
        same(grads, {n: p.grad for n, p in reference.named_parameters()}, 1e-6),
    )
    optimizer.zero_grad()

    # ---------------------------------------------------------------- optimizers built at other times
    fresh = fabric.setup_module(ViT())
    late = fabric.setup_optimizers(torch.optim.SGD(fresh.parameters(), lr=0.1))
    check(
        "an optimizer built after setup_module is kept as is",
        late.param_groups[0]["params"][0] is next(fresh.parameters()),
    )
    stepped = ViT()
    stale = torch.optim.SGD(stepped.parameters(), lr=0.1, momentum=0.9)
    stepped(xs[0, mine]).sum().backward()
    stale.step()
    stepped = fabric.setup_module(stepped)
    try:
        fabric.setup_optimizers(stale)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    check("an optimizer that already stepped is refused with what to do", "fabric.setup_module(model)" in refused)

    # empty init: fsdp_empty_init.py

    # ---------------------------------------------------------------- checkpoints and exact resume
    seed_everything(3, verbose=False)
    net = ViT(dropout=0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    net, opt = fabric.setup(net, opt)
    data = TensorDataset(torch.randn(40, 4, 8), torch.randint(0, 3, (40,)))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4, shuffle=True))
    state = {"model": net, "optimizer": opt, "scheduler": scheduler, "loader": loader, "step": 0}
    sharded_dir, full_file = out / "sharded.ckpt", out / "full.ckpt"

    def train_epoch(save_at=None):
        for x, y in loader:
            x = x + 0.01 * torch.randn_like(x)  # draws from the random stream, so a wrong restore shows
            opt.zero_grad()
            fabric.backward(F.cross_entropy(net(x), y))
            opt.step()
            scheduler.step()
            state["step"] += 1
            if state["step"] == save_at:
                fabric.strategy.state_dict_type = "sharded"
                fabric.save(sharded_dir, state)
                fabric.strategy.state_dict_type = "full"
                fabric.save(full_file, state)

    train_epoch(save_at=3)
    finished = full(net)
    finished_optimizer = {k: v.full_tensor() for k, v in opt.state[next(net.parameters())].items() if k != "step"}
    check("a sharded checkpoint is a directory with every rank's shards", len(list(sharded_dir.glob("*.distcp"))) == 2)
    if rank == 0:
        raw = torch.load(full_file, weights_only=True)
        check(
            "a full checkpoint is one file of plain tensors that torch.load reads",
            type(raw["model"]["head.weight"]) is torch.Tensor
            and sorted(raw["optimizer"]["state"]) == list(range(len(raw["model"]))),
        )
    for path in (sharded_dir, full_file):
        fabric.load(path, state)
        check(f"{path.stem} checkpoint restores the step", state["step"] == 3)
        train_epoch()
        check(f"{path.stem}: resuming mid-epoch reproduces the weights exactly", same(full(net), finished))
        resumed = {k: v.full_tensor() for k, v in opt.state[next(net.parameters())].items() if k != "step"}
        check(f"{path.stem}: and the optimizer state", same(resumed, finished_optimizer))

    # ---------------------------------------------------------------- a configured strategy: classes, checkpointing, offload
    Block = type(reference.blocks[0])
    configured = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, cpu_offload=True),
    )
    configured.launch()
    seed_everything(0, verbose=False)
    reference = ViT()
    model = copy.deepcopy(reference)
    model, optimizer = configured.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        configured.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
        optimizer.step()
        ref_optimizer.zero_grad()
        F.cross_entropy(reference(xs[step]), ys[step]).backward()
        ref_optimizer.step()
    check("a class wrap policy shards those classes", all(isinstance(b, FSDPModule) for b in model.module.blocks))
    check(
        "activation checkpointing and CPU offload train like one process",
        same(full(model), reference.state_dict(), 1e-5),
    )

    # ---------------------------------------------------------------- bf16-mixed
    mixed = Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision="bf16-mixed")
    mixed.launch()
    seed_everything(0, verbose=False)
    reference = ViT()
    model = mixed.setup(copy.deepcopy(reference))
    seen = []
    model.module.blocks[0].mlp[0].register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
    output = model(xs[0, mine])
    check("bf16-mixed: the blocks run with bf16 weights gathered by FSDP", seen == [torch.bfloat16])
    check("bf16-mixed: outputs come back in fp32", output.dtype == torch.float32)
    check("bf16-mixed: close to fp32", torch.allclose(output, reference(xs[0, mine]), atol=5e-2))
    output.sum().backward()
    check(
        "bf16-mixed: gradients are reduced into fp32 shards",
        all(p.grad.dtype == torch.float32 for p in model.parameters()),
    )

    # ---------------------------------------------------------------- 16-mixed: every rank skips the same step
    fp16 = MixedPrecision("16-mixed", "cpu")  # the plugin: on a CPU the string "16-mixed" means bf16
    scaled = Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[fp16])
    scaled.launch()
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    net, sgd = scaled.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = scaled._precision.scaler
    x = xs[0, mine].mean(1)
    before, scale = full(net), scaler.get_scale()
    local_before = [p.to_local().clone() for p in net.parameters()]
    sgd.zero_grad()
    scaled.backward(net(x).float().mean())
    if rank == 1:  # an overflow in rank 1's shard only
        next(net.parameters()).grad.to_local()[0, 0] = float("inf")
    sgd.step()
    check("an inf in one rank's shard makes every rank skip", same(full(net), before))
    scales = scaled.all_gather(torch.tensor(scaler.get_scale()))
    check("every rank backs off the scale", scales.tolist() == [scale * 0.5] * 2)
    sgd.zero_grad()
    scaled.backward(net(x).float().mean())
    sgd.step()
    moved = any(not torch.equal(p.to_local(), q) for p, q in zip(net.parameters(), local_before))
    check("after a skip the next step applies on every rank", scaled.all_gather(torch.tensor(moved)).all())

    # ---------------------------------------------------------------- the scaler the user gave is the one in use
    for precision, build in (("16-mixed", torch.amp.GradScaler), ("16-true", ShardedGradScaler)):
        scaler = build("cpu", init_scale=1024.0)
        own = Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[FSDPPrecision(precision, scaler=scaler)])
        own.launch()
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        net, sgd = own.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        own.backward(net(x).float().mean())
        if rank == 1:  # an overflow in rank 1's shard only
            next(net.parameters()).grad.to_local()[0, 0] = float("inf")
        sgd.step()
        scales = own.all_gather(torch.tensor(scaler.get_scale())).tolist()
        check(f"{precision}: the user's {build.__name__} backs off on every rank", scales == [512.0, 512.0], scales)
        own.save(out / f"scaler-{precision}.ckpt", {"model": net})
        fresh_scaler = build("cpu", init_scale=1024.0)
        fresh = Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[FSDPPrecision(precision, fresh_scaler)])
        fresh.launch()
        fresh.load(
            out / f"scaler-{precision}.ckpt",
            {"model": fresh.setup(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))},
        )
        check(f"{precision}: a checkpoint restores into the user's {build.__name__}", fresh_scaler.get_scale() == 512.0)
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
    # Free the sharded modules (and the communication state FSDP keeps in them) before leaving the process group:
    # gloo may abort at interpreter exit when they outlive it (pytorch/pytorch#190489).
    gc.collect()
    torch.distributed.destroy_process_group()
