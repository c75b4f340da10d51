"""Wrap policies (``fabriclite/strategies/policies.py``) in every form Lightning and torch document: the modules each
picks are those FSDP1's own code wraps for the same model (``_auto_wrap`` and ``apply_activation_checkpointing``
run here with a recording wrapper, no process group), and on 2 gloo processes (tests/scripts/wrap_policies.py)
they are the FSDP2 units and train as the layer-class form."""

import pickle
from functools import partial

import pytest
import torch
from helpers import SCRIPTS, assert_passed, run_python
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp._wrap_utils import _auto_wrap
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fabriclite.strategies import FSDPStrategy
from fabriclite.strategies.policies import WrapPolicy


class Block(nn.Module):
    """attn 16*16+16 = 272, mlp 16*64+64 = 1088 and 64*16+16 = 1040, norm 32: 2432 parameters."""

    def __init__(self, inner: bool = False) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.norm = nn.LayerNorm(16)
        self.inner = Block() if inner else None

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(x)
        return x if self.inner is None else self.inner(x)


class Net(nn.Module):
    """embed 800, three blocks (the last with a block inside), head 850, a parameter of the root's own."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.ModuleList([Block(), Block(), Block(inner=True)])
        self.head = nn.Linear(16, 50)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, tokens):
        x = self.embed(tokens) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fsdp1_wraps(model, policy):
    """The modules FSDP1 wraps for ``policy``: its own auto-wrap code, with a wrapper that records and wraps nothing."""
    picked = []
    _auto_wrap(
        model, policy, set(), set(), {"mixed_precision": None}, lambda module, **_: picked.append(module) or module
    )
    return picked


def names(model, modules):
    by_module = {m: n for n, m in model.named_modules()}
    return sorted(by_module[m] for m in modules)


# What FSDPStrategy is given -> what Lightning hands FSDP1 for it.
FORMS = {
    "a layer class": (Block, ModuleWrapPolicy({Block})),
    "a set of layer classes": ({Block, nn.Embedding}, ModuleWrapPolicy({Block, nn.Embedding})),
    "a module -> bool function": (
        lambda m: isinstance(m, nn.Linear),
        partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
    ),
    "transformer_auto_wrap_policy": (partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),) * 2,
    "lambda_auto_wrap_policy": (partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)),) * 2,
    "size_based_auto_wrap_policy, 500": (partial(size_based_auto_wrap_policy, min_num_params=500),) * 2,
    "size_based_auto_wrap_policy, 3000": (partial(size_based_auto_wrap_policy, min_num_params=3000),) * 2,
    "size_based_auto_wrap_policy, module= bound": (
        partial(size_based_auto_wrap_policy, module={Block}, min_num_params=2000),
    )
    * 2,
    "size_based_auto_wrap_policy, force_leaf_modules": (
        partial(size_based_auto_wrap_policy, min_num_params=500, force_leaf_modules={Block}),
    )
    * 2,
    "always_wrap_policy": (always_wrap_policy,) * 2,
    "ModuleWrapPolicy": (ModuleWrapPolicy({Block}),) * 2,
    "CustomPolicy": (CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 16),) * 2,
}


@pytest.mark.parametrize("form", FORMS)
def test_each_policy_form_picks_the_modules_fsdp1_wraps(form):
    given, fsdp1_form = FORMS[form]
    model = Net()
    expected = [m for m in fsdp1_wraps(model, fsdp1_form) if not isinstance(m, nn.ModuleList)]
    picked = WrapPolicy(given, "auto_wrap_policy").select(model)
    assert names(model, picked) == names(model, expected)
    assert expected  # the form picks something here, so the comparison means something


@pytest.mark.parametrize(
    "form",
    ["a set of layer classes", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy, 500", "CustomPolicy"],
)
def test_each_policy_form_checkpoints_the_modules_fsdp1_checkpoints(form):
    given, fsdp1_form = FORMS[form]
    model, expected = Net(), []
    apply_activation_checkpointing(model, lambda m, **_: expected.append(m) or m, auto_wrap_policy=fsdp1_form)
    picked = WrapPolicy(given, "activation_checkpointing_policy").select(model)
    assert names(model, picked) == names(model, expected)


def test_a_size_based_policy_counts_the_parameters_its_picked_descendants_did_not_take():
    model = Net()
    picked = names(model, WrapPolicy(partial(size_based_auto_wrap_policy, min_num_params=1000), "x").select(model))
    # Each mlp Linear (1088, 1040) is picked; what is left of a Block (attn + norm: 304) is not, though the Block
    # holds 2432; the outer last block, though, holds its inner block's 304 left over too (608): still not.
    linears = [f"blocks.{i}.mlp.{j}" for i in range(3) for j in (0, 2)] + [
        "blocks.2.inner.mlp.0",
        "blocks.2.inner.mlp.2",
    ]
    assert picked == sorted(linears)
    picked = names(model, WrapPolicy(partial(size_based_auto_wrap_policy, min_num_params=600), "x").select(model))
    # At 600 the outer last block is picked for its 608 left over; the others' 304 stay with the root.
    assert picked == sorted([*linears, "embed", "head", "blocks.2"])


def test_the_root_and_containers_without_a_forward_are_never_picked():
    model = Net()
    picked = WrapPolicy(always_wrap_policy, "auto_wrap_policy").select(model)
    assert model not in picked and model.blocks not in picked and model.blocks[0] in picked
    fsdp1 = Net()
    assert fsdp1.blocks in fsdp1_wraps(fsdp1, always_wrap_policy)  # the one difference, said in the docs


def test_modules_come_innermost_first_and_shared_ones_once():
    shared = nn.Linear(16, 16)
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.Sequential(shared))
    picked = list(WrapPolicy(nn.Module, "auto_wrap_policy").select(model))
    assert picked == [shared, model[0][1], model[0], model[1]]


def test_a_custom_policy_gives_each_module_its_own_settings():
    model = Net()
    policy = CustomPolicy(lambda m: {"reshard_after_forward": False} if m is model.head else isinstance(m, Block))
    picked = WrapPolicy(policy, "auto_wrap_policy").select(model)
    assert picked[model.head] == {"reshard_after_forward": False} and picked[model.blocks[0]] == {}


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (partial(transformer_auto_wrap_policy), "missing a required argument: 'transformer_layer_cls'"),
        (lambda a, b: True, r"cannot be called as FSDP1 calls a policy"),
        (3, "none of the forms a policy takes: layer classes"),
        ({int}, "must hold nn.Module subclasses"),
    ],
)
def test_a_form_that_cannot_be_mapped_is_refused_when_given_saying_what_is_taken(policy, match):
    with pytest.raises(TypeError, match=match):
        FSDPStrategy(auto_wrap_policy=policy)
    with pytest.raises(TypeError, match=match):
        FSDPStrategy(activation_checkpointing_policy=policy)


def test_a_policy_of_torch_functions_travels_to_a_new_process():
    policy = WrapPolicy(partial(size_based_auto_wrap_policy, min_num_params=1000), "auto_wrap_policy")
    arrived, model = pickle.loads(pickle.dumps(policy)), Net()
    assert names(model, arrived.select(model)) == names(model, policy.select(model))


POLICY_CHECKS = [
    f"auto_wrap_policy {form}: {check}"
    for form in (
        "layer classes",
        "a module -> bool function",
        "transformer_auto_wrap_policy partial",
        "lambda_auto_wrap_policy partial",
        "size_based_auto_wrap_policy partial",
        "size_based partial with module= bound",
        "always_wrap_policy",
        "a user's own FSDP1 policy function",
        "ModuleWrapPolicy",
        "CustomPolicy",
    )
    for check in ("the units are FSDP1's", "trains as the layer-class form")
] + [
    f"activation checkpointing {form}: {check}"
    for form in (
        "layer classes",
        "Lightning's older activation_checkpointing=Block",
        "transformer_auto_wrap_policy partial",
        "size_based_auto_wrap_policy partial",
        "CustomPolicy with torch.utils.checkpoint options",
    )
    for check in ("the modules are FSDP1's", "trains as without it")
]


@pytest.mark.torch_versions  # FSDP1's policy objects and auto-wrap code, on each torch
def test_every_policy_form_shards_and_trains_on_two_processes_as_fsdp1_would_wrap():
    out = run_python(str(SCRIPTS / "wrap_policies.py"), timeout=300).stdout
    assert_passed(
        out,
        [
            "the layer-class form trains as one process",
            *POLICY_CHECKS,
            "a CustomPolicy's sharding_strategy for one unit keeps only its weights gathered after forward",
            "a CustomPolicy with per-unit settings trains as the layer-class form",
        ],
    )
