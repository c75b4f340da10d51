"""The checks that need fabriclite's kernels compiled for the GPU, so they run in a process of their own with Triton's
interpreter off (``TRITON_INTERPRET=0``), whatever the pytest process set: each kernel against torch at LLM shapes,
forward and backward, and ``compile=True`` with and without kernels training in one graph. On a CPU the same checks
run at tiny sizes under the interpreter. Prints one "PASS 0 <name>" or "FAIL 0 <name>: <why>" line per check.

Usage::

    TRITON_INTERPRET=0 python tests/cuda/compiled_kernels.py kernels cuda llm   # every kernel at LLM shapes
    TRITON_INTERPRET=0 python tests/cuda/compiled_kernels.py compile cuda       # compile, with and without kernels
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from cuda_checks import accelerator, report
from torch import nn

from fabriclite import Fabric, seed_everything


# ---------------------------------------------------------------------- kernels against torch
@dataclass
class KernelCase:
    """One op: its inputs at a size, the kernel, and torch's formula (run in bf16 and in the reference dtype)."""

    make: Callable[[tuple[int, ...], torch.device], dict[str, torch.Tensor]]  # leaves require grad
    kernel: Callable[..., Any]
    formula: Callable[..., Any]
    launches: tuple[str, ...]  # the Triton kernels that must have run
    reference_dtype: torch.dtype = torch.float64


def _leaf(*shape: int, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=device)).to(torch.bfloat16).requires_grad_()


