"""Issue 16's GPU measurements in one command: a ViT-B/16 fine-tuning step at each precision (images/s, MFU, peak
memory) and the seed talk's 3-epoch run estimated from it; the same step through raw PyTorch, Lightning Fabric and
Accelerate; fabriclite's Triton kernels against torch eager, torch.compile and Liger-Kernel (benchmarks/kernels.py's
cases); and the per-step overhead of a tiny, launch-bound model (benchmarks/overhead.py's loop) on CUDA.

Sections, each in its own process, one after the other, within a time budget (450 s; --quick: 270 s):

- ``vit``: examples/vit/model.py configured as ViT-B/16 (224x224, patches of 16, width 768, 12 layers of 12 heads,
  86M parameters, 10 classes; ``--model timm``: timm's vit_base_patch16_224, no weights downloaded), AdamW, batch 128
  (halved until it fits), synthetic CIFAR-10 images made on the GPU and resized to 224. Variants: fp32, bf16-mixed,
  bf16-mixed + kernels, bf16-mixed + compile, bf16-mixed + compile + kernels, fp8-mixed, fp8-mixed + compile
  (torchao, issue 46; last, so the bf16 rows keep their time). MFU divides the FLOPs ``ViTConfig.flops`` works
  out from the shapes (docs/throughput.md) by the step time and the device's dense peak
  (``get_available_flops``). The 3-epoch estimate: 3 x 50,000 training images and 10,000 evaluated at the
  steady-state rates, plus the first steps' compile time (the seed talk on 4 A100s: 18.5 min fp32, 6.4 min
  bf16-mixed, 2.2 min with DDP).
- ``compare`` (one process per precision: Accelerate keeps its mixed precision in a process-wide singleton): the ViT
  step as a user of raw PyTorch, fabriclite, Lightning Fabric and Accelerate writes it, in interleaved rounds
  (each round runs every variant, in a rotating order); then overhead.py's tiny model the same way, on the device.
- ``kernels``: the open goals first: RMS norm and layer norm at widths 4096 and 8192 with 16k rows and at 768 with
  25216 (the backward in tiles next to the row loop it replaced, and the GPU's kernel time besides the wall time),
  linear cross-entropy at 8192 x 4096 x 128256 (vocabulary chunks next to row chunks), then cross-entropy at
  8192 x 128256 and the residual-add norms (then RoPE, SwiGLU and bias + GELU, time allowing); forward and forward +
  backward; time, throughput against the measured copy bandwidth, peak memory. Liger-Kernel when installed.
- ``fp8`` (issue 46, in_model_fp8.py): the examples' Llama GPT at widths 2048 and 4096 (4 layers, 2048-token
  windows) in fp8-mixed against bf16-mixed, compiled then eager, interleaved: tokens/s, fp8's speed-up, the loss.
  fp8-mixed needs torchao on the machine (the rows say so otherwise).

Every row is written to its CSV in --out as soon as it is measured, naming the device and the torch, triton and
CUDA versions, so a run cut short keeps what it measured: vit.csv, frameworks.csv, overhead.csv, kernels.csv,
fp8.csv. The sections' output goes to suite.log; the tables and the issue's goals (met or missed) go to summary.md
and stdout.

``--smoke`` runs every section on the CPU (the GPU hidden) at tiny sizes, with the kernels under Triton's
interpreter and torch.compile's eager backend, in about a minute: it checks that the suite works. Its rows say
"smoke" and name the CPU; they are never GPU results.

Usage: ``python benchmarks/gpu_suite.py --out DIR [--quick | --smoke] [--sections vit compare kernels fp8]``.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from itertools import cycle
from pathlib import Path
from typing import Any, Callable

import overhead
import torch
import torch.nn.functional as F
from _machine import cpu_model, installed_version
from gpu_summary import summarize
from library_loops import FRAMEWORKS, ModelAndOptimizer, build, interleaved, timed

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the examples' models: vit.model, gpt.model
SECTIONS = ("models", "vit", "compare", "kernels", "fp8")
VIT_VARIANTS = (  # name, precision, compile, kernels
    ("fp32", "32-true", False, False),
    ("bf16-mixed", "bf16-mixed", False, False),
    ("bf16-mixed + kernels", "bf16-mixed", False, True),
    ("bf16-mixed + compile", "bf16-mixed", True, False),
    ("bf16-mixed + compile + kernels", "bf16-mixed", True, True),
    # Last, so the bf16 rows keep their time: torchao's float8 layers (emulated on the smoke run's CPU).
    ("fp8-mixed", "fp8-mixed", False, False),
    ("fp8-mixed + compile", "fp8-mixed", True, False),
)
VIT_B16 = {"image_size": 224, "patch_size": 16, "in_channels": 3, "dim": 768, "depth": 12, "heads": 12}
TINY_VIT = {"image_size": 32, "patch_size": 8, "in_channels": 3, "dim": 64, "depth": 2, "heads": 4}
CLASSES = 10
TRAIN_IMAGES, EPOCHS, EVAL_IMAGES = 50_000, 3, 10_000  # the seed talk's CIFAR-10 run
# The kernel goals concern these, the open ones first (the norm backward, linear cross-entropy's time); the
# other ops follow when time allows.
GOAL_OPS = ("rms_norm", "layer_norm", "linear_cross_entropy", "cross_entropy", "add_rms_norm", "add_layer_norm")
MORE_OPS = ("rope", "swiglu", "bias_gelu")

# The order the sections run in, and each one's share of the budget left when it starts.
PLAN = (
    ("models", None, 0.4),
    ("vit", None, 0.48),
    ("compare", "bf16-mixed", 0.1),
    ("compare", "32-true", 0.16),
    ("kernels", None, 0.26),
    ("fp8", None, 0.3),  # issue 46: fp8-mixed against bf16-mixed in the GPT (in_model_fp8.py)
)
BUDGET_S = {"full": 450, "quick": 270, "smoke": 240}
GRACE_S = 15  # past its share a section is killed; it stops starting new measurements this long before


@dataclass(frozen=True)
class Sizes:
    vit: dict[str, int]
    batch: int
    warmup: int  # untimed steps after the first
    segments: int  # timed segments of a ViT variant; its step time is their median
    segment_steps: int
    rounds: int  # interleaved rounds of the framework comparison, at most
    round_steps: int
    overhead_rounds: int
    overhead_steps: int


SIZES = {
    "full": Sizes(VIT_B16, batch=128, warmup=5, segments=5, segment_steps=6, rounds=8, round_steps=4,
                  overhead_rounds=30, overhead_steps=256),
    "quick": Sizes(VIT_B16, batch=128, warmup=3, segments=3, segment_steps=4, rounds=4, round_steps=3,
                   overhead_rounds=10, overhead_steps=128),
    "smoke": Sizes(TINY_VIT, batch=2, warmup=1, segments=2, segment_steps=2, rounds=2, round_steps=2,
                   overhead_rounds=2, overhead_steps=8),
}  # fmt: skip
# The CSVs each section writes (a run of some sections leaves the others' CSVs in the folder as they were).
WRITES = {
    "models": ("models",),
    "vit": ("vit",),
    "compare": ("frameworks", "overhead"),
    "kernels": ("kernels",),
    "fp8": ("fp8",),
}

# ---------------------------------------------------------------------- the CSVs
COMMON = "run device torch triton cuda time".split()
COMPARISON = (
    "workload precision variant rounds steps_per_round ms_per_step samples_per_s ratio_vs_raw ratio_p25 ratio_p75 "
    "best_round_ratio float32_matmul_precision error"
).split()
FIELDS = {
    "models": (
        "model width variant compiled kernels rounds steps_per_round step_ms samples_per_s samples ratio_vs_off "
        "best_ratio_vs_off first_step_s peak_mib swapped_norms graph_breaks error"
    ).split(),
    "vit": (
        "variant model precision compile kernels batch params_m step_ms images_per_s tflop_per_step achieved_tflops "
        "peak_tflops mfu peak_mib first_step_s compile_s eval_images_per_s eval_compile_s three_epochs_s fused_norms "
        "graphs graph_breaks float32_matmul_precision error"
    ).split(),
    "frameworks": COMPARISON,
    "overhead": COMPARISON,
    "kernels": "op shape dtype mode implementation ms gbps copy_gbps fraction_of_copy peak_mib error".split(),
    "fp8": (
        "model width variant precision compiled rounds steps_per_round step_ms tokens_per_s speedup_vs_bf16 "
        "first_step_s peak_mib loss graph_breaks error"
    ).split(),
}


def machine(run: str) -> dict[str, str]:
    """What every row names: the run, the device, the versions."""
    on_gpu = torch.cuda.is_available()
    return {
        "run": run,
        "device": torch.cuda.get_device_name() if on_gpu else f"CPU: {cpu_model()}",
        "torch": torch.__version__,
        "triton": installed_version("triton") or "",
        "cuda": torch.version.cuda or "",
    }


class Table:
    """One CSV of the output folder, appended to row by row and flushed after each row. Usage:
    ``Table(out, "vit", "full").write(variant="fp32", ...)``."""

    def __init__(self, out: Path, name: str, run: str) -> None:
        self.path = out / f"{name}.csv"
        self.fields = COMMON + FIELDS[name]
        self.machine = machine(run)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, self.fields)
        if new:
            self.writer.writeheader()
            self.file.flush()

    def write(self, **values: Any) -> None:
        row = {**self.machine, "time": datetime.now().isoformat(timespec="seconds"), **values}
        self.writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})
        self.file.flush()
        print(self.path.name, {k: v for k, v in values.items() if v not in ("", None)}, flush=True)


class Clock:
    """A section's soft deadline: it starts no new measurement after it (the parent kills it a little later)."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline

    def out(self) -> bool:
        return time.time() >= self.deadline


