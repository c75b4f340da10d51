"""08 (load): a separate program that reads the checkpoint 08_save_checkpoint.py wrote and tests the model.

The model is built from its class with random weights, set up, and then fabric.load fills it in place. It
reads a single file or an FSDP shard folder alike, on any number of processes, and reports the same test
accuracy the saving script printed. To go on training, add the optimizer to the dict passed to load.

Usage: python examples/vit/08_load_checkpoint.py [--checkpoint PATH] [--devices 1] [--strategy auto]
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, so that `import vit` finds this folder

import torch
from torch.utils.data import DataLoader

from fabriclite import Fabric
from fabriclite.metrics import Accuracy
from vit.data import NUM_CLASSES, load_digits_splits
from vit.model import SERIES_CONFIG, ViT
from vit.series import parse_args, results


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for images, labels in loader:
        accuracy.update(model(images), labels)
    model.train()
    return accuracy.compute().item()


def main():
    args = parse_args(__doc__, checkpoint=True)
    if not args.checkpoint.exists():
        sys.exit(f"no checkpoint at {args.checkpoint}: run 08_save_checkpoint.py first, or pass --checkpoint PATH")
    fabric = Fabric(accelerator="auto", devices=args.devices, strategy=args.strategy, precision="bf16-mixed")
    fabric.launch()

    _, _, test_set = load_digits_splits()
    model = fabric.setup(ViT(SERIES_CONFIG))  # random weights, replaced by the checkpoint's just below
    test_loader = fabric.setup_dataloaders(DataLoader(test_set, batch_size=512))

    start = time.perf_counter()
    remainder = fabric.load(args.checkpoint, {"model": model})
    seconds = time.perf_counter() - start
    fabric.print(f"loaded {args.checkpoint} (trained for {remainder['epochs']} epochs) in {seconds:.2f} s")
    fabric.print(results(seconds, fabric.device, evaluate(model, test_loader, fabric.device), timed="load time"))


if __name__ == "__main__":
    main()
