"""Fine-tune a small Vision Transformer on handwritten digits with fabriclite, on CPU, in under a minute.

The data is scikit-learn's bundled digits set (1797 images of 8x8 pixels, nothing is downloaded). The
"pretrained" weights are made by this project itself: examples/vit/pretrain.py trains the same ViT
without labels (contrastive learning on augmented images) and saves its state dict. The repository
ships the file it made (examples/vit/pretrained/); `--weights PATH` uses another one, made there first
if it does not exist yet. Then the head is replaced by a fresh 10-class one and the whole model is
fine-tuned on the labelled training split.

Usage:
    python examples/demo.py                    # the shipped weights, fine-tune, report test accuracy
    python examples/demo.py --weights my.pt    # pretrain into my.pt first (once), then the same
    python examples/demo.py --no-pretrained    # same fine-tuning budget from random weights, to compare
    python examples/demo.py --precision 32-true --epochs 10

Without --precision it picks bf16-mixed where bf16 is computed natively (a GPU, a CPU with AVX-512 BF16, AMX or
Arm's BF16) and 32-true on a CPU without, where bf16 is emulated and the demo takes about 3x as long; it says which.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before the heavy imports: "total" is what the person at the terminal waits

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from fabriclite import Fabric, accelerators, seed_everything  # noqa: E402
from fabriclite.metrics import Accuracy  # noqa: E402
from vit.data import NUM_CLASSES, load_digits_splits  # noqa: E402
from vit.model import ViT, ViTConfig, load_pretrained  # noqa: E402
from vit.pretrain import EPOCHS as PRETRAIN_EPOCHS, SHIPPED_WEIGHTS, pretrain  # noqa: E402


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Return the fraction of correctly classified images in `loader` (over all processes).

    fabriclite's Accuracy syncs across processes and skips the samples DistributedSampler repeats to even out
    the ranks, so two processes report exactly what one would.
    """
    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for images, labels in loader:
        accuracy.update(model(images), labels)
    model.train()
    return accuracy.compute().item()