# ---------------------------------------------------------------------- timing
def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else math.nan


def release(device: torch.device) -> None:
    """Free what the last variant left: its compiled graphs, its memory."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------- the ViT step
def make_vit(model: str, sizes: Sizes) -> torch.nn.Module:
    """ViT-B/16 (or the smoke run's tiny ViT) with 10 classes, freshly initialised: examples/vit/model.py's, or
    timm's vit_base_patch16_224 without pretrained weights."""
    if model == "timm":
        import timm

        return timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=CLASSES)
    from vit.model import ViT, ViTConfig

    return ViT(ViTConfig(**sizes.vit, num_classes=CLASSES))


def synthetic_batches(sizes: Sizes, batch: int, device: torch.device, count: int = 4) -> list[tuple[torch.Tensor, ...]]:
    """``count`` batches of CIFAR-10-sized random images made on ``device``, resized to the model's input size and
    normalised as the talk's pipeline does, with random labels (nothing can be downloaded on the GPU machine)."""
    generator = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(count):
        images = torch.rand(batch, 3, 32, 32, generator=generator, device=device)
        images = F.interpolate(images, size=sizes.vit["image_size"], mode="bilinear", align_corners=False)
        labels = torch.randint(0, CLASSES, (batch,), generator=generator, device=device)
        batches.append(((images - 0.5) / 0.25, labels))
    return batches


