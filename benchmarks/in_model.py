"""fabriclite's kernels inside a model, the measurement ``Fabric(kernels=True)``'s swap rule rests on
(``MEASURED_WINS`` in kernels/swap.py): a kernel goes into the table for a GPU only where a training step with it
was faster than without on that GPU.

Two models, each trained through ``Fabric`` in bf16-mixed with AdamW on synthetic batches made on the device:
- ``vit``: examples/vit's ViT-B/16 (224x224, batch 128); its one swappable kernel is ``layer_norm``.
- ``gpt``: examples/gpt's Llama-style GPT (RMSNorm, RoPE, SwiGLU; 12 layers of width 1536, 12 heads, 2048-token
  windows, 4 per batch, a 32768-token vocabulary: 389M parameters); its kernels are ``rms_norm`` (swapped in as
  ``Fabric(kernels=True)`` does), ``rope``, ``swiglu`` and ``linear_cross_entropy`` (the model calls them).

Variants, per model: eager with the kernels off, all on, and each alone (when the model has more than one); then
compiled (``compile=True``, regional) with the kernels off and all on. Each variant has its own model and optimizer,
from the same seed. The eager variants run interleaved (every round runs each for a few steps, in a rotating order,
so a slow spell of the machine hits them all alike), then the compiled ones the same way. A row per variant: the
median step time over the rounds, images or tokens per second, the ratio to the same mode with the kernels off
(below 1: the kernels made the step faster), and the peak memory while it ran. Every model's weights and optimizer
states stay on the device for the whole comparison, so the peak includes the other variants' states: compare the
peaks of one model's variants with each other, not with a run of one model alone.

Usage (from gpu_suite.py's ``models`` section): ``run_models(table, "full", clock)``.
"""

from __future__ import annotations

import gc
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from library_loops import synchronize, timed

ROOT = Path(__file__).resolve().parents[1]

# What each model can run on fabriclite's kernels. The norms are swapped in (kernels/swap.py); the GPT calls the
# others through its ``ops``.
MODEL_KERNELS = {"vit": ("layer_norm",), "gpt": ("rms_norm", "rope", "swiglu", "linear_cross_entropy")}
SWAPPED = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class Variant:
    name: str
    compiled: bool
    kernels: tuple[str, ...]
    precision: str = "bf16-mixed"  # in_model_fp8.py's rows set "fp8-mixed"


@dataclass(frozen=True)
class ModelSizes:
    vit: dict[str, int]
    vit_batch: int
    gpt: dict[str, int]
    gpt_batch: int
    warmup: int  # untimed steps of each variant before its timed steps, in each round
    steps: int  # timed steps of each variant in each round
    rounds: int  # at most; fewer when the section's time runs out (two at least)


MODEL_SIZES = {
    "full": ModelSizes(
        vit={"image_size": 224, "patch_size": 16, "in_channels": 3, "dim": 768, "depth": 12, "heads": 12},
        vit_batch=128,
        gpt={"block_size": 2048, "vocab_size": 32768, "n_layer": 12, "n_head": 12, "n_embd": 1536},
        gpt_batch=4,
        warmup=2,
        steps=5,
        rounds=5,
    ),
    "smoke": ModelSizes(
        vit={"image_size": 32, "patch_size": 8, "in_channels": 3, "dim": 64, "depth": 2, "heads": 4},
        vit_batch=2,
        gpt={"block_size": 16, "vocab_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 32},
        gpt_batch=2,
        warmup=0,
        steps=1,
        rounds=2,
    ),
}
MODEL_SIZES["quick"] = replace(MODEL_SIZES["full"], steps=3, rounds=3)
# tools/cuda_codegen.py's (Inductor's CUDA code generation on a CPU): the smoke sizes with the smallest GPT that
# showed the H200's "KeyError: 'op24'" (2 layers, 2048-token windows: the norm backward's program count symbolic).
MODEL_SIZES["small"] = replace(
    MODEL_SIZES["smoke"], gpt={"block_size": 2048, "vocab_size": 256, "n_layer": 2, "n_head": 2, "n_embd": 128}
)


def variants(model: str) -> list[Variant]:
    """Eager: off, all on, each alone (when there are several); compiled: off, all on."""
    kernels = MODEL_KERNELS[model]
    eager = [Variant("eager", False, ()), Variant("eager + all kernels", False, kernels)]
    if len(kernels) > 1:
        eager += [Variant(f"eager + {op}", False, (op,)) for op in kernels]
    return eager + [Variant("compiled", True, ()), Variant("compiled + all kernels", True, kernels)]


# ---------------------------------------------------------------------- the models
def _examples_on_path() -> None:
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))