def default_precision(accelerator: str) -> tuple[str, str]:
    """The precision the demo runs in when none is given, and why: bf16-mixed where bf16 is native, else 32-true."""
    gpu = accelerators.CUDAAccelerator.is_available() or accelerators.MPSAccelerator.is_available()
    if accelerator not in ("cpu", "auto") or (accelerator == "auto" and gpu):
        return "bf16-mixed", "the default on a GPU"
    if accelerators.cpu_has_native_bf16():
        return "bf16-mixed", "this CPU computes bf16 natively"
    return "32-true", "this CPU has no native bf16: bf16-mixed would be emulated, about 3x slower"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=12, help="fine-tuning epochs")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the fine-tuning")
    parser.add_argument(
        "--precision", help="bf16-mixed, 32-true, bf16-true... (default: bf16-mixed where bf16 is native, else 32-true)"
    )
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--devices", type=int, default=1, help="processes (CPU) or GPUs; more than 1 uses --strategy")
    parser.add_argument("--strategy", default="auto", help="auto, ddp or fsdp")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (fabric compile=True)")
    parser.add_argument("--kernels", action="store_true", help="fabriclite's Triton kernels (CUDA; else unchanged)")
    parser.add_argument("--save", type=Path, help="save the fine-tuned model here with fabric.save at the end")
    parser.add_argument("--load", type=Path, help="skip training: load a model saved with --save and test it")
    parser.add_argument(
        "--weights",
        type=Path,
        default=SHIPPED_WEIGHTS,
        help="pretrained state dict (.pt, or .safetensors with `safetensors` installed; default: the shipped one); "
        "pretrained and saved here first if it does not exist",
    )
    parser.add_argument(
        "--pretrain-epochs",
        type=int,
        default=PRETRAIN_EPOCHS,
        help="epochs of pretraining when --weights does not exist yet",
    )
    parser.add_argument(
        "--no-pretrained", action="store_true", help="fine-tune from random weights instead, with the same budget"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="CPU threads for torch ops; this model is too small to gain from more"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # The matrices are small (at most 1280 tokens x 256 features), so extra threads gain little, and
    # where other processes share the cores, threads that wait for each other spin: on a busy 2-core
    # machine, pretraining took 22 s with one thread and 237 s with two.
    torch.set_num_threads(args.threads)
    chosen = None
    if args.precision is None:
        args.precision, chosen = default_precision(args.accelerator)

    # The only optional dependency: fail before anything slow, and say how to fix it.
    try:
        train_set, val_set, test_set = load_digits_splits()
    except ImportError as err:
        sys.exit(str(err))

    fabric = Fabric(
        accelerator=args.accelerator,
        precision=args.precision,
        devices=args.devices,
        strategy=args.strategy,
        compile=args.compile,
        kernels=args.kernels,
    )
    fabric.launch()
    if chosen is not None:
        fabric.print(f"precision {args.precision} ({chosen}; --precision chooses)")
    seed_everything(args.seed)
    config = ViTConfig()

    if args.load is not None:
        # A checkpoint from any strategy (one file, or an FSDP sharded folder) loads into this process.
        model = fabric.setup(ViT(config))
        fabric.load(args.load, {"model": model})
        test_loader = fabric.setup_dataloaders(DataLoader(test_set, batch_size=512))
        fabric.print(f"loaded {args.load}")
        fabric.print(f"test accuracy: {100 * evaluate(model, test_loader, fabric.device):.1f}%")
        return
    if args.devices > 1 and not args.no_pretrained and not args.weights.exists():
        sys.exit(f"no pretrained weights at {args.weights}: run once with --devices 1 to make them, or --no-pretrained")

    pretrain_time = 0.0
    if not args.no_pretrained and not args.weights.exists():
        fabric.print(
            f"no pretrained weights at {args.weights}: pretraining without labels first "
            f"({args.pretrain_epochs} epochs, once; later runs reuse the file)"
        )
        pretrain_start = time.perf_counter()
        pretrain(fabric, args.weights, config, epochs=args.pretrain_epochs)
        pretrain_time = time.perf_counter() - pretrain_start
        fabric.print(f"pretraining took {pretrain_time:.1f} s, weights saved to {args.weights}")

    # Seed again: the fine-tuning (the new head, the batch order) is then the same whether the weights
    # were just made or loaded from an earlier run.
    seed_everything(args.seed, verbose=False)
    if args.no_pretrained:
        model = ViT(config)
        fabric.print("starting from random weights (--no-pretrained)")
    else:
        model = load_pretrained(args.weights, config, NUM_CLASSES)
        fabric.print(f"loaded pretrained weights from {args.weights}, new {NUM_CLASSES}-class head")

    finetune_start = time.perf_counter()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(
        DataLoader(train_set, batch_size=args.batch_size, shuffle=True),
        DataLoader(val_set, batch_size=512),
        DataLoader(test_set, batch_size=512),
    )
    # Warm up over the first 10% of steps (the new head starts random, and its large early gradients
    # would shake the pretrained layers), then decay along a cosine to almost 0.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=max(1, args.epochs * len(train_loader)), pct_start=0.1
    )
    n_params = sum(p.numel() for p in model.parameters())
    fabric.print(
        f"fine-tuning a ViT with {n_params / 1e3:.0f}k parameters on {len(train_set)} digits "
        f"({len(val_set)} val, {len(test_set)} test), precision {args.precision}, device {fabric.device}"
    )

    model.train()
    for epoch in range(args.epochs):
        loss_sum = torch.zeros((), device=fabric.device)  # this process's share; printed from rank 0
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach() * labels.numel()  # no .item(): on a GPU it would sync every step
        train_loss = fabric.all_reduce(loss_sum, reduce_op="sum").item() / len(train_set)
        fabric.print(
            f"epoch {epoch + 1:2d}/{args.epochs}  train loss {train_loss:.3f}  "
            f"val accuracy {100 * evaluate(model, val_loader, fabric.device):.1f}%"
        )

    test_accuracy = evaluate(model, test_loader, fabric.device)
    finetune_time = time.perf_counter() - finetune_start
    if args.save is not None:
        fabric.save(args.save, {"model": model})
        fabric.print(f"saved the fine-tuned model to {args.save}")
    fabric.print(f"test accuracy: {100 * test_accuracy:.1f}%")
    parts = f"fine-tuning {finetune_time:.1f} s" + (f", pretraining {pretrain_time:.1f} s" if pretrain_time else "")
    fabric.print(f"time: {time.perf_counter() - START:.1f} s ({parts})")


if __name__ == "__main__":
    main()
