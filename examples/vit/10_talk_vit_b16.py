"""10: the talk's run: ViT-B/16 at 224x224 fine-tuned on CIFAR-10 for 3 epochs, evaluated on the test set after each.

As a user writes it: CIFAR-10's 32x32 uint8 images come through a DataLoader (4 workers), are resized to 224 and
normalised on the device, and train with AdamW under bf16-mixed and compile=True (regional: the 12 blocks
compile once). The model is torchvision's ViT-B/16 with ImageNet weights, else timm's, when one of them is
installed and its weights can be loaded; the data is CIFAR-10 through torchvision when it is in --data (or with
--download). Otherwise the script says so loudly and runs from random initialisation on synthetic CIFAR-10-shaped
data made in memory (each class a fixed random image plus noise, so the accuracy still moves), and on the
examples' own ViT when neither torchvision nor timm is installed. It never downloads without --download.

It prints the end-to-end wall time from the moment the process started (imports, setup, compilation, training and
every evaluation: what a user timing the command sees), the training images/s of the last epoch (after
compilation), the MFU of the whole run and of the last epoch's training (the model FLOPs ``ViTConfig.flops`` works
out from the shapes: docs/throughput.md), the peak memory, and the series' RESULT line.

Usage:
    python examples/vit/10_talk_vit_b16.py --download            # the talk's run on one GPU
    python examples/vit/10_talk_vit_b16.py --devices 4           # DDP on 4 GPUs
    python examples/vit/10_talk_vit_b16.py --batch-size 256 --precision bf16-true  # faster, see docs
    python examples/vit/10_talk_vit_b16.py --precision fp8-mixed  # fp8 (torchao), see docs/precision.md
    python examples/vit/10_talk_vit_b16.py --synthetic --image-size 32 --dim 64 --depth 2 --train-size 256 \\
        --test-size 128 --batch-size 32 --epochs 1 --workers 0 --precision 32-true --no-compile   # CI, on a CPU
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, so that `import vit` finds this folder

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric
from fabriclite.metrics import Accuracy
from fabriclite.utilities.throughput import get_available_flops
from vit.model import ViT, ViTConfig
from vit.series import pick_devices, process_seconds, results

NUM_CLASSES = 10
CIFAR_SIZE = 32
# ImageNet's statistics: what torchvision's and timm's ViT-B/16 weights were trained with.
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, help="processes with DDP (default 1)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--fused-adamw",
        action=argparse.BooleanOptionalAction,
        help="AdamW(fused=True), a few kernels for the whole update (default: on for a GPU, off on a CPU)",
    )
    parser.add_argument("--workers", type=int, default=4, help="DataLoader worker processes")
    parser.add_argument("--data", type=Path, default=Path("data"), help="CIFAR-10 root folder")
    parser.add_argument("--download", action="store_true", help="download CIFAR-10 and the weights if missing")
    parser.add_argument("--synthetic", action="store_true", help="random init and synthetic data, never loading")
    parser.add_argument("--image-size", type=int, default=224, help="the size images are resized to")
    parser.add_argument("--dim", type=int, default=768, help="width of the examples' ViT (random init only)")
    parser.add_argument("--depth", type=int, default=12, help="blocks of the examples' ViT (random init only)")
    parser.add_argument("--train-size", type=int, default=50_000, help="synthetic training images")
    parser.add_argument("--test-size", type=int, default=10_000, help="synthetic test images")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.devices is not None and args.devices < 1:
        parser.error(f"--devices must be at least 1, got {args.devices}")
    for name in ("epochs", "batch_size", "image_size", "dim", "depth", "train_size", "test_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.workers < 0:
        parser.error(f"--workers must be 0 or more, got {args.workers}")
    if args.image_size % 16:
        parser.error(f"--image-size must be a multiple of the 16-pixel patches, got {args.image_size}")
    args.devices = pick_devices(args.devices, wanted=1)
    return args


def loud(message: str) -> None:
    print(f"\n{'!' * 100}\n!!! {message}\n{'!' * 100}\n", file=sys.stderr, flush=True)


# torchvision's and timm's ViT-B/16: the shapes their FLOPs are worked out from.
VIT_B16 = ViTConfig(image_size=224, patch_size=16, in_channels=3, dim=768, depth=12, heads=12, num_classes=NUM_CLASSES)


def random_init_config(args: argparse.Namespace) -> ViTConfig:
    """The examples' ViT that --synthetic trains: --image-size, --dim, --depth, a head per 64 of the width."""
    return ViTConfig(
        image_size=args.image_size,
        patch_size=16,
        in_channels=3,
        dim=args.dim,
        depth=args.depth,
        heads=max(1, args.dim // 64),
        num_classes=NUM_CLASSES,
    )


def load_model(args: argparse.Namespace, fabric: Fabric) -> tuple[torch.nn.Module, str, ViTConfig]:
    """ViT-B/16 with ImageNet weights and a fresh 10-class head, from torchvision or timm; else random init, made
    on the device (initialising 86M parameters on the CPU and copying them over takes seconds). With the model,
    what it is and its shapes."""
    if not args.synthetic:
        try:
            from torchvision.models import ViT_B_16_Weights, vit_b_16

            weights = ViT_B_16_Weights.IMAGENET1K_V1
            cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
            if args.download or cached.exists():
                model = vit_b_16(weights=weights, image_size=224)
                model.heads.head = torch.nn.Linear(model.heads.head.in_features, NUM_CLASSES)
                return model, "torchvision ViT-B/16, ImageNet-1k weights", VIT_B16
        except ImportError:
            pass
        try:
            import timm

            if args.download:  # timm reads the weights from the Hugging Face hub's cache, or downloads them
                model = timm.create_model("vit_base_patch16_224", pretrained=True, num_classes=NUM_CLASSES)
                return model, "timm vit_base_patch16_224, pretrained weights", VIT_B16
        except ImportError:
            pass
    config = random_init_config(args)
    loud(
        f"RANDOM INITIALISATION: no pretrained ViT-B/16 was loaded (--synthetic, no torchvision/timm, or weights "
        f"not cached; --download fetches them). Model: the examples' ViT, {config}."
    )
    with fabric.init_module():
        model = ViT(config)
    return model, f"random init, examples' ViT (dim {args.dim}, depth {args.depth})", config


def load_data(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset, str]:
    """CIFAR-10 as uint8 (N, 3, 32, 32) images and int64 labels; synthetic data of that shape when not loadable."""
    if not args.synthetic:
        try:
            import numpy as np
            from torchvision.datasets import CIFAR10

            def split(train: bool) -> TensorDataset:
                data = CIFAR10(str(args.data), train=train, download=args.download)
                images = torch.from_numpy(np.ascontiguousarray(data.data.transpose(0, 3, 1, 2)))
                return TensorDataset(images, torch.tensor(data.targets))

            return split(True), split(False), "CIFAR-10"
        except (ImportError, RuntimeError) as err:  # RuntimeError: not found in --data without --download
            reason = str(err).splitlines()[0]
    else:
        reason = "--synthetic"
    loud(
        f"SYNTHETIC DATA: CIFAR-10 was not loaded ({reason}). Training on {args.train_size} and testing on "
        f"{args.test_size} random CIFAR-10-shaped images made in memory: the accuracy says nothing about CIFAR-10."
    )
    generator = torch.Generator().manual_seed(1234)
    templates = torch.randint(0, 256, (NUM_CLASSES, 3, CIFAR_SIZE, CIFAR_SIZE), generator=generator, dtype=torch.int16)

    def synthetic(n: int) -> TensorDataset:
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=generator)
        # int16: the sum of a template and its noise needs more than uint8, far less than int64's 1.2 GB.
        noise = torch.randint(-64, 64, (n, 3, CIFAR_SIZE, CIFAR_SIZE), generator=generator, dtype=torch.int16)
        return TensorDataset((templates[labels] + noise).clamp(0, 255).to(torch.uint8), labels)

    return synthetic(args.train_size), synthetic(args.test_size), "synthetic CIFAR-10-shaped"