def vit_flops(model: str, sizes: Sizes, batch: int) -> int:
    """FLOPs of one training step (forward and backward) of ``batch`` images, worked out from the shapes by
    ``ViTConfig.flops`` (the count every MFU of the project uses; timm's vit_base_patch16_224 is ViT-B/16)."""
    from vit.model import ViTConfig

    shapes = VIT_B16 if model == "timm" else sizes.vit
    return batch * ViTConfig(**shapes, num_classes=CLASSES).flops()


def train_vit(
    model_name: str, sizes: Sizes, precision: str, compile: Any, kernels: bool, batch: int, device: torch.device
) -> dict[str, Any]:
    """One fabriclite variant: first step (compiling), warm-up, timed segments, then evaluation the same way."""
    from fabriclite import Fabric

    fabric = Fabric(accelerator=device.type, devices=1, precision=precision, compile=compile, kernels=kernels)
    torch.manual_seed(0)
    model = make_vit(model_name, sizes)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)
    fused_norms = sum(type(m).__module__.startswith("fabriclite.kernels") for m in model.modules())
    batches = cycle(synthetic_batches(sizes, batch, fabric.device))

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()

    def evaluate(images: torch.Tensor, labels: torch.Tensor) -> None:
        model(images)

    reset_peak(device)
    first = timed(step, batches, 1, device)
    timed(step, batches, sizes.warmup, device)
    step_s = statistics.median(timed(step, batches, sizes.segment_steps, device) for _ in range(sizes.segments))
    memory = peak_mib(device)
    model.eval()
    with torch.no_grad():
        eval_first = timed(evaluate, batches, 1, device)
        timed(evaluate, batches, sizes.warmup, device)
        eval_s = statistics.median(timed(evaluate, batches, sizes.segment_steps, device) for _ in range(sizes.segments))
    report = fabric.compile_report()
    return {
        "params_m": params / 1e6,
        "step_s": step_s,
        "first_step_s": first,
        "compile_s": max(0.0, first - step_s),
        "eval_s": eval_s,
        "eval_compile_s": max(0.0, eval_first - eval_s),
        "peak_mib": memory,
        "fused_norms": fused_norms,
        "graphs": report[0]["graphs"] if report else "",
        "graph_breaks": report[0]["graph_breaks"] if report else "",
    }