def _targets(rows: int, classes: int, device: torch.device) -> torch.Tensor:
    target = torch.randint(0, classes, (rows,), device=device)
    target[torch.rand(rows, device=device) < 0.1] = -100  # padding, as in language modelling
    return target


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_tables(seq_len: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's (T, D) cos and sin tables in bf16: the frequencies repeated over both halves."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)


def kernel_cases() -> dict[str, KernelCase]:
    from fabriclite import kernels

    eps = 1e-6
    return {
        "cross_entropy": KernelCase(
            lambda s, d: {"logits": _leaf(*s, device=d, scale=2.0), "target": _targets(*s, d)},
            kernels.cross_entropy,
            lambda logits, target: F.cross_entropy(logits, target),
            ("_cross_entropy_forward_kernel",),
        ),
        # The reference in fp32 (TF32 off), not float64: at N=8192, H=4096, V=128256 float64 would need about
        # 40 GB and gains nothing against bf16 errors of 1e-3.
        "linear_cross_entropy": KernelCase(
            lambda s, d: {
                "hidden": _leaf(s[0], s[1], device=d),
                "weight": _leaf(s[2], s[1], device=d, scale=s[1] ** -0.5),  # logits of std 1, as a trained head
                "target": _targets(s[0], s[2], d),
            },
            kernels.linear_cross_entropy,
            lambda hidden, weight, target: F.cross_entropy(F.linear(hidden, weight), target),
            ("_linear_cross_entropy_forward_kernel", "_linear_cross_entropy_backward_kernel"),
            torch.float32,
        ),
        "rms_norm": KernelCase(
            lambda s, d: {"x": _leaf(*s, device=d, scale=2.0), "weight": _leaf(s[1], device=d)},
            lambda x, weight: kernels.rms_norm(x, weight, eps),
            lambda x, weight: F.rms_norm(x, x.shape[-1:], weight, eps),
            ("_norm_forward_kernel", "_norm_backward_kernel"),
        ),
        "add_rms_norm": KernelCase(
            lambda s, d: {"x": _leaf(*s, device=d), "residual": _leaf(*s, device=d), "weight": _leaf(s[1], device=d)},
            lambda x, residual, weight: kernels.add_rms_norm(x, residual, weight, eps),
            lambda x, residual, weight: (F.rms_norm(x + residual, x.shape[-1:], weight, eps), x + residual),
            ("_norm_forward_kernel", "_norm_backward_kernel"),
        ),
        "layer_norm": KernelCase(
            lambda s, d: {
                "x": _leaf(*s, device=d, scale=2.0) + 0.5,
                "weight": _leaf(s[1], device=d),
                "bias": _leaf(s[1], device=d),
            },
            lambda x, weight, bias: kernels.layer_norm(x, x.shape[-1:], weight, bias),
            lambda x, weight, bias: F.layer_norm(x, x.shape[-1:], weight, bias),
            ("_norm_forward_kernel", "_norm_backward_kernel"),
        ),
        # (B, T, H, D) queries, keys with a quarter of the heads (grouped-query attention), Llama's tables.
        "rope": KernelCase(
            lambda s, d: {
                "q": _leaf(*s, device=d),
                "k": _leaf(s[0], s[1], s[2] // 4, s[3], device=d),
                **dict(zip(("cos", "sin"), _rope_tables(s[1], s[3], d))),
            },
            kernels.rope,
            lambda q, k, cos, sin: (
                q * cos[:, None] + _rotate_half(q) * sin[:, None],
                k * cos[:, None] + _rotate_half(k) * sin[:, None],
            ),
            ("_rope_forward_kernel", "_rope_backward_kernel"),
        ),
        "swiglu": KernelCase(
            lambda s, d: {"a": _leaf(*s, device=d, scale=3.0), "b": _leaf(*s, device=d)},
            kernels.swiglu,
            lambda a, b: F.silu(a) * b,
            ("_swiglu_forward_kernel", "_swiglu_backward_kernel"),
        ),
    }


# Sizes per op. "llm": what a Llama-3-8B-sized model feeds them (vocabulary 128256, width 4096, 8192 for the norms'
# widest block, intermediate 14336, 32 heads of 128); "tiny": a few rows, for Triton's interpreter on a CPU.
KERNEL_SHAPES = {
    "llm": {
        "cross_entropy": [(8192, 128256)],
        "linear_cross_entropy": [(8192, 4096, 128256)],
        "rms_norm": [(16384, 4096), (16384, 8192)],
        "add_rms_norm": [(16384, 4096), (16384, 8192)],
        "layer_norm": [(16384, 4096), (16384, 8192)],
        "rope": [(2, 4096, 32, 128)],
        "swiglu": [(16384, 14336)],
    },
    "tiny": {
        "cross_entropy": [(13, 300)],
        "linear_cross_entropy": [(13, 24, 101)],
        "rms_norm": [(9, 96)],
        "add_rms_norm": [(9, 96)],
        "layer_norm": [(9, 96)],
        "rope": [(1, 8, 4, 16)],
        "swiglu": [(9, 40)],
    },
}


def _outputs(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else list(result)


def _run(
    fn: Callable[..., Any], inputs: dict[str, torch.Tensor], dtype: torch.dtype, upstream: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The outputs of ``fn`` on ``inputs`` cast to ``dtype``, then the gradients of the differentiable inputs."""
    leaves = {
        name: t.detach().to(dtype).requires_grad_(t.requires_grad) if t.is_floating_point() else t
        for name, t in inputs.items()
    }
    outputs = _outputs(fn(**leaves))
    torch.autograd.backward(outputs, [g.to(out.dtype) for g, out in zip(upstream, outputs)])
    results = [out.detach() for out in outputs] + [t.grad for t in leaves.values() if t.requires_grad]
    del leaves, outputs
    return results


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64; inf when ``actual`` has a NaN or an inf."""
    if not torch.isfinite(actual).all():
        return float("inf")
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def check_kernel(op: str, shape: tuple[int, ...], device: torch.device) -> list[tuple[float, float]]:
    """The kernel's outputs and input gradients in bf16 against a higher-precision reference, next to torch's own
    bf16 computation: the kernel's error (norm-wise) at most twice torch's, or at most 1e-3 where torch's is
    smaller (Triton's interpreter rounds by truncating, so three times there). Returns (kernel, torch) errors."""
    from fabriclite.kernels import _common

    case = kernel_cases()[op]
    torch.manual_seed(0)
    inputs = case.make(shape, device)
    probe = _outputs(case.formula(**{n: t.detach() for n, t in inputs.items()}))
    upstream = [torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out) for out in probe]
    del probe

    before = dict(_common.LAUNCHES)
    kernel = _run(case.kernel, inputs, torch.bfloat16, upstream)
    missing = [name for name in case.launches if _common.LAUNCHES[name] <= before.get(name, 0)]
    assert not missing, f"{op}: these Triton kernels never launched: {missing}"
    eager = _run(case.formula, inputs, torch.bfloat16, upstream)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # an fp32 reference in fp32, not TF32
    try:
        reference = _run(case.formula, inputs, case.reference_dtype, upstream)
    finally:
        torch.set_float32_matmul_precision(previous)

    factor = 3.0 if _common.INTERPRET else 2.0
    errors = []
    for index, (k, t, r) in enumerate(zip(kernel, eager, reference)):
        assert k.shape == r.shape, f"{op} result {index}: shape {tuple(k.shape)}, torch's {tuple(r.shape)}"
        kernel_error, torch_error = relative_error(k, r), relative_error(t, r)
        errors.append((kernel_error, torch_error))
        assert kernel_error <= max(factor * torch_error, 1e-3), (
            f"{op} {shape} result {index} (outputs, then input gradients): relative error {kernel_error:.2e}, "
            f"torch's bf16 {torch_error:.2e}"
        )
    return errors


# ---------------------------------------------------------------------- compile
class Block(nn.Module):
    """A pre-norm transformer block with its LayerNorms, attention through SDPA, and a GELU MLP."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(self.ln_1(x)).split(C, 2)
        )
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


def train_compiled(device: torch.device, kernels: bool, compile: Any, steps: int = 4) -> dict[str, Any]:
    """Train a stem and two blocks for ``steps`` steps under bf16-mixed with ``compile``; the compile report, the Triton
    kernels launched, and the losses."""
    from fabriclite.kernels import _common

    seed_everything(0, verbose=False)
    torch._dynamo.reset()  # each run compiles afresh: its report counts its own graphs, not a cache hit
    fabric = Fabric(accelerator=accelerator(device), precision="bf16-mixed", compile=compile, kernels=kernels)
    # A stem before the blocks: every block's input then needs a gradient, so the two share one regional graph.
    model = nn.Sequential(nn.Linear(64, 64), Block(), Block(), nn.LayerNorm(64), nn.Linear(64, 10))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randn(4, 8, 64, device=fabric.device)  # few rows: Triton's interpreter runs them one by one
    y = torch.randint(0, 10, (4,), device=fabric.device)
    before = dict(_common.LAUNCHES)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(model(x).mean(1), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    launched = {name for name, count in _common.LAUNCHES.items() if count > before.get(name, 0)}
    report = fabric.compile_report()
    return {"report": report[0] if report else None, "launched": launched, "losses": losses}


def check_compile(device: torch.device, kernels: bool, compile: Any = True) -> dict[str, Any]:
    """compile=... trains like eager (losses within bf16 noise), in one graph with no break and no recompile; with
    kernels=True too, where the norms stay torch's (inductor fuses them; see kernels/swap.py's rule)."""
    eager = train_compiled(device, kernels, compile=False)
    compiled = train_compiled(device, kernels, compile)
    report = compiled["report"]
    assert report is not None, "compile_report() is empty: the model was not compiled"
    assert (report["graphs"], report["graph_breaks"], report["recompiles"]) == (1, 0, 0), report
    layer_norm = {"_norm_forward_kernel", "_norm_backward_kernel"}
    assert not compiled["launched"] & layer_norm, f"a norm kernel ran under compile: {compiled['launched']}"
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=3e-2, atol=3e-2)
    return compiled


def compile_report(device: torch.device, kernels: bool, compile: Any = True) -> dict[str, Any]:
    return check_compile(device, kernels, compile)["report"]


def main(argv: list[str]) -> int:
    group, device = argv[0], torch.device(argv[1])
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        print("FAIL 0 setup: TRITON_INTERPRET is set; the GPU checks compile the kernels. Unset it.", flush=True)
        return 1
    passed = True
    if group == "kernels":
        size = argv[2]
        for op, shapes in KERNEL_SHAPES[size].items():
            for shape in shapes:
                passed &= report(f"kernel {op} {'x'.join(map(str, shape))}", partial(check_kernel, op, shape, device))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    elif group == "compile":
        compile_arg: Any = True if device.type == "cuda" else {"backend": "eager"}  # no C++ build on a CPU
        for kernels in (False, True):
            passed &= report(f"compile kernels={kernels}", partial(compile_report, device, kernels, compile_arg))
    else:
        raise SystemExit(f"unknown group {group!r}: kernels or compile")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
