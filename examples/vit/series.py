"""What the numbered scripts 00-09 share, so that each of them reads as nothing but its training program.

- ``parse_args``: the options every script takes (``--devices``, ``--epochs``, ...).
- ``pick_devices``: how many devices a script uses when ``--devices`` is not given (the GPUs there are).
- ``one_device``: the device of the plain PyTorch scripts, which run one process.
- ``loop_flops``: the model FLOPs of a script's timed loop, for the MFU that ``results`` prints.
- ``process_seconds``: seconds since this process started, imports included (the talk's end-to-end clock).
- ``results``: the lines each script ends with: time, MFU, peak memory, test accuracy, and one machine-readable
  ``RESULT {...}`` line that run_all.py collects into results.md.

The scripts repeat their loop and their evaluate() on purpose: each is a whole program to read top to bottom,
and the diff between two neighbours is the step they demonstrate (tests/examples/test_vit_series.py).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from fabriclite.utilities.throughput import get_available_flops
from vit.model import SERIES_CONFIG, ViTConfig
from vit.pretrain import SERIES_WEIGHTS

# The scripts fine-tune on 20 labelled images per class (200 in all), the case pretraining on unlabelled
# images is for: after 10 epochs, seeds 0 and 1 reached 89.2% and 90.8% test accuracy from the pretrained
# weights, 73.9% and 72.8% from random ones. With all 1257 labels both reach about 97% on these easy digits,
# and the pretraining's head start is gone after a few epochs. `--labels 0` uses every label.
EPOCHS = 10
LABELS_PER_CLASS = 20
BATCH_SIZE = 64
# Constant for scripts 00-06 and 08-09; 07's schedule peaks at 5x this after a warmup.
LEARNING_RATE = 2e-4
CHECKPOINT = Path(__file__).resolve().parent / "checkpoints" / "vit_08.ckpt"


def parse_args(doc: str, devices: int = 1, checkpoint: bool = False) -> argparse.Namespace:
    """The options of a numbered script; ``checkpoint`` adds the two of the 08 scripts.

    Usage: ``args = parse_args(__doc__, devices=2)``.
    """
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--devices", type=int, help=f"processes (CPU) or GPUs (default {devices}, or the GPUs there are if fewer)"
    )
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument(
        "--labels",
        type=int,
        default=LABELS_PER_CLASS,
        help=f"labelled training images per class (default {LABELS_PER_CLASS}; 0: all of them)",
    )
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument(
        "--weights",
        type=Path,
        default=SERIES_WEIGHTS,
        help="pretrained state dict (.pt, or .safetensors with `safetensors` installed)",
    )
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per process for torch ops")
    parser.add_argument("--seed", type=int, default=0)
    if checkpoint:
        parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT, help=f"default {CHECKPOINT}")
        parser.add_argument("--strategy", default="auto", help="auto, ddp or fsdp (fsdp writes a shard folder)")
    args = parser.parse_args()
    for name in ("devices", "epochs", "batch_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.labels < 0:
        parser.error(f"--labels must be 0 (all) or more, got {args.labels}")
    args.labels = args.labels or None  # load_digits_splits(train_per_class=None) keeps every label
    args.devices = pick_devices(args.devices, wanted=devices)
    # The matrices are small, so on a CPU extra threads per process gain little (see examples/demo.py).
    torch.set_num_threads(args.threads)
    return args


def pick_devices(requested: int | None, wanted: int, quiet: bool = False) -> int:
    """The devices a script runs on: ``requested`` (``--devices``) when given, else ``wanted`` processes on a CPU
    and ``wanted`` GPUs, or all there are when the machine has fewer (said on stderr, unless ``quiet``).

    Usage: ``args.devices = pick_devices(args.devices, wanted=2)``.
    """
    if requested is not None:
        return requested
    if not torch.cuda.is_available():
        return wanted
    available = torch.cuda.device_count()
    if available < wanted:
        if not quiet:
            print(
                f"{Path(sys.argv[0]).name}: {available} GPU(s) here, not {wanted}: running on {available} "
                f"(pass --devices to choose)",
                file=sys.stderr,
                flush=True,
            )
        return available
    return wanted


def one_device(devices: int) -> torch.device:
    """The device of a plain PyTorch script (00-02): the GPU if there is one, else the CPU; one process only.

    Usage: ``device = one_device(args.devices)``.
    """
    if devices != 1:
        sys.exit(
            f"--devices {devices}: this plain PyTorch script runs one process; from 03_fabric.py on, fabriclite "
            "runs the same training on several (05_fabric_ddp.py uses 2 by default)."
        )
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def peak_memory_mib(device: torch.device) -> float:
    """The most memory this process held: CUDA's allocator peak on a GPU, else the peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # Linux reports KiB