def vit_section(out: Path, run: str, model_name: str, clock: Clock) -> None:
    from fabriclite.utilities.throughput import get_available_flops

    table, sizes, device = Table(out, "vit", run), SIZES[run], default_device()
    flops: dict[int, int | None] = {}
    for name, precision, compiled, kernels in VIT_VARIANTS:
        # On the GPU, TorchInductor; the smoke run's CPU would spend minutes building C++, so dynamo alone there.
        compile_arg: Any = {"backend": "eager"} if compiled and run == "smoke" else compiled
        row = {"variant": name, "model": model_name, "precision": precision, "compile": compiled, "kernels": kernels,
               "float32_matmul_precision": torch.get_float32_matmul_precision()}  # fmt: skip
        if clock.out():
            table.write(**row, error="skipped: out of time")
            continue
        batch, result, error = sizes.batch, None, ""
        while result is None and not error:
            out_of_memory = False
            try:
                result = train_vit(model_name, sizes, precision, compile_arg, kernels, batch, device)
            except torch.cuda.OutOfMemoryError:
                out_of_memory = True  # retried below, once the exception (and the model it holds) is gone
            except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
                error = f"{type(exc).__name__}: {exc}"
            release(device)
            if out_of_memory:
                print(f"{name}: out of memory at batch {batch}", flush=True)
                batch //= 2
                error = "" if batch >= 8 else "out of memory at batch 8"
        if result is None:
            table.write(**row, batch=batch, error=error)
            continue
        if batch not in flops:
            try:
                flops[batch] = vit_flops(model_name, sizes, batch)
            except Exception as exc:  # noqa: BLE001 - the rates stand without the MFU
                print(f"no FLOP count, so no MFU: {type(exc).__name__}: {exc}", flush=True)
                flops[batch] = None
        # fp8 against the bf16 peak: its MFU then compares with the bf16 rows' as a rate of the same work.
        half = "bf16" in precision or precision == "fp8-mixed"
        peak = get_available_flops(device, torch.bfloat16 if half else torch.float32)
        table.write(**row, **rates(result, batch, flops[batch], peak))


