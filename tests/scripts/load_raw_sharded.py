"""fabric.load_raw of a full (consolidated) state dict into a model sharded on 2 processes, under FSDP and under
ModelParallelStrategy (tensor parallel over both ranks): each rank ends up with exactly the weights the model has
when the file is loaded before sharding; strict and non-strict loading behave as in one process, and a file that
does not fit raises the same error on every rank. Prints "PASS <rank> <name>".

Usage: `python load_raw_sharded.py OUT_DIR` (the examples/gpt model; OUT_DIR gets the files).
"""

import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "gpt"))
from model import GPT, Block, GPTConfig  # noqa: E402
from parallel import parallelize  # noqa: E402

from fabriclite import Fabric  # noqa: E402
from fabriclite.checkpoint import CheckpointError  # noqa: E402
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

CONFIG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, vocab_size=32, llama=True)


def check(fabric, name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name} failed on rank {fabric.global_rank} {detail}")
    print(f"PASS {fabric.global_rank} {name}", flush=True)


def full(tensor):
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def weights(model):
    return {name: full(t).detach().clone() for name, t in model.state_dict().items()}


def same(a, b):
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def build(fabric, seed, empty_init=False):
    torch.manual_seed(seed)
    with fabric.init_module(empty_init=empty_init):
        model = GPT(CONFIG)
    return model


def refused(fabric, path, model, **kwargs):
    try:
        fabric.load_raw(path, model, **kwargs)
    except CheckpointError as error:
        return error
    return None


def main():
    out = Path(sys.argv[1])
    strategies = {
        "fsdp": FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", limit_all_gathers=True),
        "tp": ModelParallelStrategy(parallelize, data_parallel_size=1, tensor_parallel_size=2),
    }
    for kind, strategy in strategies.items():
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        path = out / f"{kind}.pth"
        if fabric.is_global_zero:
            torch.save(build(fabric, seed=1).state_dict(), path)
        fabric.barrier()

        # The reference: the file loaded before sharding, then set up (which gives each rank its slice).
        before = build(fabric, seed=2)
        before.load_state_dict(torch.load(path, weights_only=True))
        expected = weights(fabric.setup(before))

        for empty_init in (False, True):
            model = fabric.setup(build(fabric, seed=3, empty_init=empty_init))
            check(fabric, f"{kind}: the parameters are sharded", isinstance(model.wte.weight, DTensor))
            fabric.load_raw(path, model)
            how = "an empty init" if empty_init else "a built model"
            check(
                fabric,
                f"{kind}: load_raw into {how} gives the weights of loading before sharding",
                same(weights(model), expected),
            )

        model = fabric.setup(build(fabric, seed=3))
        state = torch.load(path, weights_only=True)
        if fabric.is_global_zero:
            partial = {k: v for k, v in state.items() if k != "blocks.0.mlp.c_fc.weight"}
            torch.save({**partial, "extra.weight": torch.ones(2)}, out / f"{kind}-partial.pth")
            torch.save({**state, "wte.weight": torch.zeros(3, 16)}, out / f"{kind}-shape.pth")
        fabric.barrier()
        kept = full(model.state_dict()["blocks.0.mlp.c_fc.weight"]).clone()
        error = refused(fabric, out / f"{kind}-partial.pth", model)
        check(
            fabric,
            f"{kind}: strict load_raw refuses a file with a missing and an extra key, naming both, on every rank",
            isinstance(error, RuntimeError)
            and "missing from the checkpoint: blocks.0.mlp.c_fc.weight" in str(error)
            and "not in the model: extra.weight" in str(error),
            repr(error),
        )
        fabric.load_raw(out / f"{kind}-partial.pth", model, strict=False)
        loaded = weights(model)
        check(
            fabric,
            f"{kind}: non-strict load_raw loads what both have and leaves the rest",
            torch.equal(loaded["blocks.0.mlp.c_fc.weight"], kept)
            and all(torch.equal(loaded[k], expected[k]) for k in expected if k != "blocks.0.mlp.c_fc.weight"),
        )
        error = refused(fabric, out / f"{kind}-shape.pth", model, strict=False)
        check(
            fabric,
            f"{kind}: a tensor of another shape is refused on every rank, naming both shapes",
            isinstance(error, RuntimeError)
            and "wte.weight is [3, 16] in the checkpoint, [32, 16] in the model" in str(error),
            repr(error),
        )
        if kind == "fsdp":  # an optimizer's full state (saved by one process) into the sharded optimizer
            torch.manual_seed(4)
            one = GPT(CONFIG)
            one.load_state_dict(state)
            adam = torch.optim.AdamW(one.parameters(), lr=0.1)
            one(torch.randint(0, 32, (2, 8))).float().pow(2).mean().backward()
            adam.step()
            if fabric.is_global_zero:
                torch.save(adam.state_dict(), out / "adam.pth")
            fabric.barrier()
            optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=0.1))
            fabric.load_raw(out / "adam.pth", optimizer)
            mine = optimizer.state_dict()["state"]
            check(
                fabric,
                "fsdp: load_raw of a one-process optimizer state gives each rank its slices",
                all(
                    torch.equal(full(optimizer.optimizer.state[p]["exp_avg"]), adam.state[q]["exp_avg"])
                    for p, q in zip(model.parameters(), one.parameters())
                )
                and len(mine) == len(adam.state),
            )
        fabric.barrier()


if __name__ == "__main__":
    main()
