"""Train a small byte-level GPT with fabriclite, offline, on the Python standard library's own source code.

Every fabriclite feature a language-model run leans on is on the path: mixed precision, gradient accumulation
that skips the DDP all-reduce on all but the last micro-batch, gradient clipping after unscaling, atomic
checkpoints that resume bit-exactly (model, optimizer, schedule, data position, random streams), CSV and
TensorBoard logging, and the switches for several processes, torch.compile and the Triton kernels.

Usage:
    python examples/gpt/train.py --quick                        # tiny model, 100 steps: seconds on one CPU core
    python examples/gpt/train.py                                # 0.8M parameters, 1000 steps
    python examples/gpt/train.py --devices 2 --strategy ddp     # two processes (CPU: gloo, CUDA: nccl)
    fabriclite run --devices 2 examples/gpt/train.py            # the same, started by the launcher
    python examples/gpt/train.py --devices 4 --tp 2             # tensor parallel 2 x FSDP2 2 (parallel.py)
    python examples/gpt/train.py --devices 4 --hsdp 2           # hybrid: FSDP2 within pairs, 2 replicas
    python examples/gpt/train.py --resume                       # continue from runs/gpt/last.ckpt
    python examples/gpt/train.py --text my_book.txt --out-dir runs/book
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before the heavy imports: "total" is what the person at the terminal waits

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, replace  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from data import Windows, load_text, split  # noqa: E402
from fabriclite import Fabric, seed_everything  # noqa: E402
from fabriclite.kernels import kernels_available  # noqa: E402
from fabriclite.loggers import CSVLogger, TensorBoardLogger  # noqa: E402
from fabriclite.utilities.throughput import ThroughputMonitor, measure_flops  # noqa: E402
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from parallel import parallelize  # noqa: E402

# --quick: a model and a run small enough for CI (a few seconds of training on one CPU core). Flags given on the
# command line still win, e.g. `--quick --max-steps 200`.
QUICK_MODEL = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
QUICK_ARGS = dict(
    max_steps=100,
    batch_size=16,
    lr=3e-3,
    eval_every=25,
    save_every=25,
    log_every=5,
    eval_windows=64,
    out_dir=Path("runs/gpt-quick"),  # apart from the full-size run, whose checkpoint holds another model
)
WARMUP_FRACTION = 0.05  # of max_steps, rising linearly to --lr
MIN_LR_FRACTION = 0.1  # the cosine ends at lr / 10, as in nanoGPT and Chinchilla
CHECKPOINT = "last.ckpt"
FORMATS = {
    "train_loss": ".4f",
    "val_loss": ".4f",
    "lr": ".2e",
    "tokens_per_sec": ".0f",
    "mfu": ".1%",
    "grad_norm": ".3f",
}


def at_least(minimum: float, kind: type = int) -> Callable[[str], float]:
    """An argparse type accepting numbers of ``kind`` no smaller than ``minimum``, with an error that says so."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__} >= {minimum}, got {text!r}") from None
        if not value >= minimum:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text!r}")
        return value

    return parse