def rates(result: dict[str, Any], batch: int, flops: int | None, peak: float | None) -> dict[str, Any]:
    """A variant's row from its timings: images/s, MFU against the device's dense peak FLOP/s, and the seed talk's run
    (3 epochs of 50,000 images and an evaluation of 10,000 at the steady rates, plus the compile time)."""
    images_per_s, eval_images_per_s = batch / result["step_s"], batch / result["eval_s"]
    achieved = flops / result["step_s"] if flops else None
    three_epochs = EPOCHS * TRAIN_IMAGES / images_per_s + EVAL_IMAGES / eval_images_per_s
    keep = ("params_m", "peak_mib", "first_step_s", "compile_s", "eval_compile_s", "fused_norms", "graphs",
            "graph_breaks")  # fmt: skip
    return {
        **{key: result[key] for key in keep},
        "batch": batch,
        "step_ms": 1e3 * result["step_s"],
        "images_per_s": images_per_s,
        "eval_images_per_s": eval_images_per_s,
        "tflop_per_step": flops / 1e12 if flops else "",
        "achieved_tflops": achieved / 1e12 if achieved else "",
        "peak_tflops": peak / 1e12 if peak else "",
        "mfu": achieved / peak if achieved and peak else "",
        "three_epochs_s": three_epochs + result["compile_s"] + result["eval_compile_s"],
        "error": "",
    }


# ---------------------------------------------------------------------- raw, fabriclite, Lightning Fabric, Accelerate
@dataclass
class Workload:
    """What the libraries are compared on: a model with its optimizer, and its batches: a fresh loader that each
    library's wrapper takes (``through_loader``), or a list of batches already on the device."""

    name: str
    make: ModelAndOptimizer
    batches: Callable[[], Iterable]
    samples: int  # per batch
    through_loader: bool


def compare(table: Table, workload: Workload, precision: str, rounds: int, steps: int, clock: Clock) -> None:
    """Build every variant that imports, time them interleaved, and write a row for each (an error row for a variant
    that fails to build). A variant's ratio to raw is the median of its per-round ratios (overhead.py's measure)."""
    device = default_device()
    runners = {}
    for name in FRAMEWORKS:
        try:
            loader, step = build(name, precision, device, workload.make,
                                 workload.batches() if workload.through_loader else None)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - Lightning or Accelerate missing or failing must not stop the rest
            table.write(workload=workload.name, precision=precision, variant=name, error=f"{type(exc).__name__}: {exc}")
            continue
        runners[name] = (overhead.forever(loader) if workload.through_loader else cycle(workload.batches()), step)
    if not runners:
        return
    timings = interleaved(runners, rounds, steps, max(1, steps // 4), device, clock.out)
    for name, per_round in timings.items():
        ratios = overhead.ratios_to_raw(timings, name) if "raw" in timings else [math.nan]
        low, _, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        best = min(per_round) / min(timings["raw"]) if "raw" in timings else math.nan
        median = statistics.median(per_round)
        table.write(workload=workload.name, precision=precision, variant=name, rounds=len(per_round),
                    steps_per_round=steps, ms_per_step=median, samples_per_s=1e3 * workload.samples / median,
                    ratio_vs_raw=statistics.median(ratios), ratio_p25=low, ratio_p75=high, best_round_ratio=best,
                    float32_matmul_precision=torch.get_float32_matmul_precision(), error="")  # fmt: skip


def compare_section(out: Path, run: str, model_name: str, precision: str, clock: Clock) -> None:
    sizes, device = SIZES[run], default_device()
    vit_batches = synthetic_batches(sizes, sizes.batch, device)

    def make_vit_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)  # the same initial weights in every variant
        model = make_vit(model_name, sizes)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    vit_name = f"{'ViT-B/16' if sizes.vit == VIT_B16 else 'tiny ViT'} ({model_name}), batch {sizes.batch}"
    vit = Workload(vit_name, make_vit_and_adamw, lambda: vit_batches, sizes.batch, through_loader=False)
    compare(Table(out, "frameworks", run), vit, precision, sizes.rounds, sizes.round_steps, clock)
    release(device)
    # overhead.py's tiny model, its loader passed through each library's wrapper, now on the device.
    tiny = Workload(f"overhead.py's tiny model, batch {overhead.BATCH_SIZE}", overhead.make_model_and_optimizer,
                    overhead.make_loader, overhead.BATCH_SIZE, through_loader=True)  # fmt: skip
    compare(Table(out, "overhead", run), tiny, precision, sizes.overhead_rounds, sizes.overhead_steps, clock)


# ---------------------------------------------------------------------- kernels
def measure_on_cpu(bench: Any, case: Any, fn: Callable[..., Any], mode: str, repeats: int = 3) -> tuple[float, float]:
    """(median ms, no peak memory) of one implementation in one mode, for the smoke run: kernels.py's measure()
    times with CUDA events and reads CUDA's allocator, which a CPU has not (the GPU-time mode is wall time here)."""
    inputs = case.make_inputs()
    leaves = [t for t in inputs.values() if t.requires_grad]
    outputs = bench._outputs(fn(**inputs))
    grads = [torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out) for out in outputs]

    def thunk() -> None:
        result = bench._outputs(fn(**inputs))
        if mode != "forward":
            torch.autograd.backward(result, grads)

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        thunk()
        times.append(time.perf_counter() - start)
        for leaf in leaves:
            leaf.grad = None
    return 1e3 * statistics.median(times), math.nan


