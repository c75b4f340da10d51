"""Speed and memory of fabriclite's Triton kernels next to torch eager, ``torch.compile`` of the same function, and
Liger-Kernel where it has the op and is installed, on one CUDA GPU, in bf16.

For every op and size it measures the forward, and forward and backward together (a training step's share): the
median time from ``triton.testing.do_bench`` and the peak memory allocated beyond what existed before
(``torch.cuda.max_memory_allocated``; for the forward that includes the outputs and what autograd saves, for both
also the gradients and temporaries). Throughput is the bytes any implementation must move (each input
read once, each output written once: for cross-entropy the forward reads the logits and the backward writes their
gradient) over the time, next to the copy bandwidth of the device measured with ``x.clone()``. Fused kernels that
move more than that minimum (cross-entropy's forward also writes the gradient) show it as lower throughput.

Results go to a CSV (one row per op, size, mode and implementation, each written as soon as it is measured, with
the device, torch and triton versions) and a markdown table on stdout. ``--quick`` keeps the LLM sizes and ViT-B/16's
norm only. Layer norm and RMS norm also get a third mode, "both, GPU time": the GPU's kernel time of a forward and
backward from the profiler, without the host's time, which do_bench's wall time includes when the host is the slower
side (a norm call at 16384x4096 on an H200 was). Two more columns time issue 40's alternatives side by side: the
norm backward's row loop, and linear cross-entropy's row chunks.

``--host-cost`` measures instead the Python cost of one forward+backward call at a tiny shape (16x768), where a
GPU finishes the work long before the host has launched it: fabriclite's path with every Triton launch replaced by a
no-op, next to the torch op's (dispatch and all). Without a GPU it runs on the CPU in fp32, as a proxy: there the
torch op also computes (a few microseconds at this size; bf16 would be slower on a CPU) and Triton's launcher (tens
of microseconds per launch on a GPU) is left out, so the figure that decides is the wall time per call on a GPU.

Usage: ``python benchmarks/kernels.py [--ops layer_norm cross_entropy] [--quick] [--csv kernels.csv]``, or
``python benchmarks/kernels.py --host-cost [--ops layer_norm]``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import importlib
import math
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from _machine import describe

DEVICE = "cuda"
DTYPE = torch.bfloat16
# Full run: every width with every row count. --quick: the LLM sizes only (widths 4096 and 8192 at 16k rows, the
# 128k vocabulary), to fit in a few minutes.
NORM_WIDTHS = (768, 1024, 4096, 8192)
ROWS = (4096, 16384, 32768)
QUICK_NORMS = ((4096, 8192), (16384,))
VIT_NORMS = ((768,), (25216,))  # ViT-B/16's rows at batch 128: issue 40's other norm backward goal
CROSS_ENTROPY_SHAPES = ((8192, 50257), (8192, 128256))
LINEAR_CROSS_ENTROPY_SHAPES = ((8192, 768, 50257), (8192, 4096, 128256))  # tokens, width, vocabulary
ROPE_HEAD_DIM, ROPE_SEQ_LEN = 64, 1024
# Forward alone, and forward + backward (what a training step pays). A backward alone would have to run twice on
# one graph, which the in-place backward of the cross-entropy refuses by design.
MODES = ("forward", "both")
# The norms' forward and backward once more, as the GPU's kernel time alone (summed from the profiler, no host time):
# what tells one backward design from another where a call's host time hides both.
GPU_TIME = "both, GPU time"
NORM_MODES = (*MODES, GPU_TIME)
# "fabriclite, overwrite": cross_entropy(..., overwrite_logits=True), the backward writing the gradient over the
# logits instead of into a new (N, C) buffer. The benchmark's logits are leaves, so their values are the gradient
# of the last call from then on (the same work each call); a model's logits are a linear layer's output, which
# nothing reads after the loss.
# "fabriclite, row loop": the norm backward as it was before issue 40, one row at a time (_norm.ROW_LOOP_BACKWARD),
# timed next to the tiles that replaced it. "fabriclite, row chunks": linear cross-entropy's other design, chunks of
# rows with the gradients made in the forward (fused_linear_cross_entropy.GRADIENT_IN_FORWARD).
IMPLEMENTATIONS = (
    "fabriclite", "fabriclite, row loop", "fabriclite, row chunks", "fabriclite, overwrite", "torch",
    "torch.compile", "liger",
)  # fmt: skip

Inputs = dict[str, torch.Tensor]


@dataclass
class Case:
    """One op at one size: how to make its inputs, its implementations, and the minimum bytes per mode."""

    op: str
    shape: str
    make_inputs: Callable[[], Inputs]
    implementations: dict[str, Callable[..., Any]]  # name -> fn(**inputs) returning a tensor or a tuple
    min_bytes: dict[str, int]  # mode -> bytes an ideal implementation reads and writes
    extra_leaves: tuple[torch.Tensor, ...] = ()  # parameters a module (Liger's) brings along
    modes: tuple[str, ...] = MODES
    settings: dict[str, Callable[[], Any]] = field(default_factory=dict)  # name -> a context to measure it in


# ---------------------------------------------------------------------- the cases
def _liger(name: str, *args: Any, **kwargs: Any) -> torch.nn.Module | None:
    """Liger-Kernel's module ``liger_kernel.transformers.<name>`` on the GPU in bf16, or None when not installed
    (or when this version's constructor differs: the comparison is optional)."""
    try:
        import liger_kernel.transformers as liger
    except ImportError:
        return None
    try:
        return getattr(liger, name)(*args, **kwargs).to(DEVICE, DTYPE)
    except Exception as error:  # noqa: BLE001 - an API change in an optional peer must not stop the run
        print(f"(skipping Liger {name}: {error})", file=sys.stderr)
        return None


def _liger_function(module: str, name: str) -> Callable[..., Any] | None:
    """Liger-Kernel's function ``liger_kernel.<module>.<name>``, or None when not installed or not in this
    version (the comparison is optional)."""
    try:
        return getattr(importlib.import_module(f"liger_kernel.{module}"), name)
    except (ImportError, AttributeError):
        return None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _compiled(eager: Callable[..., Any]) -> Callable[..., Any]:
    """torch.compile of ``eager`` for static shapes. main() resets dynamo before each case, so the recompile limit
    (8 per code object; every size is a recompile) never silently sends a later size back to eager."""
    return torch.compile(eager, dynamic=False)


def _leaf(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=DTYPE, requires_grad=True)


def norm_cases(rows_list: tuple[int, ...], widths: tuple[int, ...] = NORM_WIDTHS) -> list[Case]:
    from fabriclite import kernels

    cases = []
    for width in widths:
        for rows in rows_list:
            shape, elements = f"{rows}x{width}", rows * width
            # bf16: 2 bytes
            io = {"forward": 4 * elements, "backward": 6 * elements, "both": 10 * elements, GPU_TIME: 10 * elements}

            def layer_norm_eager(x, weight, bias, _n=width):
                return F.layer_norm(x, (_n,), weight, bias)

            liger_ln = _liger("LigerLayerNorm", width, eps=1e-5)
            cases.append(
                Case(
                    "layer_norm",
                    shape,
                    lambda r=rows, n=width: {"x": _leaf(r, n), "weight": _leaf(n), "bias": _leaf(n)},
                    {
                        "fabriclite": lambda x, weight, bias, _n=width: kernels.layer_norm(x, (_n,), weight, bias),
                        "fabriclite, row loop": lambda x, weight, bias, _n=width: kernels.layer_norm(
                            x, (_n,), weight, bias
                        ),
                        "torch": layer_norm_eager,
                        "torch.compile": _compiled(layer_norm_eager),
                        **({"liger": lambda x, weight, bias, _m=liger_ln: _m(x)} if liger_ln is not None else {}),
                    },
                    io,
                    tuple(liger_ln.parameters()) if liger_ln is not None else (),
                    NORM_MODES,
                    {"fabriclite, row loop": _row_loop_backward},
                )
            )

            def add_layer_norm_eager(x, residual, weight, bias, _n=width):
                hidden = x + residual
                return F.layer_norm(hidden, (_n,), weight, bias), hidden

            cases.append(
                Case(
                    "add_layer_norm",
                    shape,
                    lambda r=rows, n=width: {
                        "x": _leaf(r, n),
                        "residual": _leaf(r, n),
                        "weight": _leaf(n),
                        "bias": _leaf(n),
                    },
                    {
                        "fabriclite": lambda x, residual, weight, bias: kernels.add_layer_norm(
                            x, residual, weight, bias
                        ),
                        "torch": add_layer_norm_eager,
                        "torch.compile": _compiled(add_layer_norm_eager),
                    },
                    # forward: x, residual in; normalized, sum out. backward: dy, dsum, sum in; one gradient out.
                    {"forward": 8 * elements, "backward": 8 * elements, "both": 16 * elements},
                )
            )

            def rms_norm_eager(x, weight, _n=width):
                return F.rms_norm(x, (_n,), weight, 1e-6)

            liger_rms = _liger("LigerRMSNorm", width, eps=1e-6)
            cases.append(
                Case(
                    "rms_norm",
                    shape,
                    lambda r=rows, n=width: {"x": _leaf(r, n), "weight": _leaf(n)},
                    {
                        "fabriclite": lambda x, weight: kernels.rms_norm(x, weight, 1e-6),
                        "fabriclite, row loop": lambda x, weight: kernels.rms_norm(x, weight, 1e-6),
                        "torch": rms_norm_eager,
                        "torch.compile": _compiled(rms_norm_eager),
                        **({"liger": lambda x, weight, _m=liger_rms: _m(x)} if liger_rms is not None else {}),
                    },
                    io,
                    tuple(liger_rms.parameters()) if liger_rms is not None else (),
                    NORM_MODES,
                    {"fabriclite, row loop": _row_loop_backward},
                )
            )

            def add_rms_norm_eager(x, residual, weight, _n=width):
                hidden = x + residual
                return F.rms_norm(hidden, (_n,), weight, 1e-6), hidden

            liger_add_rms = _liger("LigerFusedAddRMSNorm", width, eps=1e-6)
            cases.append(
                Case(
                    "add_rms_norm",
                    shape,
                    lambda r=rows, n=width: {"x": _leaf(r, n), "residual": _leaf(r, n), "weight": _leaf(n)},
                    {
                        "fabriclite": lambda x, residual, weight: kernels.add_rms_norm(x, residual, weight, 1e-6),
                        "torch": add_rms_norm_eager,
                        "torch.compile": _compiled(add_rms_norm_eager),
                        **(
                            {"liger": lambda x, residual, weight, _m=liger_add_rms: _m(x, residual)}
                            if liger_add_rms is not None
                            else {}
                        ),
                    },
                    # as add_layer_norm: x, residual in, normalized, sum out; dy, dsum, sum in, one gradient out.
                    {"forward": 8 * elements, "backward": 8 * elements, "both": 16 * elements},
                    tuple(liger_add_rms.parameters()) if liger_add_rms is not None else (),
                )
            )

            # RoPE on this width's heads of 64 (12 or 16), keys with a quarter of them (grouped-query attention),
            # in sequences of ROPE_SEQ_LEN tokens.
            heads, batch = width // ROPE_HEAD_DIM, rows // ROPE_SEQ_LEN
            rope_elements = rows * (heads + heads // 4) * ROPE_HEAD_DIM

            def make_rope(b=batch, h=heads):
                t, d = ROPE_SEQ_LEN, ROPE_HEAD_DIM
                cos, sin = torch.randn(t, d, device=DEVICE, dtype=DTYPE), torch.randn(t, d, device=DEVICE, dtype=DTYPE)
                return {"q": _leaf(b, t, h, d), "k": _leaf(b, t, h // 4, d), "cos": cos, "sin": sin}

            def rope_eager(q, k, cos, sin):
                cos, sin = cos[:, None], sin[:, None]  # (T, 1, D): over the heads
                return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

            liger_rope = _liger_function("transformers.rope", "liger_rotary_pos_emb")
            cases.append(
                Case(
                    "rope",
                    f"{batch}x{ROPE_SEQ_LEN}x{heads}/{heads // 4}x{ROPE_HEAD_DIM}",  # B x T x H (q/k) x D
                    make_rope,
                    {
                        "fabriclite": kernels.rope,
                        "torch": rope_eager,
                        "torch.compile": _compiled(rope_eager),
                        # Liger takes (B, H, T, D) and (1, T, D) tables, and rotates in place.
                        **(
                            {
                                "liger": lambda q, k, cos, sin, _f=liger_rope: _f(
                                    q.transpose(1, 2), k.transpose(1, 2), cos[None], sin[None]
                                )
                            }
                            if liger_rope is not None
                            else {}
                        ),
                    },
                    # q and k in, both rotated out; the (T, D) tables are small.
                    {"forward": 4 * rope_elements, "backward": 4 * rope_elements, "both": 8 * rope_elements},
                )
            )

            # bias + GELU sits on the MLP's hidden layer, four times the model width.
            hidden_width, hidden_elements = 4 * width, 4 * elements

            def bias_gelu_eager(x, bias):
                return F.gelu(x + bias, approximate="tanh")

            cases.append(
                Case(
                    "bias_gelu",
                    f"{rows}x{hidden_width}",
                    lambda r=rows, n=hidden_width: {"x": _leaf(r, n), "bias": _leaf(n)},
                    {
                        "fabriclite": lambda x, bias: kernels.bias_gelu(x, bias, "tanh"),
                        "torch": bias_gelu_eager,
                        "torch.compile": _compiled(bias_gelu_eager),
                    },
                    {"forward": 4 * hidden_elements, "backward": 6 * hidden_elements, "both": 10 * hidden_elements},
                )
            )

            def swiglu_eager(a, b):
                return F.silu(a) * b

            liger_swiglu = _liger_function("ops.swiglu", "LigerSiLUMulFunction")
            cases.append(
                Case(
                    "swiglu",
                    f"{rows}x{hidden_width}",
                    lambda r=rows, n=hidden_width: {"a": _leaf(r, n), "b": _leaf(r, n)},
                    {
                        "fabriclite": kernels.swiglu,
                        "torch": swiglu_eager,
                        "torch.compile": _compiled(swiglu_eager),
                        # Liger writes its gradients into the saved a and b; its apply() takes positions only.
                        **({"liger": lambda a, b, _f=liger_swiglu: _f.apply(a, b)} if liger_swiglu is not None else {}),
                    },
                    # forward: a, b in, y out; backward: dy, a, b in, da, db out.
                    {"forward": 6 * hidden_elements, "backward": 10 * hidden_elements, "both": 16 * hidden_elements},
                )
            )
    return cases


def cross_entropy_cases(shapes: tuple[tuple[int, int], ...] = CROSS_ENTROPY_SHAPES) -> list[Case]:
    from fabriclite import kernels

    def make(rows: int, classes: int) -> Inputs:
        target = torch.randint(0, classes, (rows,), device=DEVICE)
        target[torch.rand(rows, device=DEVICE) < 0.1] = -100  # some padding, as in language modeling
        return {"logits": _leaf(rows, classes), "target": target}

    def eager(logits, target):
        return F.cross_entropy(logits, target)

    cases = []
    for rows, classes in shapes:
        elements = rows * classes
        liger_ce = _liger("LigerCrossEntropyLoss")
        cases.append(
            Case(
                "cross_entropy",
                f"{rows}x{classes}",
                lambda r=rows, c=classes: make(r, c),
                {
                    "fabriclite": kernels.cross_entropy,
                    "fabriclite, overwrite": lambda logits, target: kernels.cross_entropy(
                        logits, target, overwrite_logits=True
                    ),
                    "torch": eager,
                    "torch.compile": _compiled(eager),
                    **(
                        {"liger": lambda logits, target, _m=liger_ce: _m(logits, target)}
                        if liger_ce is not None
                        else {}
                    ),
                },
                {"forward": 2 * elements, "backward": 2 * elements, "both": 4 * elements},
            )
        )
    return cases


def linear_cross_entropy_cases(
    shapes: tuple[tuple[int, int, int], ...] = LINEAR_CROSS_ENTROPY_SHAPES,
) -> list[Case]:
    from fabriclite import kernels

    def make(rows: int, width: int, classes: int) -> Inputs:
        target = torch.randint(0, classes, (rows,), device=DEVICE)
        target[torch.rand(rows, device=DEVICE) < 0.1] = -100
        # A weight of std 1/sqrt(width): logits of std 1, as a trained output layer gives, not a saturated softmax.
        weight = (torch.randn(classes, width, device=DEVICE, dtype=DTYPE) / width**0.5).requires_grad_()
        return {"hidden": _leaf(rows, width), "weight": weight, "target": target}

    def eager(hidden, weight, target):
        return F.cross_entropy(F.linear(hidden, weight), target)

    cases = []
    for rows, width, classes in shapes:
        liger_flce = _liger("LigerFusedLinearCrossEntropyLoss")
        # Compute-bound (three matmuls of rows x width x classes); the minimum bytes are the inputs read and their
        # gradients written, so the throughput column says little here: time and peak memory are the measures.
        io = 2 * (rows * width + classes * width)
        cases.append(
            Case(
                "linear_cross_entropy",
                f"{rows}x{width}x{classes}",
                lambda r=rows, h=width, c=classes: make(r, h, c),
                {
                    "fabriclite": kernels.linear_cross_entropy,
                    "fabriclite, row chunks": kernels.linear_cross_entropy,
                    "torch": eager,
                    "torch.compile": _compiled(eager),
                    # Liger takes the weight first.
                    **(
                        {"liger": lambda hidden, weight, target, _m=liger_flce: _m(weight, hidden, target)}
                        if liger_flce is not None
                        else {}
                    ),
                },
                {"forward": io, "backward": io, "both": 2 * io},
                settings={"fabriclite, row chunks": _row_chunks},
            )
        )
    return cases


# ---------------------------------------------------------------------- measuring
def _outputs(result: Any) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else [t for t in result if isinstance(t, torch.Tensor)]


def _peak_mib(thunk: Callable[[], Any]) -> float:
    """MiB allocated at the peak of ``thunk()`` beyond what was allocated before it (results kept until measured)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = thunk()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del result
    return peak / 2**20


def measure(case: Case, name: str, fn: Callable[..., Any], mode: str) -> tuple[float, float]:
    """(median milliseconds, peak MiB) of one implementation in one mode."""
    from triton.testing import do_bench

    inputs = case.make_inputs()
    leaves = [t for t in inputs.values() if t.requires_grad] + list(case.extra_leaves)

    def forward() -> list[torch.Tensor]:
        return _outputs(fn(**inputs))

    outputs = forward()
    # A loss gets the 1.0 of loss.backward() (Liger skips its scaling then); other outputs a random gradient.
    grads = [torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out) for out in outputs]

    def both() -> None:
        torch.autograd.backward(forward(), grads)

    thunk = forward if mode == "forward" else both
    thunk()  # compiles (torch.compile, Triton) outside the timing
    for leaf in leaves:
        leaf.grad = None
    del outputs  # the timed forward makes its own graph; keep the memory baseline clean
    peak = _peak_mib(thunk)
    if mode == GPU_TIME:
        return gpu_milliseconds(thunk, leaves), peak
    milliseconds = do_bench(thunk, grad_to_none=leaves, return_mode="median")
    return milliseconds, peak


def gpu_milliseconds(thunk: Callable[[], Any], leaves: list[torch.Tensor], calls: int = 20) -> float:
    """Milliseconds the GPU spends in the kernels (and copies) of one ``thunk()``: the profiler's device events of
    ``calls`` calls, summed, over ``calls``. Host time, which do_bench's wall time includes when the host is the
    slower side, is left out."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for leaf in leaves:
                leaf.grad = None
            thunk()
        torch.cuda.synchronize()
    device_us = sum(
        event.time_range.elapsed_us() for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA
    )
    if device_us <= 0:
        raise RuntimeError("the profiler recorded no GPU activity")
    return device_us / calls / 1e3


def copy_bandwidth_gbps() -> float:
    """GB/s of ``x.clone()`` on 512 MiB: one read and one write, the ceiling for a memory-bound kernel."""
    from triton.testing import do_bench

    x = torch.empty(2**28, dtype=DTYPE, device=DEVICE)
    milliseconds = do_bench(lambda: x.clone(), return_mode="median")
    return 2 * x.numel() * x.element_size() / milliseconds / 1e6


def _triton_version() -> str:
    import triton

    return triton.__version__


# ---------------------------------------------------------------------- reporting
def markdown(rows: list[dict[str, Any]], header: list[str]) -> str:
    """One table row per op, size and mode; a cell per implementation: time, throughput, peak memory."""
    lines = [
        *header,
        "",
        "| op | shape | mode | " + " | ".join(IMPLEMENTATIONS) + " |",
        "|---|---|---|" + "---|" * len(IMPLEMENTATIONS),
    ]
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in rows:
        key = (row["op"], row["shape"], row["mode"])
        if row["error"]:
            text = "failed"
        else:
            text = f"{row['ms']:.3f} ms, {row['gbps']:.0f} GB/s, {row['peak_mib']:.0f} MiB"
        cells.setdefault(key, {})[row["implementation"]] = text
    for (op, shape, mode), by_name in cells.items():
        lines.append(
            f"| {op} | {shape} | {mode} | " + " | ".join(by_name.get(name, "-") for name in IMPLEMENTATIONS) + " |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------- host cost
HOST_COST_SHAPE = (16, 768)


@contextmanager
def _switched(module: str, name: str) -> Any:
    """``fabriclite.kernels.<module>.<name>`` (a design switch) True inside the block."""
    switches = importlib.import_module(f"fabriclite.kernels.{module}")
    setattr(switches, name, True)
    try:
        yield
    finally:
        setattr(switches, name, False)


def _row_loop_backward() -> Any:
    """The norm backward's previous design: one row at a time, nothing loaded ahead."""
    return _switched("_norm", "ROW_LOOP_BACKWARD")


def _row_chunks() -> Any:
    """Linear cross-entropy in chunks of rows, the gradients made in the forward."""
    return _switched("fused_linear_cross_entropy", "GRADIENT_IN_FORWARD")


def settings(case: Case, name: str) -> Any:
    """The context ``case``'s implementation ``name`` is measured in (usually none)."""
    return case.settings.get(name, nullcontext)()


@contextmanager
def _launches_skipped():
    """Every fabriclite kernel launch replaced by a no-op: what is left is the op's Python path."""
    from fabriclite.kernels import _common

    patched = [module for name, module in list(sys.modules.items()) if name.startswith("fabriclite.kernels.")]
    patched = [module for module in patched if getattr(module, "launch", None) is _common.launch]
    for module in patched:
        module.launch = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for module in patched:
            module.launch = _common.launch


def host_cost_cases(device: torch.device) -> dict[str, tuple[Callable[[], Inputs], dict[str, Callable[..., Any]]]]:
    """op -> (make the inputs at HOST_COST_SHAPE, {"fabriclite": fn, "torch": fn}); each fn(**inputs) -> a tensor."""
    from fabriclite import kernels

    rows, width = HOST_COST_SHAPE
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    def norm_inputs() -> Inputs:
        return {"x": leaf(rows, width), "weight": leaf(width), "bias": leaf(width)}

    def add_inputs() -> Inputs:
        return {"x": leaf(rows, width), "residual": leaf(rows, width), "weight": leaf(width)}

    def ce_inputs() -> Inputs:
        return {"logits": leaf(rows, width), "target": torch.randint(0, width, (rows,), device=device)}

    return {
        "layer_norm": (
            norm_inputs,
            {
                "fabriclite": lambda x, weight, bias: kernels.layer_norm(x, (width,), weight, bias),
                "torch": lambda x, weight, bias: F.layer_norm(x, (width,), weight, bias),
            },
        ),
        "rms_norm": (
            norm_inputs,
            {
                "fabriclite": lambda x, weight, bias: kernels.rms_norm(x, weight, 1e-6),
                "torch": lambda x, weight, bias: F.rms_norm(x, (width,), weight, 1e-6),
            },
        ),
        "add_rms_norm": (
            add_inputs,
            {
                "fabriclite": lambda x, residual, weight: kernels.add_rms_norm(x, residual, weight, 1e-6)[0],
                "torch": lambda x, residual, weight: F.rms_norm(x + residual, (width,), weight, 1e-6),
            },
        ),
        "swiglu": (
            lambda: {"a": leaf(rows, width), "b": leaf(rows, width)},
            {"fabriclite": kernels.swiglu, "torch": lambda a, b: F.silu(a) * b},
        ),
        "cross_entropy": (
            ce_inputs,
            {"fabriclite": kernels.cross_entropy, "torch": lambda logits, target: F.cross_entropy(logits, target)},
        ),
    }


def host_cost_us(
    make_inputs: Callable[[], Inputs], fn: Callable[..., Any], calls: int = 200, repeats: int = 7
) -> float:
    """Microseconds of one forward+backward call (the gradients reset each call, as a training step does): the
    fastest of ``repeats`` runs of ``calls`` calls, since other work on the machine only ever adds time."""
    inputs = make_inputs()
    leaves = [t for t in inputs.values() if t.requires_grad]
    grad = None

    def call() -> None:
        nonlocal grad
        out = fn(**inputs)
        if grad is None:
            grad = torch.ones_like(out)
        out.backward(grad)
        for leaf in leaves:
            leaf.grad = None

    for _ in range(20):
        call()
    cuda = leaves[0].is_cuda
    # On a GPU the wall time (what the step waits for); on a CPU this thread's CPU time, which the other processes
    # of a shared machine do not inflate the way they inflate wall time.
    clock = time.perf_counter if cuda else time.thread_time
    per_call = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        for _ in range(calls):
            call()
        if cuda:
            torch.cuda.synchronize()
        per_call.append((clock() - start) / calls * 1e6)
    return min(per_call)


def host_cost_main(ops: list[str] | None) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)  # a CPU proxy on one thread: other threads' scheduling is noise here
    rows, width = HOST_COST_SHAPE
    print(f"## host cost of one forward+backward call at {rows}x{width}, microseconds")
    print("")
    print(*describe(), sep="\n")
    print(f"- {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'no GPU: the CPU proxy, fp32'}), "
          f"torch {torch.__version__}; fabriclite with its Triton launches skipped, torch's op as it is")  # fmt: skip
    print("")
    # On a GPU also the whole call, Triton's launches included: what a training step waits for.
    whole = device.type == "cuda"
    print("| op | fabriclite (no launch) |" + (" fabriclite |" if whole else "") + " torch | difference |")
    print("|---|---|" + ("---|" if whole else "") + "---|---|")
    for op, (make_inputs, implementations) in host_cost_cases(device).items():
        if ops is not None and op not in ops:
            continue
        with _launches_skipped():
            ours = host_cost_us(make_inputs, implementations["fabriclite"])
        theirs = host_cost_us(make_inputs, implementations["torch"])
        if whole:
            ours_whole = host_cost_us(make_inputs, implementations["fabriclite"])
            print(f"| {op} | {ours:.0f} | {ours_whole:.0f} | {theirs:.0f} | {ours_whole - theirs:+.0f} |", flush=True)
        else:
            print(f"| {op} | {ours:.0f} | {theirs:.0f} | {ours - theirs:+.0f} |", flush=True)
    if whole:
        print("", *launch_cost_lines(device), sep="\n")
    first = next(op for op in host_cost_cases(device) if ops is None or op in ops)
    make_inputs, implementations = host_cost_cases(device)[first]
    print("", *host_profile_lines(first, make_inputs, implementations["fabriclite"]), sep="\n")
    return 0


def host_profile_lines(
    op: str, make_inputs: Callable[[], Inputs], fn: Callable[..., Any], calls: int = 300
) -> list[str]:
    """Where the host time of one forward+backward call goes (``cProfile``, the launches as they are): the functions
    with the most time of their own, in microseconds per call. On a GPU this names what the table's difference is
    made of; the profiler's own cost inflates every figure alike."""
    import cProfile
    import pstats

    inputs = make_inputs()
    leaves = [t for t in inputs.values() if t.requires_grad]

    def call() -> None:
        fn(**inputs).backward(grad)
        for leaf in leaves:
            leaf.grad = None

    grad = torch.ones_like(fn(**inputs))
    for _ in range(20):
        call()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        call()
    profile.disable()
    stats = pstats.Stats(profile).sort_stats("tottime")
    lines = [f"Where one {op} forward+backward call spends its host time (cProfile, own time, us per call):", "```"]
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:12]
    for (path, line, name), (_, ncalls, own, cumulative, _) in rows:
        where = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if line else name
        lines.append(
            f"{own / calls * 1e6:8.1f} own {cumulative / calls * 1e6:8.1f} cumulative {ncalls / calls:5.1f}x  {where}"
        )
    return [*lines, "```"]


def launch_cost_lines(device: torch.device, calls: int = 2000) -> list[str]:
    """Microseconds of one launch of the norm forward kernel at HOST_COST_SHAPE: through Triton's JIT entry
    (``kernel[grid](...)``, what fabriclite calls), straight through the compiled kernel's launcher (what a cached
    launch could cost), and one ``torch.empty`` for scale. The fastest of 5 runs of ``calls`` launches."""
    import triton

    from fabriclite.kernels import _norm

    rows, width = HOST_COST_SHAPE
    x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
    y, stats, weight = torch.empty_like(x), torch.empty(rows, device=device), torch.ones(width, device=device)
    block, warps = _norm._launch_sizes(width)
    args = (x, width, x, width, y, y, weight, weight, stats, width, 1e-5)
    meta = {"RMS": True, "HAS_RESIDUAL": False, "HAS_WEIGHT": True, "HAS_BIAS": False, "BLOCK": block}
    kernel = _norm._norm_forward_kernel

    def jit() -> None:
        kernel[(rows,)](*args, **meta, num_warps=warps)

    lines = [f"One launch of the norm forward kernel at {rows}x{width} (triton {triton.__version__}), microseconds:"]
    runs = {"Triton's JIT entry, kernel[grid](...)": jit, "torch.empty, for scale": lambda: torch.empty_like(x)}
    try:
        compiled = kernel[(rows,)](*args, **meta, num_warps=warps)
        from triton.runtime.driver import driver

        stream = driver.active.get_current_stream(driver.active.get_current_device())
        # Triton 3.3 and newer: the launcher takes every argument, constexprs included, in the kernel's order.
        every = (*args, *meta.values())

        def direct() -> None:
            compiled.run(rows, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *every)

        direct()
        runs["the compiled kernel's launcher, compiled.run(...)"] = direct
    except Exception as exc:  # noqa: BLE001 - another Triton's launcher: the JIT figure stands alone
        lines.append(f"- the compiled kernel's launcher could not be called: {type(exc).__name__}: {exc}")
    for name, fn in runs.items():
        best = math.inf
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        lines.append(f"- {name}: {best:.1f}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops",
        nargs="+",
        choices=(
            "layer_norm",
            "add_layer_norm",
            "rms_norm",
            "add_rms_norm",
            "rope",
            "bias_gelu",
            "swiglu",
            "cross_entropy",
            "linear_cross_entropy",
        ),
        help="only these ops (default: all)",
    )
    parser.add_argument("--quick", action="store_true", help="the LLM sizes only: a few minutes on one GPU")
    parser.add_argument("--csv", default="kernels.csv", help="where to write the results (default: kernels.csv)")
    parser.add_argument(
        "--host-cost",
        action="store_true",
        help="the Python cost per call at 16x768 with the launches skipped, against torch's op (runs on a CPU too)",
    )
    args = parser.parse_args()
    if args.host_cost:
        return host_cost_main(args.ops)

    if not torch.cuda.is_available():
        print("needs a CUDA GPU: the kernels run on CUDA (Triton's interpreter on a CPU is for tests, not timing).")
        return 0

    device_name = torch.cuda.get_device_name()
    copy_gbps = copy_bandwidth_gbps()
    cases = (
        norm_cases(QUICK_NORMS[1], QUICK_NORMS[0]) + norm_cases(VIT_NORMS[1], VIT_NORMS[0])
        + cross_entropy_cases(CROSS_ENTROPY_SHAPES[-1:])
        + linear_cross_entropy_cases(LINEAR_CROSS_ENTROPY_SHAPES[-1:])
        if args.quick
        else norm_cases(ROWS) + cross_entropy_cases() + linear_cross_entropy_cases()
    )  # fmt: skip
    cases = [case for case in cases if args.ops is None or case.op in args.ops]

    rows = []
    fields = ["device", "torch", "triton", "op", "shape", "dtype", "mode", "implementation", "ms", "gbps",
              "copy_gbps", "fraction_of_copy", "peak_mib", "error"]  # fmt: skip
    with open(args.csv, "w", newline="") as f:
        # Each row is written as soon as it is measured: a run cut short keeps everything before the cut.
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        f.flush()
        for case in cases:
            torch._dynamo.reset()
            for name, fn in case.implementations.items():
                for mode in case.modes:
                    print(f"{case.op} {case.shape} {name} {mode}", file=sys.stderr, flush=True)
                    error = ""
                    try:
                        with settings(case, name):
                            milliseconds, peak = measure(case, name, fn, mode)
                    except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' numbers
                        milliseconds, peak, error = math.nan, math.nan, f"{type(exc).__name__}: {exc}"
                        print(f"  failed: {error}", file=sys.stderr)
                    gbps = case.min_bytes[mode] / milliseconds / 1e6
                    row = {
                        "device": device_name,
                        "torch": torch.__version__,
                        "triton": _triton_version(),
                        "op": case.op,
                        "shape": case.shape,
                        "dtype": "bf16",
                        "mode": mode,
                        "implementation": name,
                        "ms": milliseconds,
                        "gbps": gbps,
                        "copy_gbps": copy_gbps,
                        "fraction_of_copy": gbps / copy_gbps,
                        "peak_mib": peak,
                        "error": error,
                    }
                    rows.append(row)
                    writer.writerow(row)
                    f.flush()
                    torch.cuda.empty_cache()

    header = [
        f"## fabriclite kernels on {device_name}",
        "",
        *describe(),
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}; copy bandwidth (x.clone()): {copy_gbps:.0f} GB/s",
        "- each cell: median time, minimum bytes moved / time, peak memory beyond the inputs",
    ]
    print(markdown(rows, header))
    print(f"\nwrote {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
