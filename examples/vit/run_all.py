"""Run the numbered ViT scripts one after another and collect what they report into results.md and a chart.

Each script runs as its own program, exactly as a person would start it, and ends with a RESULT line
(time, peak memory, test accuracy, device) that is gathered here. The pretrained weights are made first
if they do not exist yet. The chart (results.png: time and test accuracy per script) needs matplotlib
(`pip install 'fabriclite[plot]'`); without it, only results.md is written.

Usage:
    python examples/vit/run_all.py            # the full series: pretraining (once, ~5 min) + a few minutes
    python examples/vit/run_all.py --quick    # weights pretrained briefly (3 epochs, not 50): a few minutes
    python examples/vit/run_all.py --only 01,03,04
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/, so that `import vit` finds this folder

from vit.pretrain import SERIES_WEIGHTS  # noqa: E402
from vit.series import pick_devices  # noqa: E402

SCRIPTS = {
    "00": ("00_raw_random_init.py", "raw PyTorch, random init"),
    "01": ("01_raw_pretrained.py", "raw PyTorch, pretrained"),
    "02": ("02_raw_compile.py", "raw + torch.compile"),
    "03": ("03_fabric.py", "Fabric (three-line change)"),
    "04": ("04_fabric_bf16.py", "Fabric, bf16-mixed"),
    "05": ("05_fabric_ddp.py", "bf16, DDP, {devices} devices"),
    "06": ("06_fabric_fsdp.py", "bf16, FSDP, {devices} devices"),
    "07": ("07_fabric_fsdp_scheduler.py", "bf16, FSDP, LR schedule"),
    "08": ("08_save_checkpoint.py", "bf16, save a checkpoint"),
    "08b": ("08_load_checkpoint.py", "load it in another script"),
    "09": ("09_fabric_compile_kernels.py", "bf16, compile + kernels"),
}
# Quick mode pretrains briefly (the full pretraining is most of a full run's time): enough to see every script
# work end to end, not to reach a full run's accuracies (about 50% instead of 89% on these 200 labels).
QUICK_PRETRAIN_EPOCHS = 3


def run(command: list[str], log: Path) -> tuple[int, str]:
    """Run a command to completion, echoing its output and keeping a copy in `log`."""
    print("+", " ".join(command[1:]), flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    log.write_text(done.stdout)
    for line in done.stdout.splitlines():
        if not line.startswith("RESULT "):
            print("   ", line, flush=True)
    return done.returncode, done.stdout


def result_of(output: str) -> dict | None:
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else None


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    gpu = f", GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", no GPU"
    return f"{cpu}, {os.cpu_count()} cores{gpu}; Python {platform.python_version()}, torch {torch.__version__}"


def write_table(rows: list[dict], path: Path, mode: str) -> None:
    baseline = next((row for row in rows if row.get("key") == "01" and "seconds" in row), None)
    lines = [
        f"# ViT series results ({mode})",
        "",
        f"Machine: {machine()}. Written by `python examples/vit/run_all.py{' --quick' if mode == 'quick' else ''}`"
        f" on {time.strftime('%Y-%m-%d')}.",
        "Time is the training loop (compilation included, pretraining and start-up not); memory is the CUDA",
        "allocator's peak on a GPU, else the peak resident set size of the (first) process.",
        "",
        "| script | what it shows | time (s) | vs 01 | peak memory (MiB) | test accuracy | device |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        if "seconds" not in row:
            lines.append(f"| {row['file']} | {row['what']} | failed (exit {row['code']}) | | | | |")
            continue
        ratio = f"{baseline['seconds'] / row['seconds']:.2f}x" if baseline and row["key"] != "08b" else ""
        lines.append(
            f"| {row['file']} | {row['what']} | {row['seconds']:.1f} | {ratio} | {row['peak_memory_mib']:.0f} "
            f"| {row['test_accuracy']:.1f}% | {row['device']} |"
        )
    lines += ["", '"vs 01": how many times faster than 01_raw_pretrained.py (above 1 is faster).', ""]
    path.write_text("\n".join(lines))


def write_chart(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart (pip install 'fabriclite[plot]')")
        return False
    done = [row for row in rows if "seconds" in row and row["key"] != "08b"]
    labels = [f"{row['key']} {row['what']}" for row in done][::-1]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 0.45 * len(done) + 1.5), sharey=True)
    left.barh(labels, [row["seconds"] for row in done][::-1], color="tab:blue")
    left.set_xlabel("training time (s)")
    right.barh(labels, [row["test_accuracy"] for row in done][::-1], color="tab:green")
    right.set_xlabel("test accuracy (%)")
    right.set_xlim(0, 100)
    for axis, key, fmt in ((left, "seconds", "{:.1f}"), (right, "test_accuracy", "{:.1f}%")):
        for y, row in enumerate(done[::-1]):
            axis.text(row[key], y, " " + fmt.format(row[key]), va="center", fontsize=8)
    figure.suptitle(f"ViT fine-tuning on digits, {done[0]['device'] if done else ''}")
    figure.tight_layout()
    # Write next to the target, then rename: a reader never sees half a PNG.
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".png", delete=False) as tmp:
        figure.savefig(tmp.name, dpi=110)
    os.replace(tmp.name, path)
    plt.close(figure)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"pretrain {QUICK_PRETRAIN_EPOCHS} epochs only")
    parser.add_argument("--epochs", type=int, help="epochs per script (default: the scripts' own)")
    parser.add_argument("--only", help="comma-separated script numbers, e.g. 01,03,04 (08 runs save and load)")
    parser.add_argument("--out-dir", type=Path, help="where results.md, results.png and logs go (default: here)")
    args = parser.parse_args()
    keys = list(SCRIPTS)
    if args.only:
        wanted = [key.strip() for key in args.only.split(",") if key.strip()]
        unknown = [key for key in wanted if key not in SCRIPTS or key == "08b"]
        if unknown:
            parser.error(f"--only {args.only}: unknown {unknown}; valid: {', '.join(k for k in SCRIPTS if k != '08b')}")
        keys = [key for key in keys if key in wanted or (key == "08b" and "08" in wanted)]
    if args.epochs is not None and args.epochs < 1:
        parser.error(f"--epochs must be at least 1, got {args.epochs}")
    import torch

    out_dir = args.out_dir or (HERE / "results-quick" if args.quick else HERE)
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    common = ["--epochs", str(args.epochs)] if args.epochs else []

    # Quick runs pretrain briefly into their own file, so a full run's weights are never replaced.
    weights = out_dir / "weights" / "vit_series_quick.pt" if args.quick else SERIES_WEIGHTS
    if not weights.exists():
        pretrain = [sys.executable, str(HERE / "pretrain.py"), "--series", "--out", str(weights)]
        code, _ = run(
            pretrain + (["--epochs", str(QUICK_PRETRAIN_EPOCHS)] if args.quick else []), logs / "pretrain.log"
        )
        if code != 0:
            print(f"pretraining failed (exit {code}); see {logs / 'pretrain.log'}")
            return 1
    checkpoint = out_dir / "checkpoints" / "vit_08.ckpt"

    # 05-07 run on 2 devices: 2 processes on a CPU, 2 GPUs, or the one GPU of a one-GPU machine.
    devices = pick_devices(None, wanted=2, quiet=True)
    if any(key in keys for key in ("05", "06", "07")):
        print(f"05-07 (DDP, FSDP) run on {devices} {'GPU(s)' if torch.cuda.is_available() else 'CPU processes'}")
    rows = []
    for key in keys:
        file, what = SCRIPTS[key]
        what = what.format(devices=devices)
        command = [sys.executable, str(HERE / file), *common, "--weights", str(weights)]
        if key == "08b":
            command = [sys.executable, str(HERE / file), "--checkpoint", str(checkpoint)]
        elif key == "08":
            command += ["--checkpoint", str(checkpoint)]
        code, output = run(command, logs / f"{Path(file).stem}.log")
        result = result_of(output) if code == 0 else None
        rows.append({"key": key, "file": file, "what": what, "code": code, **(result or {})})

    mode = "quick" if args.quick else "full"
    write_table(rows, out_dir / "results.md", mode)
    print(f"wrote {out_dir / 'results.md'}")
    if write_chart(rows, out_dir / "results.png"):
        print(f"wrote {out_dir / 'results.png'}")
    failed = [row["file"] for row in rows if "seconds" not in row]
    if failed:
        print(f"failed: {', '.join(failed)} (logs in {logs})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
