"""00: train the ViT from random weights in plain PyTorch, the same budget as 01 but without pretraining.

Everything but the first weights is as in 01_raw_pretrained.py; the gap between their test accuracies is
what the pretraining (examples/vit/pretrain.py, which never sees a label) is worth.

Usage: python examples/vit/00_raw_random_init.py [--epochs 10]
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # examples/, so that `import vit` finds this folder

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fabriclite.metrics import Accuracy
from vit.data import NUM_CLASSES, load_digits_splits
from vit.model import SERIES_CONFIG, ViT
from vit.series import loop_flops, one_device, parse_args, results


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    accuracy = Accuracy(task="multiclass", num_classes=NUM_CLASSES).to(device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        accuracy.update(model(images), labels)
    model.train()
    return accuracy.compute().item()


def main():
    args = parse_args(__doc__)
    torch.manual_seed(args.seed)
    device = one_device(args.devices)  # plain PyTorch: one process, on a GPU if there is one

    train_set, val_set, test_set = load_digits_splits(train_per_class=args.labels)
    model = ViT(SERIES_CONFIG)  # random weights: no pretraining
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_set, batch_size=512)
    test_loader = DataLoader(test_set, batch_size=512)

    flops = loop_flops(train_loader, val_loader, args.epochs)  # the model FLOPs of the loop, for the MFU
    start = time.perf_counter()
    for epoch in range(args.epochs):
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        val_accuracy = evaluate(model, val_loader, device)
        print(f"epoch {epoch + 1}/{args.epochs}  loss {loss.item():.3f}  val acc {100 * val_accuracy:.1f}%")
    seconds = time.perf_counter() - start

    print(results(seconds, device, evaluate(model, test_loader, device), flops))


if __name__ == "__main__":
    main()
