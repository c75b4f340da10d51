"""FSDP with the optimizer step overlapped with the backward, the recipe Lightning Fabric published: one optimizer
per parameter, and `fabric.backward` inside `fsdp_overlap_step_with_backward`, imported from Lightning's path."""

from functools import partial

import torch
from common import Block, loader, report
from torch import nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from fabriclite import Fabric, seed_everything
from fabriclite.strategies import FSDPStrategy
from fabriclite.strategies.fsdp import fsdp_overlap_step_with_backward


auto_wrap_policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
strategy = FSDPStrategy(auto_wrap_policy=auto_wrap_policy, activation_checkpointing=Block)
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
seed_everything(42)
with fabric.init_module(empty_init=False):
    model = nn.Sequential(nn.Linear(8, 16), Block(16), Block(16), nn.Linear(16, 1))
optimizers = [torch.optim.Adam([p], lr=0.01) for p in model.parameters()]
model = fabric.setup_module(model)
optimizers = fabric.setup_optimizers(*optimizers)
for step, (x, y) in enumerate(fabric.setup_dataloaders(loader())):
    loss = torch.nn.functional.mse_loss(model(x), y)
    with fsdp_overlap_step_with_backward(optimizers, model):
        fabric.backward(loss)
    report(fabric, step, loss)
