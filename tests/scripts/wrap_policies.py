"""Runs on 2 CPU processes under FSDP2: every form of auto_wrap_policy and activation_checkpointing_policy Lightning
and torch document. For each: the FSDP units (or the checkpointed modules) are those FSDP1's own code picks for
the same model (computed here with a recording wrapper, no process group), and 3 training steps give the weights
of the layer-class form and of one process. Prints "PASS <rank> <name>" per check.
"""

import copy
import gc
import os
from functools import partial

import torch
import torch.nn.functional as F
from fsdp_models import Block, ViT
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp import FSDPModule, ShardingStrategy
from torch.distributed.fsdp._wrap_utils import _auto_wrap
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from torch.distributed.tensor import DTensor

from fabriclite import Fabric, seed_everything
from fabriclite.strategies import FSDPStrategy


def own_policy(module, recurse, nonwrapped_numel):
    """A user's own FSDP1 policy function: the MLPs, and nothing below them."""
    return not isinstance(module, nn.Sequential) if recurse else isinstance(module, nn.Sequential)


# name -> (what FSDPStrategy is given, what Lightning hands FSDP1 for it). ViT(dim=16): a Block holds 2224 parameters,
# its qkv 816 and its mlp 1072 (two Linears of 544 and 528); the root holds `position` itself.
AUTO_WRAP = {
    "layer classes": ({Block}, ModuleWrapPolicy({Block})),
    "a module -> bool function": (
        lambda m: isinstance(m, Block),
        partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
    ),
    "transformer_auto_wrap_policy partial": (partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),) * 2,
    "lambda_auto_wrap_policy partial": (partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),)
    * 2,
    # 600: qkv alone, then each mlp (its Linears are smaller, together 1072); what is left of a Block (336) is not.
    "size_based_auto_wrap_policy partial": (partial(size_based_auto_wrap_policy, min_num_params=600),) * 2,
    # The form of the public Lightning script series: module= is overridden by FSDP1's own call.
    "size_based partial with module= bound": (
        partial(size_based_auto_wrap_policy, module={Block}, min_num_params=2000),
    )
    * 2,
    "always_wrap_policy": (always_wrap_policy,) * 2,
    "a user's own FSDP1 policy function": (own_policy,) * 2,
    "ModuleWrapPolicy": (ModuleWrapPolicy({Block, nn.LayerNorm}),) * 2,
    "CustomPolicy": (CustomPolicy(lambda m: isinstance(m, Block) or m.__class__ is nn.Linear and m.out_features == 3),)
    * 2,
}
CHECKPOINTING = {
    "layer classes": ({"activation_checkpointing_policy": {Block}}, ModuleWrapPolicy({Block})),
    "Lightning's older activation_checkpointing=Block": (
        {"activation_checkpointing": Block},
        ModuleWrapPolicy({Block}),
    ),
    "transformer_auto_wrap_policy partial": (
        {"activation_checkpointing_policy": partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})},
        partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    ),
    "size_based_auto_wrap_policy partial": (
        {"activation_checkpointing_policy": partial(size_based_auto_wrap_policy, min_num_params=600)},
        partial(size_based_auto_wrap_policy, min_num_params=600),
    ),
    "CustomPolicy with torch.utils.checkpoint options": (
        {
            "activation_checkpointing_policy": CustomPolicy(
                lambda m: {"preserve_rng_state": False} if isinstance(m, Block) else False
            )
        },
        CustomPolicy(lambda m: isinstance(m, Block)),
    ),
}


def fsdp1_wraps(model, policy):
    """The modules FSDP1 wraps for ``policy`` (its own auto-wrap code, wrapping with a recorder), by name."""
    names, picked = {m: n for n, m in model.named_modules()}, []
    _auto_wrap(
        model, policy, set(), set(), {"mixed_precision": None}, lambda module, **_: picked.append(module) or module
    )
    return sorted(names[m] for m in picked)


