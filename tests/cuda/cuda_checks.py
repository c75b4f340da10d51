"""What the GPU tests check, written once for any device: precisions, parity with raw PyTorch, checkpoints (and, in
compiled_kernels.py, the kernels and compile).

``test_cuda.py`` runs each check on CUDA at full size (marked ``gpu``) and again on the CPU at a tiny size, so that
the code of a check runs in every test run, GPU or not. A CPU run proves the check's code works, never the GPU. Each
check returns what it measured and raises ``AssertionError`` saying what went wrong; ``report`` prints its PASS or
FAIL line in the scripts beside this file.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.plugins import MixedPrecision

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
# The dtype a Linear computes in under each precision, and the dtype of the parameters.
COMPUTE_DTYPE = {
    "32-true": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
PARAM_DTYPE = {
    **dict.fromkeys(("32-true", "bf16-mixed", "16-mixed"), torch.float32),
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


def accelerator(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "cpu"


def fabric_on(device: torch.device, precision: str) -> Fabric:
    """A one-device Fabric; "16-mixed" on a CPU through the plugin, since the string means bf16 there."""
    if precision == "16-mixed" and device.type == "cpu":
        return Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu")])
    return Fabric(accelerator=accelerator(device), devices=1, precision=precision)


def small_model(width: int = 64, dropout: float = 0.1) -> nn.Module:
    """A classifier with what a precision must handle: matmuls, a LayerNorm, GELU and dropout."""
    return nn.Sequential(
        nn.Linear(16, width),
        nn.LayerNorm(width),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, 4),
    )


def fixed_batch(device: torch.device, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(size, 16, generator=generator), torch.randint(0, 4, (size,), generator=generator)
    return x.to(device), y.to(device)


# ---------------------------------------------------------------------- precisions
def train_with_precision(device: torch.device, precision: str, steps: int = 30) -> dict[str, Any]:
    """Fit one fixed batch for ``steps`` steps under ``precision``; what the parameters, the forward and the loss
    looked like. SGD, because Adam's eps of 1e-8 is 0 in fp16 and "16-true" would divide 0 by 0."""
    seed_everything(0, verbose=False)
    fabric = fabric_on(device, precision)
    model = small_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    inner = {}
    model.module[0].register_forward_hook(lambda module, args, out: inner.__setitem__("dtype", out.dtype))
    x, y = fixed_batch(fabric.device)
    losses = []
    for _ in range(steps):
        out = model(x)
        loss = F.cross_entropy(out, y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    parameter = next(model.parameters())
    return {
        "losses": losses,
        "param_dtype": parameter.dtype,
        "param_device": parameter.device.type,
        "compute_dtype": inner["dtype"],
        "output_dtype": out.dtype,
    }


def check_precision(device: torch.device, precision: str) -> dict[str, Any]:
    result = train_with_precision(device, precision)
    losses = result["losses"]
    assert all(torch.isfinite(torch.tensor(losses))), f"{precision}: non-finite losses {losses}"
    assert losses[-1] < 0.7 * losses[0], f"{precision}: the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}"
    assert result["param_device"] == device.type, result
    assert result["param_dtype"] == PARAM_DTYPE[precision], result
    assert result["compute_dtype"] == COMPUTE_DTYPE[precision], result
    # Every precision hands the output back in the default dtype, fp32, as Lightning does.
    assert result["output_dtype"] == torch.float32, result
    return result


def check_inf_gradients_skip_the_step(device: torch.device, precision: str) -> dict[str, Any]:
    """Under an fp16 precision (with its loss scaler): a step whose gradients are inf changes no weight, halves
    the scale and counts one skipped step; the next finite step applies."""
    seed_everything(0, verbose=False)
    fabric = fabric_on(device, precision)
    model = small_model()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    scaler = fabric.strategy.precision.scaler
    assert scaler is not None, f"{precision} has no loss scaler"
    x, y = fixed_batch(fabric.device)

    def step(scale_loss: float = 1.0) -> bool:
        """One step; whether it changed the weights."""
        before = [p.detach().clone() for p in model.parameters()]
        loss = F.cross_entropy(model(x), y) * scale_loss
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))

    # The first steps may overflow at the initial scale (2**16) and be skipped: find the scale that works.
    for _ in range(20):
        if step():
            break
    else:
        raise AssertionError(f"{precision}: no finite step applied in 20 tries (scale {scaler.get_scale()})")
    scale = scaler.get_scale()
    changed = step(float("inf"))
    result = {"scale_before": scale, "scale_after": scaler.get_scale(), "skipped": scaler.skipped_in_a_row}
    assert not changed, f"{precision}: a step with inf gradients changed the weights"
    assert result["scale_after"] == scale * 0.5, result
    assert result["skipped"] == 1, result
    assert step(), f"{precision}: the finite step after the skipped one did not apply"
    assert scaler.skipped_in_a_row == 0
    return result


