"""Trains the GPU suite's models (benchmarks/in_model.py: examples/vit's ViT and examples/gpt's Llama-style GPT) at the
smoke run's tiny sizes for a few steps through ``Fabric(precision="bf16-mixed", compile=True)`` with TorchInductor
itself, as the GPU suite's compiled rows do, and the same model eagerly from the same weights and batches; prints
each step's two losses and what the compiler reported: ``STEP <i> eager=<loss> compiled=<loss>``, then
``REPORT <compile_report>``.

The suite's own smoke run compiles with Dynamo alone (``backend="eager"``) to stay fast, so this is where CI runs
Inductor (its C++ code on the CPU) on the models. ``--kernels`` runs fabriclite's kernels where the suite's
``compiled + all kernels`` row does (the norms swapped for the fused ones; RoPE, SwiGLU and linear cross-entropy in
the GPT): on a CPU they need ``TRITON_INTERPRET=1``.

Usage: ``python tests/examples/compiled_steps.py gpt --kernels``.
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

STEPS = 3


def train(model_name: str, kernels: tuple[str, ...], compile: bool) -> tuple[list[float], object]:
    """(the losses of STEPS training steps, the compile report) of one model through Fabric."""
    from in_model import MODEL_SIZES, SWAPPED, build_gpt, build_vit

    from fabriclite import Fabric
    from fabriclite.kernels.swap import swap_modules

    sizes = MODEL_SIZES["smoke"]
    fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed", compile=compile)
    torch.manual_seed(0)
    if model_name == "vit":
        model, loss_of, batches = build_vit(sizes, fabric.device)
    else:
        model, loss_of, batches = build_gpt(sizes, fabric.device, kernels)
    swap_modules(model, tuple(op for op in kernels if op in SWAPPED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *batches[step % len(batches)])
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    return losses, fabric.compile_report()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=("vit", "gpt"))
    parser.add_argument("--kernels", action="store_true", help="the kernels of the suite's 'compiled + all kernels'")
    args = parser.parse_args()
    from in_model import MODEL_KERNELS

    kernels = MODEL_KERNELS[args.model] if args.kernels else ()
    eager, _ = train(args.model, kernels, compile=False)
    compiled, report = train(args.model, kernels, compile=True)
    for step, (a, b) in enumerate(zip(eager, compiled)):
        print(f"STEP {step} eager={a:.6f} compiled={b:.6f}")
    print(f"REPORT {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