def fsdp1_checkpoints(model, policy):
    """The modules FSDP1's apply_activation_checkpointing wraps for ``policy`` (Lightning's call), by name."""
    names, picked = {m: n for n, m in model.named_modules()}, []
    apply_activation_checkpointing(model, lambda module, **_: picked.append(module) or module, auto_wrap_policy=policy)
    return sorted(names[m] for m in picked)


def full(module):
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in module.state_dict().items()}


def same(a, b, atol=0.0):
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=atol) for k in a)


def main():
    torch.manual_seed(1)
    xs, ys = torch.randn(3, 8, 4, 8), torch.randint(0, 3, (3, 8))  # [step, global batch, ...]
    seed_everything(0, verbose=False)
    initial = ViT()
    reference = copy.deepcopy(initial)  # one process on the whole batch
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        optimizer.zero_grad()
        F.cross_entropy(reference(xs[step]), ys[step]).backward()
        optimizer.step()
    one_process = reference.state_dict()

    def train(**strategy_kwargs):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(**strategy_kwargs))
        fabric.launch()
        mine = slice(fabric.global_rank * 4, fabric.global_rank * 4 + 4)
        model = fabric.setup(copy.deepcopy(initial))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        for step in range(3):
            optimizer.zero_grad()
            fabric.backward(F.cross_entropy(model(xs[step, mine]), ys[step, mine]))
            optimizer.step()
        return fabric, model

    fabric, model = train(auto_wrap_policy={Block})
    rank = fabric.global_rank

    def check(name, condition, detail=""):
        if not condition:
            raise AssertionError(f"rank {rank}: {name} failed {detail}")
        os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe

    by_classes = full(model)
    check("the layer-class form trains as one process", same(by_classes, one_process, 1e-5))
    for name, (given, fsdp1_form) in AUTO_WRAP.items():
        expected = [n for n in fsdp1_wraps(copy.deepcopy(initial), fsdp1_form) if n != "blocks"]  # see below
        fabric, model = train(auto_wrap_policy=given)
        units = sorted(n for n, m in model.module.named_modules() if isinstance(m, FSDPModule) and n)
        check(f"auto_wrap_policy {name}: the units are FSDP1's", units == expected, f"{units} != {expected}")
        check(f"auto_wrap_policy {name}: trains as the layer-class form", same(full(model), by_classes, 1e-6))
    # The one difference from FSDP1: a container without a forward (the ModuleList) is never a unit.
    check(
        "always_wrap_policy: FSDP1 would also wrap the ModuleList",
        "blocks" in fsdp1_wraps(copy.deepcopy(initial), always_wrap_policy),
    )

    for name, (given, fsdp1_form) in CHECKPOINTING.items():
        expected = fsdp1_checkpoints(copy.deepcopy(initial), fsdp1_form)
        fabric, model = train(auto_wrap_policy={Block}, **given)
        picked = sorted(n for n, m in model.module.named_modules() if checkpoint.state(m) is not None)
        check(
            f"activation checkpointing {name}: the modules are FSDP1's", picked == expected, f"{picked} != {expected}"
        )
        check(f"activation checkpointing {name}: trains as without it", same(full(model), by_classes, 1e-6))

    # A CustomPolicy's per-unit setting: SHARD_GRAD_OP keeps that unit's gathered weights from forward to backward.
    policy = CustomPolicy(
        lambda m: (
            {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
            if m.__class__ is nn.Linear and m.out_features == 3
            else isinstance(m, Block)
        )
    )
    fabric, model = train(auto_wrap_policy=policy)
    output = model(xs[0, slice(rank * 4, rank * 4 + 4)])
    check(
        "a CustomPolicy's sharding_strategy for one unit keeps only its weights gathered after forward",
        not isinstance(model.module.head.weight, DTensor) and isinstance(model.module.blocks[0].qkv.weight, DTensor),
    )
    output.sum().backward()
    check("a CustomPolicy with per-unit settings trains as the layer-class form", same(full(model), by_classes, 1e-6))
    os.write(1, f"DONE {rank}\n".encode())


if __name__ == "__main__":
    main()
    gc.collect()  # free the sharded modules before leaving the process group (pytorch/pytorch#190489)
    torch.distributed.destroy_process_group()