def cpu_copy_gbps() -> float:
    """GB/s of ``x.clone()`` on 32 MiB (one read, one write), the best of five: the smoke run's copy bandwidth."""
    x = torch.empty(2**24, dtype=torch.bfloat16)
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        x.clone()
        seconds.append(time.perf_counter() - start)
    return 2 * x.numel() * x.element_size() / min(seconds) / 1e9


def kernels_section(out: Path, run: str, clock: Clock) -> None:
    # benchmarks/kernels.py (this script's folder comes first on sys.path, before the repository's kernels/).
    import kernels as bench

    table, device = Table(out, "kernels", run), default_device()
    on_gpu = device.type == "cuda"
    if on_gpu:
        cases = (
            bench.cross_entropy_cases(bench.CROSS_ENTROPY_SHAPES[-1:])
            + bench.linear_cross_entropy_cases(bench.LINEAR_CROSS_ENTROPY_SHAPES[-1:])
            + bench.norm_cases(bench.QUICK_NORMS[1], bench.QUICK_NORMS[0])
            + bench.norm_cases(bench.VIT_NORMS[1], bench.VIT_NORMS[0])
        )
        copy_gbps = bench.copy_bandwidth_gbps()
    else:  # the same cases at tiny sizes on CPU tensors, the kernels under Triton's interpreter
        bench.DEVICE = "cpu"
        cases = (
            bench.cross_entropy_cases(((8, 100),))
            + bench.linear_cross_entropy_cases(((8, 16, 50),))
            + bench.norm_cases((4,), (64,))
        )
        copy_gbps = cpu_copy_gbps()
    ops = GOAL_OPS + (MORE_OPS if run == "full" else ())
    cases = sorted((case for case in cases if case.op in ops), key=lambda case: ops.index(case.op))
    for case in cases:
        torch._dynamo.reset()
        if not on_gpu:  # dynamo alone: TorchInductor would build C++ for minutes
            case.implementations["torch.compile"] = torch.compile(case.implementations["torch"], backend="eager")
        for name, fn in case.implementations.items():
            for mode in case.modes:
                row = {"op": case.op, "shape": case.shape, "dtype": "bf16", "mode": mode, "implementation": name}
                if clock.out():
                    table.write(**row, error="skipped: out of time")
                    continue
                print(f"{case.op} {case.shape} {name} {mode}", flush=True)
                try:
                    with bench.settings(case, name):
                        if on_gpu:
                            ms, peak = bench.measure(case, name, fn, mode)
                        else:
                            ms, peak = measure_on_cpu(bench, case, fn, mode)
                    error = ""
                except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
                    ms, peak, error = math.nan, math.nan, f"{type(exc).__name__}: {exc}"
                gbps = case.min_bytes[mode] / ms / 1e6
                table.write(**row, ms=ms, gbps=gbps, copy_gbps=copy_gbps, fraction_of_copy=gbps / copy_gbps,
                            peak_mib=peak, error=error)  # fmt: skip
                if on_gpu:
                    torch.cuda.empty_cache()


