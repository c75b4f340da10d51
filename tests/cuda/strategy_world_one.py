"""DDP or FSDP on one process, a process group of one (nccl on CUDA, gloo on the CPU): it trains exactly as one device
without a strategy does, and saves and loads its checkpoint. Prints "PASS 0 <name>" or "FAIL 0 <name>: <why>" per
check.

Usage: ``python tests/cuda/strategy_world_one.py ddp|fsdp cuda|cpu FOLDER``.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from cuda_checks import check_loaded, checkpoint_state, deterministic, report, tensors_of, train_a_step

from fabriclite import Fabric

STEPS = 5


def main() -> int:
    strategy, accelerator, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    plain = Fabric(accelerator=accelerator, devices=1)
    fabric = Fabric(accelerator=accelerator, devices=1, strategy=strategy)
    fabric.launch()
    backend = "nccl" if accelerator == "cuda" else "gloo"

    def process_group() -> str:
        assert dist.is_initialized() and dist.get_world_size() == 1, "no process group of one"
        assert dist.get_backend() == backend, f"backend {dist.get_backend()}, expected {backend}"
        assert fabric.device.type == accelerator, fabric.device
        return f"{backend} on {fabric.device}"

    def trains_like_one_device() -> None:
        expected = checkpoint_state(plain)
        state = checkpoint_state(fabric)
        with deterministic():
            for _ in range(STEPS):
                train_a_step(plain, expected)
                train_a_step(fabric, state)
        want, got = tensors_of(expected), tensors_of(state)
        assert want.keys() == got.keys(), sorted(set(want) ^ set(got))
        # DDP divides the gradient sum of one rank by one: bit-identical. FSDP's reduce-scatter may sum in its own
        # order, so close to fp32 rounding.
        for key in want:
            if strategy == "ddp":
                assert torch.equal(got[key], want[key]), f"{key} differs from one device without DDP"
            else:
                torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=key)

    def checkpoint_round_trip() -> None:
        state = checkpoint_state(fabric)
        for _ in range(2):
            train_a_step(fabric, state)
        fabric.save(folder / f"{strategy}.ckpt", state)
        loaded = checkpoint_state(fabric)
        fabric.load(folder / f"{strategy}.ckpt", loaded)
        check_loaded(loaded, tensors_of(state), fabric.device, step=2)
        train_a_step(fabric, loaded)  # and training goes on from it

    passed = report(f"{strategy} process group", process_group)
    passed &= report(f"{strategy} trains like one device", trains_like_one_device)
    passed &= report(f"{strategy} checkpoint round trip", checkpoint_round_trip)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