# ---------------------------------------------------------------------- parity with raw PyTorch
@contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms (on CUDA, cuBLAS needs CUBLAS_WORKSPACE_CONFIG set before its first use:
    tests/cuda/conftest.py sets it). An op that has no deterministic CUDA kernel warns instead of stopping the run
    (``warn_only``): identical weights at the end are the check."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    benchmark = torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.backends.cudnn.benchmark = benchmark


def _parity_setup() -> tuple[nn.Module, torch.optim.Optimizer, DataLoader]:
    seed_everything(7, verbose=False)
    model = small_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = TensorDataset(torch.randn(400, 16), torch.randint(0, 4, (400,)))
    return model, optimizer, DataLoader(data, batch_size=16, shuffle=True)  # 25 steps an epoch


def train_raw(device: torch.device, precision: str, epochs: int = 2) -> dict[str, torch.Tensor]:
    model, optimizer, loader = _parity_setup()
    model.to(device)
    for _ in range(epochs):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train_fabric(device: torch.device, precision: str, epochs: int = 2) -> dict[str, torch.Tensor]:
    model, optimizer, loader = _parity_setup()
    fabric = fabric_on(device, precision)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def check_parity(device: torch.device, precision: str) -> None:
    """50 steps (2 epochs of 25) raw and through Fabric, with deterministic algorithms: identical weights."""
    with deterministic():
        raw, fabric = train_raw(device, precision), train_fabric(device, precision)
    assert raw.keys() == fabric.keys()
    differ = [key for key in raw if not torch.equal(raw[key], fabric[key])]
    assert not differ, f"{precision} on {device}: after 50 steps these differ from raw PyTorch: {differ}"


# ---------------------------------------------------------------------- checkpoints across devices
def checkpoint_state(fabric: Fabric) -> dict[str, Any]:
    """A model, its AdamW and a step counter set up on ``fabric``, with the same initial weights every time (no
    dropout, so that runs on different strategies draw nothing)."""
    seed_everything(3, verbose=False)
    model = small_model(dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    return {"model": model, "optimizer": optimizer, "step": 0}


def train_a_step(fabric: Fabric, state: dict[str, Any]) -> None:
    x, y = fixed_batch(fabric.device)
    loss = F.cross_entropy(state["model"](x), y)
    state["optimizer"].zero_grad()
    fabric.backward(loss)
    state["optimizer"].step()
    state["step"] += 1


def tensors_of(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the model's and the optimizer's state, by a flat name, whole (FSDP's DTensors gathered) and
    on the CPU."""
    flat = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    for index, values in state["optimizer"].state_dict()["state"].items():
        flat.update({f"optimizer.{index}.{k}": v for k, v in values.items() if isinstance(v, torch.Tensor)})
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in flat.items()}


def check_loaded(state: dict[str, Any], expected: dict[str, torch.Tensor], device: torch.device, step: int) -> None:
    """``state`` holds exactly ``expected``, on ``device``."""
    assert state["step"] == step, state["step"]
    actual = tensors_of(state)
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    differ = [k for k in expected if not torch.equal(actual[k], expected[k])]
    assert not differ, f"these differ after loading: {differ}"
    placed = {p.device.type for p in state["model"].parameters()}
    placed |= {
        v.device.type
        for s in state["optimizer"].state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim()
    }
    assert placed == {device.type}, f"loaded onto {placed}, expected {device.type}"


# ---------------------------------------------------------------------- as a script
def report(name: str, check: Callable[[], Any], rank: int = 0) -> bool:
    """Run one check and print its "PASS <rank> <name>" or "FAIL <rank> <name>: <why>" line; whether it passed.
    One write per line, because the ranks of a run share one pipe."""
    try:
        result = check()
    except Exception as error:  # noqa: BLE001 - one failing check must not hide the others
        reason = "".join(traceback.format_exception_only(type(error), error)).strip().replace("\n", " | ")
        os.write(1, f"FAIL {rank} {name}: {reason}\n".encode())
        traceback.print_exc()
        return False
    os.write(1, (f"PASS {rank} {name}\n" + (f"    {result}\n" if result is not None else "")).encode())
    return True