def devices_arg(text: str) -> int | str:
    """--devices: "auto" or a whole number of at least 1."""
    if text == "auto":
        return text
    try:
        return at_least(1)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number >= 1, got {text!r}") from None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and few steps, for CI and a first try")
    parser.add_argument("--text", type=Path, help="train on this file's bytes instead of the stdlib's source")
    parser.add_argument("--out-dir", type=Path, default=Path("runs/gpt"), help="checkpoint and logs/version_N")
    parser.add_argument("--resume", action="store_true", help=f"continue from OUT_DIR/{CHECKPOINT}")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument(
        "--devices",
        type=devices_arg,
        default="auto",
        help="processes (CPU) or GPUs; auto: what a launcher (`fabriclite run --devices N`) set, else 1",
    )
    parser.add_argument("--strategy", default="auto", help="auto, ddp or fsdp")
    parser.add_argument(
        "--tp", type=at_least(1), default=1, help="tensor-parallel size: N ranks split each block, FSDP2 over the rest"
    )
    parser.add_argument(
        "--hsdp",
        type=at_least(1),
        default=1,
        help="hybrid sharding (HSDP): FSDP2 within groups of N ranks, the groups replicas of each other",
    )
    parser.add_argument(
        "--precision",
        default=None,
        help="e.g. bf16-mixed, 32-true, 16-mixed, bf16-true; default: what a launcher (`fabriclite run --precision`) "
        "set, else bf16-mixed",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (Fabric(compile=True))")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="Llama-style blocks on fabriclite's Triton kernels: RMSNorm where measured faster, RoPE, SwiGLU "
        "(CUDA; elsewhere the same blocks on torch ops)",
    )
    parser.add_argument(
        "--fused-loss",
        action="store_true",
        help="with --kernels, the loss as fabriclite's linear cross-entropy: never all the logits at once (less "
        "memory for a large vocabulary), a slower step",
    )
    parser.add_argument("--llama", action="store_true", help="Llama-style blocks (RMSNorm, RoPE, SwiGLU) on torch ops")
    parser.add_argument("--max-steps", type=at_least(1), default=1000, help="optimizer steps")
    parser.add_argument("--batch-size", type=at_least(1), default=32, help="windows per micro-batch and process")
    parser.add_argument("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=at_least(0.0, float), default=2e-3, help="peak learning rate")
    parser.add_argument("--max-grad-norm", type=at_least(0.0, float), default=1.0, help="clip to this norm; 0: off")
    parser.add_argument("--eval-every", type=at_least(1), default=100, help="steps between validation losses")
    parser.add_argument("--eval-windows", type=at_least(1), default=256, help="validation windows per evaluation")
    parser.add_argument("--save-every", type=at_least(1), default=200, help="steps between checkpoints")
    parser.add_argument("--log-every", type=at_least(1), default=10, help="steps between train-loss log rows")
    parser.add_argument("--sample-tokens", type=at_least(0), default=300, help="bytes to sample at the end; 0: none")
    parser.add_argument("--prompt", default="def ", help="the text sampling starts from")
    parser.add_argument("--temperature", type=at_least(1e-3, float), default=0.8)
    parser.add_argument("--top-k", type=at_least(1), default=40, help="sample among the k most likely bytes")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--threads", type=at_least(1), default=1, help="CPU threads per process (torch ops)")
    args = parser.parse_args()
    if args.quick:
        parser.set_defaults(**QUICK_ARGS)
        args = parser.parse_args()
    # Checked here, before a process group or a model exists, so the message is the first and only output
    # (a missing --text is data.load_text's to report).
    if args.resume and not (args.out_dir / CHECKPOINT).exists():  # a file, or a folder under FSDP
        parser.error(f"--resume: no checkpoint at {args.out_dir / CHECKPOINT}. Run without --resume to start one.")
    if not args.prompt:
        parser.error("--prompt must not be empty: the model needs at least one byte to continue.")
    if args.fused_loss and not args.kernels:
        parser.error("--fused-loss is one of the kernels: give it with --kernels.")
    args.precision = args.precision or os.environ.get("FABRICLITE_CLI_PRECISION", "bf16-mixed")  # a launcher's
    if (args.tp > 1 or args.hsdp > 1) and args.devices == "auto":  # they need the number: a launcher's, else 1
        args.devices = int(os.environ.get("WORLD_SIZE", "1"))
    n_head = (QUICK_MODEL if args.quick else GPTConfig()).n_head
    if args.tp > 1 and (args.strategy != "auto" or args.devices % args.tp or n_head % args.tp):
        parser.error(
            f"--tp {args.tp} needs --strategy auto (it brings its own), --devices a multiple of it (got {args.devices}) "
            f"and the model's {n_head} heads divisible by it."
        )
    if args.hsdp > 1 and (args.strategy != "auto" or args.tp > 1 or args.devices % args.hsdp):
        parser.error(
            f"--hsdp {args.hsdp} needs --strategy auto (it brings its own), no --tp, and --devices a multiple of it "
            f"(got {args.devices})."
        )
    return args


def lr_factor(step: int, max_steps: int) -> float:
    """Linear warmup, then a cosine from 1 down to MIN_LR_FRACTION at max_steps: the multiplier of --lr."""
    warmup = max(1, round(WARMUP_FRACTION * max_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(fabric: Fabric, model: torch.nn.Module, loader: DataLoader) -> float:
    """Mean loss per byte over the validation windows (split across processes, summed over all of them)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)  # (summed loss, bytes)
    for x, y in loader:
        total[0] += model(x, y, reduction="sum")
        total[1] += y.numel()
    model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1]).item()


def peak_memory_mib(device: torch.device) -> float | None:
    """The most memory this process held: allocated on the GPU, or resident on the CPU (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # bytes on macOS, KiB on Linux


def main() -> None:
    args = parse_args()
    try:
        text = load_text(args.text)
    except FileNotFoundError as err:
        sys.exit(str(err))
    train_data, val_data = split(text)
    model_config = replace(QUICK_MODEL if args.quick else GPTConfig(), llama=args.llama or args.kernels)

    # Every run (and every resumption) logs into a new version_N folder under OUT_DIR/logs, the CSV and the
    # TensorBoard files side by side, so `fabriclite plot OUT_DIR/logs` shows them together.
    loggers = [CSVLogger(args.out_dir, name="logs")]
    try:
        loggers.append(TensorBoardLogger(args.out_dir, name="logs", version=loggers[0].version))
        tensorboard_note = ""
    except ModuleNotFoundError:
        tensorboard_note = "tensorboard is not installed: logging to CSV only (pip install tensorboard)"
    strategy = args.strategy
    if args.tp > 1:
        strategy = ModelParallelStrategy(parallelize, args.devices // args.tp, args.tp)
    elif args.hsdp > 1:  # a (replicate, shard) mesh: shards within a group, the same shards in every group
        strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(args.devices // args.hsdp, args.hsdp))
    fabric = Fabric(
        accelerator=args.accelerator,
        strategy=strategy,
        devices=args.devices,
        precision=args.precision,
        loggers=loggers,
        compile=args.compile,
        kernels=args.kernels,
    )
    fabric.launch()
    # After launch, which shares the cores out between processes: at these sizes (matrices of a few hundred
    # columns) more threads gain little, and where other processes share the cores, threads waiting for each other
    # spin. On a busy 2-core machine the --quick run took 5 s with one thread and 50 s with two.
    torch.set_num_threads(args.threads)
    seed_everything(args.seed, verbose=False)

    # Fabric(kernels=True) swapped nothing yet (there is no model): it decided whether the kernels run on this
    # device, and the model's own ops (RoPE, SwiGLU, the loss) follow the same decision.
    fused = args.kernels and kernels_available(fabric.device)
    model = GPT(model_config, kernels=fused, fused_loss=fused and args.fused_loss)
    # nanoGPT's split: weight decay on the matrices (the embeddings too; the token embedding is also the head),
    # none on biases and LayerNorm gains.
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args.max_steps))
    # The loader's own generator: the shuffling draws from it alone, and the checkpoint records its state.
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(
            Windows(train_data, model_config.block_size),
            batch_size=args.batch_size,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(args.seed),
        ),
        DataLoader(
            Windows(val_data, model_config.block_size, stride=model_config.block_size, limit=args.eval_windows),
            batch_size=args.batch_size,
        ),
    )

    # Everything a bit-exact continuation needs; fabric.save adds the random streams and the loss scaler.
    state = {
        "model_config": asdict(model_config),  # first: loaded before the model, so a mismatch can be named
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "train_loader": train_loader,
        "step": 0,
    }
    checkpoint = args.out_dir / CHECKPOINT
    if args.resume:
        try:
            fabric.load(checkpoint, state)
        except RuntimeError:
            if state["model_config"] == asdict(model_config):
                raise
            sys.exit(
                f"{checkpoint} holds a model with {state['model_config']}, this run builds {asdict(model_config)}. "
                "Resume with the same size (--quick or not), or start a new run in another --out-dir."
            )
        fabric.print(f"resumed from {checkpoint} at step {state['step']}")
    start_step = step = state["step"]

    # Ranks of one tensor-parallel group read the same windows: the data is split over world_size / tp ranks.
    tokens_per_step = args.batch_size * model_config.block_size * args.grad_accum * fabric.world_size // args.tp
    # FLOPs of one optimizer step per process (forward and backward), counted on a model of meta tensors: no memory
    # and no time. MFU divides what was achieved by the device's dense peak (none on a CPU: no MFU there).
    with torch.device("meta"):
        meta_model = GPT(model_config)
        meta_x = torch.zeros(args.batch_size, model_config.block_size, dtype=torch.long)
    # Under tensor parallelism a group of --tp processes shares one batch's model FLOPs.
    flops_per_step = (
        args.grad_accum * measure_flops(meta_model, lambda: meta_model(meta_x), lambda y: y.sum()) / args.tp
    )
    kernels_note = "torch ops"
    if fused:
        kernels_note = f"Triton kernels (RoPE, SwiGLU, norms{', linear cross-entropy' if args.fused_loss else ''})"
    throughput = ThroughputMonitor(fabric, window_size=5)
    n_params = sum(p.numel() for p in model.parameters())
    fabric.print(
        f"GPT with {n_params / 1e6:.2f}M parameters on {len(train_data) / 1e6:.2f} MB of "
        f"{args.text or 'Python standard-library source'} ({len(val_data) / 1e3:.0f} kB held out); "
        f"{fabric.world_size} process(es) on {fabric.device}, precision {args.precision}, "
        f"{torch.get_num_threads()} thread(s), {tokens_per_step} tokens per step, "
        f"{'Llama-style blocks' if model_config.llama else 'GPT-2 blocks'}, "
        f"{kernels_note}"
    )
    if tensorboard_note:
        fabric.print(tensorboard_note)
    if fabric.is_global_zero:
        for logger in fabric.loggers:
            logger.log_hyperparams(vars(args))

    val_loss = float("nan")
    if step == 0:
        val_loss = evaluate(fabric, model, val_loader)
        fabric.log_dict({"val_loss": val_loss}, step=0)
        fabric.print(f"step {0:5d} | val loss {val_loss:.4f}")

    def batches():  # the loader, epoch after epoch; a resumed loader first finishes its interrupted epoch
        while True:
            yield from train_loader

    stream = batches()
    loss_sum = torch.zeros((), device=fabric.device)  # summed on the device: no sync per step
    logged_steps = 0
    micro_batches = 0
    train_start = t_last = time.perf_counter()
    trained_seconds = 0.0  # training only: evaluation and checkpoint pauses left out
    model.train()
    while step < args.max_steps:
        for micro in range(args.grad_accum):
            x, y = next(stream)
            # The DDP all-reduce of the gradients is only needed once per optimizer step: skip it on every
            # micro-batch but the last (a no-op on one process). Forward and backward both belong inside.
            with fabric.no_backward_sync(model, enabled=micro < args.grad_accum - 1):
                loss = model(x, y) / args.grad_accum
                fabric.backward(loss)
            loss_sum += loss.detach()
        micro_batches += args.grad_accum
        if args.max_grad_norm > 0:
            grad_norm = fabric.clip_gradients(model, optimizer, max_norm=args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        logged_steps += 1

        metrics = {}
        if step % args.log_every == 0 or step == args.max_steps:
            now = time.perf_counter()
            train_loss = fabric.all_reduce(loss_sum, reduce_op="mean").item() / logged_steps
            metrics.update(train_loss=train_loss, lr=scheduler.get_last_lr()[0])
            metrics["tokens_per_sec"] = logged_steps * tokens_per_step / (now - t_last)
            trained_seconds += now - t_last
            done = step - start_step
            throughput.update(
                time=trained_seconds,
                batches=done * args.grad_accum,
                samples=done * args.grad_accum * args.batch_size,
                flops=logged_steps * flops_per_step,
            )
            if "device/mfu" in (rates := throughput.compute()):
                metrics["mfu"] = rates["device/mfu"]
            if args.max_grad_norm > 0:
                metrics["grad_norm"] = grad_norm.item()
            loss_sum.zero_()
            logged_steps, t_last = 0, now
        if step % args.eval_every == 0 or step == args.max_steps:
            eval_start = time.perf_counter()
            metrics["val_loss"] = val_loss = evaluate(fabric, model, val_loader)
            t_last += time.perf_counter() - eval_start  # tokens/s counts training time only
        if metrics:
            fabric.log_dict(metrics, step=step)
            line = " | ".join(f"{name.replace('_', ' ')} {value:{FORMATS[name]}}" for name, value in metrics.items())
            fabric.print(f"step {step:5d} | {line}")
        if step % args.save_every == 0 or step == args.max_steps:
            save_start = time.perf_counter()
            state["step"] = step
            fabric.save(checkpoint, state)
            for logger in fabric.loggers:  # the logs on disk then reach at least as far as the checkpoint
                logger.save()
            fabric.print(f"step {step:5d} | saved {checkpoint}")
            t_last += time.perf_counter() - save_start
    train_time = time.perf_counter() - train_start

    sample = ""
    if args.sample_tokens > 0:
        # Every process samples the same bytes (same seed): under FSDP each forward needs all of them anyway.
        # The unwrapped module under the precision's autocast: no DDP hooks, and no recompiling per length.
        generator = torch.Generator(device=fabric.device).manual_seed(args.seed)
        prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long, device=fabric.device)
        model.module.eval()
        with fabric.autocast():
            out = model.module.generate(prompt, args.sample_tokens, args.temperature, args.top_k, generator)
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")

    for logger in fabric.loggers:
        logger.finalize("success")
    peak = peak_memory_mib(fabric.device)
    fabric.print(
        f"trained {step - start_step} optimizer steps of {args.grad_accum} micro-batch(es) each "
        f"({micro_batches} micro-batches of {args.batch_size}x{model_config.block_size} bytes per process)"
    )
    fabric.print(f"final val loss: {val_loss:.4f}")
    fabric.print(f"peak memory: {'n/a' if peak is None else f'{peak:.0f} MiB'}")
    achieved = (step - start_step) * flops_per_step / max(trained_seconds, 1e-9)
    peak_flops = throughput.available_flops
    mfu = "n/a (no peak FLOP/s known for this device)" if not peak_flops else f"{achieved / peak_flops:.1%}"
    fabric.print(f"model FLOP/s per process: {achieved / 1e12:.3f} TFLOP/s; MFU: {mfu}")
    fabric.print(f"time: {time.perf_counter() - START:.1f} s (training {train_time:.1f} s)")
    if sample:
        fabric.print(f"sample:\n{sample}")


if __name__ == "__main__":
    main()