def preprocess(images: torch.Tensor, size: int) -> torch.Tensor:
    """uint8 (N, 3, 32, 32) on the device -> normalised float (N, 3, size, size): resizing on the GPU is cheap,
    resizing 50,000 images to 224 in the DataLoader's workers is not."""
    x = images.float().div_(255)
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


@torch.no_grad()
def evaluate(model, loader, device, size):
    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for images, labels in loader:
        accuracy.update(model(preprocess(images, size)), labels)
    model.train()
    return accuracy.compute().item()


def closing_lines(
    args: argparse.Namespace,
    config: ViTConfig,
    device: torch.device,
    train_images: int,
    test_images: int,
    train_seconds: float,
    accuracy: float,
    model: str,
    data: str,
) -> str:
    """The run's closing lines, read now: the end-to-end wall time from the process's start, the last epoch's
    training rate (``train_images`` of this process in ``train_seconds``) and its MFU, the whole run's MFU (each
    epoch trains ``train_images`` and evaluates ``test_images``), the peak memory, the test accuracy, the RESULT
    line. Shared with benchmarks/talk_raw.py, so that the two runs report alike.

    Usage: ``print(closing_lines(args, config, device, 49920, 10000, 15.3, 0.98, "random init", "synthetic"))``.
    """
    seconds = process_seconds()
    images_per_second = train_images * args.devices / train_seconds
    peak = get_available_flops(device, torch.bfloat16)
    train_mfu = train_images / train_seconds * config.flops() / peak if peak else None
    flops = args.epochs * (config.flops() * train_images + config.flops(training=False) * test_images)
    summary = results(
        seconds,
        device,
        accuracy,
        flops,
        timed="end-to-end wall time (from the process's start)",
        extra={
            "images_per_s": round(images_per_second, 1),
            "train_mfu": None if train_mfu is None else round(train_mfu, 4),
            "model": model,
            "data": data,
        },
    )
    mfu = "n/a (no bf16 peak known for this device)" if train_mfu is None else f"{train_mfu:.1%}"
    return (
        f"training images/s (last epoch, all devices): {images_per_second:.0f}; MFU of that training: {mfu}\n{summary}"
    )


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    fabric = Fabric(
        accelerator="auto",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        precision=args.precision,
        compile=args.compile,
    )
    fabric.launch()
    torch.backends.cuda.matmul.allow_tf32 = True  # for the few fp32 matmuls left under bf16
    model, weights, config = load_model(args, fabric)
    train_set, test_set, data = load_data(args)
    fabric.print(
        f"model: {weights}; data: {data}; devices: {args.devices}; precision {args.precision}; "
        f"compile={args.compile}; batch {args.batch_size} per device"
    )
    fused = fabric.device.type == "cuda" if args.fused_adamw is None else args.fused_adamw
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused or None)
    model, optimizer = fabric.setup(model, optimizer)

    loader_options = {
        "num_workers": args.workers,
        "pin_memory": fabric.device.type == "cuda",
        "persistent_workers": args.workers > 0,
    }
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, **loader_options)
    test_loader = DataLoader(test_set, batch_size=2 * args.batch_size, **loader_options)
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    fabric.print(f"setup: {process_seconds():.1f} s since the process started (fused AdamW: {bool(fused)})")
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        for images, labels in train_loader:
            loss = F.cross_entropy(model(preprocess(images, args.image_size)), labels)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
        loss_value = loss.item()  # waits for the GPU: the epoch's time is its work
        train_seconds = time.perf_counter() - epoch_start
        test_accuracy = evaluate(model, test_loader, fabric.device, args.image_size)
        fabric.print(
            f"epoch {epoch + 1}/{args.epochs}  loss {loss_value:.3f}  test acc {100 * test_accuracy:.1f}%  "
            f"train {train_seconds:.1f} s, epoch with eval {time.perf_counter() - epoch_start:.1f} s"
        )
    if args.compile:
        fabric.print(f"compile: {fabric.compile_report()}")
    # This process's share of the images: its batches of every epoch, and its share of the test images.
    fabric.print(
        closing_lines(args, config, fabric.device, len(train_loader) * args.batch_size, len(test_loader.sampler),
                      train_seconds, test_accuracy, weights, data)
    )  # fmt: skip


if __name__ == "__main__":
    main()