# ---------------------------------------------------------------------- running the sections
def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_section(args: argparse.Namespace) -> int:
    """Inside a section's own process."""
    out, clock = Path(args.out), Clock(args.deadline)
    if args.section == "models":
        from in_model import run_models

        run_models(Table(out, "models", args.run).write, args.run, clock.out)
    elif args.section == "vit":
        vit_section(out, args.run, args.model, clock)
    elif args.section == "compare":
        compare_section(out, args.run, args.model, args.precision, clock)
    elif args.section == "fp8":
        from in_model_fp8 import run_fp8

        run_fp8(Table(out, "fp8", args.run).write, args.run, clock.out)
    else:
        kernels_section(out, args.run, clock)
    return 0


def run_suite(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for section in args.sections:
        for name in WRITES[section]:
            (out / f"{name}.csv").unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.run == "smoke":  # the CPU, even on a GPU machine: the kernels under Triton's interpreter
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:  # the kernels compiled for the GPU, whatever the shell had set
        env.pop("TRITON_INTERPRET", None)
    budget = args.budget or BUDGET_S[args.run]
    plan = [(section, precision, share) for section, precision, share in PLAN if section in args.sections]
    start = time.time()
    notes = []
    with open(out / "suite.log", "w") as log:
        for index, (section, precision, share) in enumerate(plan):
            left = start + budget - time.time()
            allowance = left * share / sum(s for _, _, s in plan[index:])
            label = f"{section} {precision or ''}".strip()
            if allowance < 2 * GRACE_S:
                notes.append(f"{label}: not run, its share of the budget ({allowance:.0f} s) is too short")
                continue
            options = {"section": section, "precision": precision, "out": out, "run": args.run, "model": args.model,
                       "deadline": time.time() + allowance - GRACE_S}  # fmt: skip
            command = [sys.executable, __file__]
            command += [
                part for key, value in options.items() if value is not None for part in (f"--{key}", str(value))
            ]
            log.write(f"\n===== {label}: up to {allowance:.0f} s =====\n")
            log.flush()
            began = time.time()
            # A process group of its own: stopping it also stops the compile workers it started.
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                code = child.wait(timeout=allowance)
                status = "done" if code == 0 else f"FAILED (exit {code}; see suite.log)"
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                status = "stopped at its time limit (its rows so far are kept)"
            notes.append(f"{label}: {status} in {time.time() - began:.0f} s")
            print(notes[-1], flush=True)
    notes.append(f"total: {time.time() - start:.0f} s of a {budget} s budget")
    summary = summarize(out, tuple(notes))
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0 if all("done" in note for note in notes[:-1]) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the CSVs, suite.log and summary.md")
    speed = parser.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="fewer steps and rounds, the goal kernels only: ~4.5 min")
    speed.add_argument("--smoke", action="store_true", help="every section on the CPU at tiny sizes: checks the suite")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="default: all")
    parser.add_argument("--model", choices=("examples", "timm"), default="examples",
                        help="examples/vit/model.py's ViT (default) or timm's vit_base_patch16_224")  # fmt: skip
    parser.add_argument("--budget", type=float, help="seconds for the whole suite (default: 450, --quick 270)")
    # Set by the suite for a section's own process.
    parser.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)
    parser.add_argument("--run", choices=tuple(SIZES), help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        return run_section(args)
    args.run = "smoke" if args.smoke else "quick" if args.quick else "full"
    if args.run != "smoke" and not torch.cuda.is_available():
        print("gpu_suite.py measures a CUDA GPU and there is none here; --smoke checks the suite on the CPU.")
        return 2
    return run_suite(args)


if __name__ == "__main__":
    sys.exit(main())