def build_vit(sizes: ModelSizes, device: torch.device) -> tuple[torch.nn.Module, Callable[..., torch.Tensor], list]:
    """(model, loss of a batch, batches): ViT-B/16 with 10 classes on CIFAR-10-sized images resized to 224."""
    _examples_on_path()
    from vit.model import ViT, ViTConfig

    with torch.device(device):
        model = ViT(ViTConfig(**sizes.vit, num_classes=10))
    generator = torch.Generator(device=device).manual_seed(0)
    batches = []
    for _ in range(2):
        images = torch.rand(sizes.vit_batch, 3, 32, 32, generator=generator, device=device)
        images = F.interpolate(images, size=sizes.vit["image_size"], mode="bilinear", align_corners=False)
        labels = torch.randint(0, 10, (sizes.vit_batch,), generator=generator, device=device)
        batches.append(((images - 0.5) / 0.25, labels))

    def loss(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(images), labels)

    return model, loss, batches


def build_gpt(
    sizes: ModelSizes, device: torch.device, kernels: tuple[str, ...]
) -> tuple[torch.nn.Module, Callable[..., torch.Tensor], list]:
    """(model, loss of a batch, batches): the Llama-style GPT calling fabriclite's rope, swiglu and
    linear_cross_entropy where ``kernels`` names them, torch's ops otherwise."""
    _examples_on_path()
    from gpt.model import GPT, GPTConfig, Ops

    from fabriclite import kernels as fused

    with torch.device(device):
        model = GPT(GPTConfig(**sizes.gpt, llama=True))
    ops = Ops(False)
    for op in ("rope", "swiglu", "linear_cross_entropy"):
        if op in kernels:
            setattr(ops, op, getattr(fused, op))
    model.ops = ops
    generator = torch.Generator(device=device).manual_seed(0)
    shape = (sizes.gpt_batch, sizes.gpt["block_size"])
    vocab = sizes.gpt["vocab_size"]
    batches = [
        (
            torch.randint(0, vocab, shape, generator=generator, device=device),
            torch.randint(0, vocab, shape, generator=generator, device=device),
        )
        for _ in range(2)
    ]

    def loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model(idx, targets)

    return model, loss, batches


@dataclass
class Runner:
    """One variant, set up and ready: a training step on its own model and optimizer, and its batches."""

    variant: Variant
    step: Callable[[torch.Tensor, torch.Tensor], None]
    batches: Any  # an endless iterator
    samples: int  # images or tokens per step
    swapped: int  # norm modules swapped in
    graph_breaks: Callable[[], Any]
    last_loss: Callable[[], float]


def set_up(
    model_name: str, variant: Variant, run: str, device: torch.device, sizes: ModelSizes | None = None
) -> Runner:
    """The variant's model through ``Fabric`` (in its precision, compiled or not), its norms swapped for the fused
    ones where the variant names them (as ``Fabric(kernels=True)`` does where the swap rule allows); ``sizes``: the
    run's ``MODEL_SIZES`` unless given."""
    from itertools import cycle

    from fabriclite import Fabric
    from fabriclite.kernels.swap import swap_modules

    sizes = sizes or MODEL_SIZES[run]
    # On the GPU TorchInductor; the smoke run's CPU would spend minutes building C++, so Dynamo alone there.
    compile_arg: Any = False
    if variant.compiled:
        compile_arg = {"backend": "eager"} if run == "smoke" else True
    fabric = Fabric(accelerator=device.type, devices=1, precision=variant.precision, compile=compile_arg)
    torch.manual_seed(0)
    if model_name == "vit":
        model, loss_of, batches = build_vit(sizes, fabric.device)
        samples = sizes.vit_batch
    else:
        model, loss_of, batches = build_gpt(sizes, fabric.device, variant.kernels)
        samples = sizes.gpt_batch * sizes.gpt["block_size"]
    swapped = swap_modules(model, tuple(op for op in variant.kernels if op in SWAPPED))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fabric.setup(model, optimizer)

    losses: list[torch.Tensor] = []

    def step(*batch: torch.Tensor) -> None:
        loss = loss_of(model, *batch)
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)
        optimizer.step()
        losses[:] = [loss.detach()]  # read once at the end: no synchronisation in the timed steps

    def graph_breaks() -> Any:
        report = fabric.compile_report()
        return report[0]["graph_breaks"] if report else ""

    return Runner(variant, step, cycle(batches), samples, swapped, graph_breaks, lambda: losses[0].item())


