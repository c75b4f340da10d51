"""09: 04 with compile=True and kernels=True: torch.compile, plus fabriclite's Triton kernels on a GPU.

compile=True compiles the model after fabriclite has set it up (TorchInductor: C++ on a CPU, Triton on a
GPU). With compile=True, kernels=True leaves each nn.LayerNorm to inductor, which fuses it better than an
opaque custom op, and says so once; on a CPU the kernels are left out too. The script runs unchanged either
way. The time includes the compilation.

Usage: python examples/vit/09_fabric_compile_kernels.py [--epochs 10] [--devices 1]
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, so that `import vit` finds this folder

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fabriclite import Fabric
from fabriclite.metrics import Accuracy
from vit.data import NUM_CLASSES, load_digits_splits
from vit.model import SERIES_CONFIG, load_pretrained
from vit.series import loop_flops, parse_args, results


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for images, labels in loader:
        accuracy.update(model(images), labels)
    model.train()
    return accuracy.compute().item()


def main():
    args = parse_args(__doc__)
    torch.manual_seed(args.seed)
    fabric = Fabric(accelerator="auto", devices=args.devices, precision="bf16-mixed", compile=True, kernels=True)
    fabric.launch()

    train_set, val_set, test_set = load_digits_splits(train_per_class=args.labels)
    model = load_pretrained(args.weights, SERIES_CONFIG, NUM_CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=512)
    test_loader = DataLoader(test_set, batch_size=512)
    train_loader, val_loader, test_loader = fabric.setup_dataloaders(train_loader, val_loader, test_loader)

    flops = loop_flops(train_loader, val_loader, args.epochs)  # the model FLOPs of the loop, for the MFU
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for images, labels in train_loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
        val_accuracy = evaluate(model, val_loader, fabric.device)
        fabric.print(f"epoch {epoch + 1}/{args.epochs}  loss {loss.item():.3f}  val acc {100 * val_accuracy:.1f}%")
    seconds = time.perf_counter() - start

    fabric.print(results(seconds, fabric.device, evaluate(model, test_loader, fabric.device), flops))


if __name__ == "__main__":
    main()
