"""Loads the checkpoints fsdp_checks.py wrote on 2 processes into 1 process: a plain single-device Fabric and FSDP
on one process, the full file and the sharded directory; consolidates the directory. Prints "PASS 0 <name>".

Usage: `python fsdp_load_one.py OUT_DIR` after `python fsdp_checks.py OUT_DIR`.
"""

import gc
import sys
from pathlib import Path

import torch
from fsdp_models import ViT
from torch.distributed.tensor import DTensor

from fabriclite import Fabric, seed_everything
from fabriclite.checkpoint import META_KEY, consolidate


def check(name, condition, detail=""):
    if not condition:
        raise AssertionError(f"{name} failed {detail}")
    print(f"PASS 0 {name}", flush=True)


def equal(a, b):
    """Nested containers with equal tensors (DTensors compared by their full value) and equal plain values."""
    if isinstance(a, DTensor):
        a = a.full_tensor()
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a.cpu(), b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def build(fabric):
    seed_everything(5, verbose=False)  # other weights than the checkpoint's, so loading must change them
    net = ViT(dropout=0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    net, opt = fabric.setup(net, opt)
    return {"model": net, "optimizer": opt, "scheduler": scheduler, "step": 0}


def main():
    out = Path(sys.argv[1])
    expected = torch.load(out / "full.ckpt", weights_only=True)
    plain = Fabric(accelerator="cpu")
    fsdp = Fabric(accelerator="cpu", devices=1, strategy="fsdp")
    fsdp.launch()
    for fabric, who in ((plain, "one process without FSDP"), (fsdp, "FSDP on one process")):
        for kind in ("full", "sharded"):
            state = build(fabric)
            remainder = fabric.load(out / f"{kind}.ckpt", state)
            check(
                f"{who} loads the 2-process {kind} checkpoint",
                equal(state["model"].state_dict(), expected["model"])
                and equal(state["optimizer"].state_dict(), expected["optimizer"])
                and equal(state["scheduler"].state_dict(), expected["scheduler"])
                and state["step"] == 3
                and "loader" in remainder,
            )
    consolidate(out / "sharded.ckpt", out / "consolidated.pt")
    consolidated = torch.load(out / "consolidated.pt", weights_only=True)
    for saved in (consolidated, expected):  # where each stands in the run's history: two saves, two places
        del saved[META_KEY]["series"]
    check("consolidate writes the full checkpoint's content", equal(consolidated, expected))


if __name__ == "__main__":
    main()
    gc.collect()
    torch.distributed.destroy_process_group()