def _peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def compare(
    runners: list[Runner],
    sizes: ModelSizes,
    device: torch.device,
    out_of_time: Callable[[], bool],
    errors: dict[str, str],
) -> dict[str, dict[str, Any]]:
    """Each runner's step times (ms) over interleaved rounds and its peak memory (MiB). A runner whose first steps
    raise (a compile that fails) is taken out of ``runners`` with its error in ``errors``; the others go on."""
    results: dict[str, dict[str, Any]] = {r.variant.name: {"ms": [], "peak_mib": 0.0, "first_s": 0.0} for r in runners}
    for runner in list(runners):  # the first step compiles (or builds the kernels): timed apart, never in a round
        try:
            results[runner.variant.name]["first_s"] = timed(runner.step, runner.batches, 1, device)
            timed(runner.step, runner.batches, sizes.warmup, device)
        except Exception as exc:  # noqa: BLE001 - its own row says why; the other variants still measure
            errors[runner.variant.name] = f"{type(exc).__name__}: {exc}"
            runners.remove(runner)
    gc.collect()
    for round_index in range(sizes.rounds):
        if round_index >= 2 and out_of_time():
            break
        shift = round_index % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            timed(runner.step, runner.batches, sizes.warmup, device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            result = results[runner.variant.name]
            result["ms"].append(1e3 * timed(runner.step, runner.batches, sizes.steps, device))
            result["peak_mib"] = max(result["peak_mib"], _peak_mib(device))
    synchronize(device)
    return results


def measure_group(
    model_name: str,
    group: list[Variant],
    run: str,
    device: torch.device,
    sizes: ModelSizes,
    out_of_time: Callable[[], bool],
) -> tuple[list[Runner], dict[str, dict[str, Any]], dict[str, str]]:
    """Set up every variant of ``group`` and time them in interleaved rounds: (the runners that measured, their
    results as ``compare`` gives them, the error of each variant that failed, by name).

    Usage: ``runners, results, errors = measure_group("gpt", group, "full", device, sizes, clock.out)``.
    """
    runners, errors = [], {}
    for variant in group:
        try:
            runners.append(set_up(model_name, variant, run, device, sizes))
        except Exception as exc:  # noqa: BLE001 - one failing variant must not lose the others' rows
            errors[variant.name] = f"{type(exc).__name__}: {exc}"
    try:
        results = compare(runners, sizes, device, out_of_time, errors) if runners else {}
    except Exception as exc:  # noqa: BLE001 - a failure within the rounds: no variant's times are whole
        results = {}
        errors.update({r.variant.name: f"{type(exc).__name__}: {exc}" for r in runners})
    return runners, results, errors


def run_models(write: Callable[..., None], run: str, out_of_time: Callable[[], bool], models=("vit", "gpt")) -> None:
    """Measure every model's eager variants together, then every model's compiled ones, writing a row per variant
    through ``write(**row)`` (gpu_suite.py's Table)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sizes = MODEL_SIZES[run]
    for compiled in (False, True):  # the eager rows first: they decide the swaps
        for model_name in models:
            group = [v for v in variants(model_name) if v.compiled == compiled]
            base = {"model": model_name, "width": _width(model_name, sizes)}
            if out_of_time():
                for variant in group:
                    write(**base, variant=variant.name, compiled=compiled, kernels=" ".join(variant.kernels),
                          error="skipped: out of time")  # fmt: skip
                continue
            runners, results, errors = measure_group(model_name, group, run, device, sizes, out_of_time)
            baseline = results.get("compiled" if compiled else "eager")
            base_ms = statistics.median(baseline["ms"]) if baseline and baseline["ms"] else float("nan")
            for runner in runners:
                name = runner.variant.name
                if name in errors:
                    continue
                ms = statistics.median(results[name]["ms"])
                # The ratio to the baseline round by round (both ran back to back in each round), then the median.
                per_round = [m / b for m, b in zip(results[name]["ms"], baseline["ms"])] if baseline else []
                write(**base, variant=name, compiled=compiled, kernels=" ".join(runner.variant.kernels),
                      rounds=len(results[name]["ms"]), steps_per_round=sizes.steps, step_ms=ms,
                      samples_per_s=1e3 * runner.samples / ms, samples="images" if model_name == "vit" else "tokens",
                      ratio_vs_off=statistics.median(per_round) if per_round else ms / base_ms,
                      best_ratio_vs_off=min(results[name]["ms"]) / min(baseline["ms"]) if baseline else "",
                      first_step_s=results[name]["first_s"], peak_mib=results[name]["peak_mib"],
                      swapped_norms=runner.swapped, graph_breaks=runner.graph_breaks(), error="")  # fmt: skip
            for name, error in errors.items():
                variant = next(v for v in group if v.name == name)
                write(**base, variant=name, compiled=compiled, kernels=" ".join(variant.kernels), error=error)
            del runners, results
            torch._dynamo.reset()
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def _width(model_name: str, sizes: ModelSizes) -> int:
    return sizes.vit["dim"] if model_name == "vit" else sizes.gpt["n_embd"]
