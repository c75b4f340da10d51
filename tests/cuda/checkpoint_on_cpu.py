"""The CPU side of test_cuda.py's checkpoint test, in a process that sees no GPU (``CUDA_VISIBLE_DEVICES=``): load
the checkpoint the test saved (on CUDA) onto the CPU, check it holds what was saved, train one more step and save it
for the test to load back onto CUDA, with the tensors it must then hold beside it (``OUT.expected``).

Usage: ``CUDA_VISIBLE_DEVICES= python tests/cuda/checkpoint_on_cpu.py SAVED EXPECTED OUT``.
"""

import sys
from pathlib import Path

import torch
from cuda_checks import check_loaded, checkpoint_state, tensors_of, train_a_step

from fabriclite import Fabric


def main() -> None:
    saved, expected, out = (Path(arg) for arg in sys.argv[1:4])
    fabric = Fabric(accelerator="cpu")
    state = checkpoint_state(fabric)
    fabric.load(saved, state)
    check_loaded(state, torch.load(expected, weights_only=True), torch.device("cpu"), step=2)
    train_a_step(fabric, state)
    fabric.save(out, state)
    torch.save(tensors_of(state), f"{out}.expected")
    print(f"PASS 0 loaded on a process with CUDA available: {torch.cuda.is_available()}")


if __name__ == "__main__":
    main()