def loop_flops(train_loader: DataLoader, val_loader: DataLoader, epochs: int, config: ViTConfig = SERIES_CONFIG) -> int:
    """The model FLOPs this process computes in a script's timed loop: each epoch a training step (forward and
    backward) on every image its ``train_loader`` yields and a forward on every image of ``val_loader``, as
    ``ViTConfig.flops`` works them out from the shapes.

    Usage: ``flops = loop_flops(train_loader, val_loader, args.epochs)``.
    """
    train, forward = config.flops(), config.flops(training=False)
    # len(loader.sampler): the images of one epoch in this process (a DistributedSampler's share under DDP/FSDP).
    return epochs * (train * len(train_loader.sampler) + forward * len(val_loader.sampler))


def process_seconds() -> float:
    """Seconds since this process started: the interpreter's start and every import included, as a user timing the
    command sees it. Read from the kernel on Linux (``/proc/self/stat``, to 1/100 s); elsewhere counted from this
    module's import, which leaves out the seconds of importing torch before it.

    Usage: ``print(f"end-to-end wall time: {process_seconds():.1f} s")``.
    """
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, counted after the name's ")"
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def mfu(flops: int, seconds: float, device: torch.device) -> float | None:
    """Model FLOPs utilization: ``flops`` done in ``seconds`` over the device's dense bf16 peak, for every script
    alike (fp32 ones included, as nanoGPT reports it), so the scripts compare on one scale. None on a CPU or a GPU
    without a known peak.

    Usage: ``mfu(loop_flops(train_loader, val_loader, 10), 12.5, torch.device("cuda"))``.
    """
    peak = get_available_flops(device, torch.bfloat16)
    return flops / seconds / peak if peak and seconds > 0 else None


def results(
    seconds: float,
    device: torch.device,
    accuracy: float,
    flops: int | None = None,
    timed: str = "training time",
    extra: dict | None = None,
) -> str:
    """The closing lines of a script: human-readable, then one JSON line for run_all.py. ``flops`` (what
    ``loop_flops`` counts for the timed loop) adds the MFU; ``extra`` adds its items to the JSON line.

    Usage: ``print(results(time.perf_counter() - start, device, test_accuracy, flops))``.
    """
    script = Path(sys.argv[0]).stem
    memory = peak_memory_mib(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    utilization = mfu(flops, seconds, device) if flops else None
    record = {"script": script, "seconds": round(seconds, 2), "peak_memory_mib": round(memory, 1)}
    record |= {"test_accuracy": round(100 * accuracy, 2), "device": name, **(extra or {})}
    lines = [f"{timed}: {seconds:.1f} s"]
    if flops:
        record["mfu"] = None if utilization is None else round(utilization, 4)
        rate = f"{flops / seconds / 1e12:.3f} TFLOP/s" if seconds > 0 else "n/a"
        share = f"n/a (no bf16 peak known for {name})" if utilization is None else f"{utilization:.1%} of bf16 peak"
        lines.append(f"model FLOP/s: {rate}; MFU: {share}")
    lines += [
        f"peak memory: {memory:.0f} MiB ({'CUDA allocator' if device.type == 'cuda' else 'process RSS'})",
        f"test accuracy: {100 * accuracy:.1f}%",
        f"RESULT {json.dumps(record)}",
    ]
    return "\n".join(lines)
