"""Pretrain the digits ViT without labels, and save its weights for fine-tuning.

The pretext task is contrastive (SimCLR, Chen et al., 2020): each image in a batch is augmented twice,
and the model learns to tell which of the other 2B - 1 images in the batch is its own twin. Doing so
needs features that survive a shifted, noisy, partly erased digit, which is most of what telling
digits apart needs, so the labels are never used here. (Predicting which of 4 rotations was applied,
the other classic pretext task, learns orientation features that barely transfer on 8x8 digits: we
measured no gain from it.)

Only the training split's images are used, so the test images stay unseen until the final evaluation.

Usage:
    python examples/vit/pretrain.py                         # writes examples/vit/weights/vit_pretrained.pt
    python examples/vit/pretrain.py --epochs 5 --out /tmp/vit.pt
    python examples/vit/pretrain.py --series               # the numbered scripts' larger ViT
or from Python:
    from vit.pretrain import pretrain
    pretrain(fabric, path)  # fabric: a launched fabriclite.Fabric
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from fabriclite import Fabric, seed_everything

if __package__ in (None, ""):  # run as a script: make the `vit` package (this folder) importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vit.data import load_digits_splits  # noqa: E402
from vit.model import SERIES_CONFIG, ViT, ViTConfig  # noqa: E402

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "vit_pretrained.pt"
# The weights the repository ships, so that the demo's first run is as fast as any: what `python examples/demo.py
# --weights examples/vit/pretrained/vit_pretrained.pt` made with nothing there (pretrain() with seed 0 in bf16-mixed,
# 50 epochs, on one 2-core AMD EPYC with AVX-512 BF16; 0.8 MB). This script makes them again, anywhere.
SHIPPED_WEIGHTS = Path(__file__).resolve().parent / "pretrained" / "vit_pretrained.pt"
SERIES_WEIGHTS = DEFAULT_WEIGHTS.with_name("vit_series_pretrained.pt")
# The head maps the CLS features into the space where twins are compared; fine-tuning replaces it.
PROJECTION_DIM = 64
# Picked by accuracy after fine-tuning: temperature 0.2 or 1.0, batches of 64 or 256 all did worse,
# and temperature 0.2 with a 3x higher learning rate collapsed (loss stuck at log(2B - 1)).
EPOCHS = 50
BATCH_SIZE = 128
LEARNING_RATE = 1e-3
TEMPERATURE = 0.5


def augment(images: torch.Tensor, max_shift: int = 1, erase: float = 0.1, noise: float = 0.1) -> torch.Tensor:
    """Return a random view of each image: shifted by up to `max_shift` pixels, a fraction `erase` of the
    pixels set to 0, Gaussian noise added, clamped back to [0, 1].

    Usage: ``view = augment(images)`` with images of shape (B, C, H, W) in [0, 1].
    """
    B, C, H, W = images.shape
    # Shift by padding with background (0) and cutting an H x W window at a random offset per image.
    padded = F.pad(images, (max_shift,) * 4)
    dy, dx = torch.randint(0, 2 * max_shift + 1, (2, B, 1), device=images.device)
    rows = (dy + torch.arange(H, device=images.device))[:, :, None]  # (B, H, 1)
    cols = (dx + torch.arange(W, device=images.device))[:, None, :]  # (B, 1, W)
    batch = torch.arange(B, device=images.device)[:, None, None]
    x = padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)  # (B, C, H, W)
    x = x * (torch.rand_like(x) >= erase)
    return (x + noise * torch.randn_like(x)).clamp(0.0, 1.0)


def contrastive_loss(z: torch.Tensor, temperature: float = TEMPERATURE) -> torch.Tensor:
    """NT-Xent loss for 2B embeddings where row i and row i + B are two views of the same image.

    Usage: ``loss = contrastive_loss(model(torch.cat([augment(x), augment(x)])))``.
    """
    # Cosine similarities in fp32: divided by a temperature < 1 they become large logits, and bf16
    # keeps only about 3 significant digits.
    z = F.normalize(z.float(), dim=1)
    logits = z @ z.T / temperature
    logits.fill_diagonal_(float("-inf"))  # an image is not its own twin
    B = z.shape[0] // 2
    twin = torch.cat([torch.arange(B, 2 * B), torch.arange(B)]).to(z.device)
    return F.cross_entropy(logits, twin)


def save_atomically(state: dict[str, torch.Tensor], path: Path) -> None:
    """Save a state dict so that `path` is either absent, the old file, or the complete new one.

    A `.safetensors` path is written in that format (needs the `safetensors` package), any other with
    torch.save. Usage: ``save_atomically(model.state_dict(), Path("weights/vit.pt"))``.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary file lives in the same folder, so os.replace is a rename within one file system,
    # which is atomic: a run killed mid-write never leaves a truncated file for the next run to load.
    # (Not tempfile.mkstemp: its files are private, mode 0600, and the rename would keep that.)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import save  # to bytes: its save_file makes private (0600) files

            tmp.write_bytes(save(state))
        else:
            torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def pretrain(
    fabric: Fabric,
    path: Path | str = DEFAULT_WEIGHTS,
    config: ViTConfig | None = None,
    epochs: int = EPOCHS,
    batch_size: int = BATCH_SIZE,
    lr: float = LEARNING_RATE,
) -> Path:
    """Pretrain a ViT contrastively on the digits training images and save its state dict to `path`.

    The saved head has PROJECTION_DIM outputs; replace it before fine-tuning. Returns the path written.
    `fabric` must be launched. Seed first (``seed_everything``) for the same weights on every run.
    Usage: ``pretrain(fabric, "examples/vit/weights/vit_pretrained.pt", epochs=50)``.
    """
    path = Path(path)
    config = replace(config or ViTConfig(), num_classes=PROJECTION_DIM)
    model = ViT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    # Keep the unwrapped model: its state dict has plain keys whatever wrapper setup() adds.
    raw_model = model
    model, optimizer = fabric.setup(model, optimizer)

    train, _, _ = load_digits_splits()
    # drop_last: a last batch of a few images gives a much easier task and a noisy step.
    loader = fabric.setup_dataloaders(DataLoader(train, batch_size=batch_size, shuffle=True, drop_last=True))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=max(1, epochs * len(loader)), pct_start=0.1
    )

    model.train()
    for epoch in range(epochs):
        for images, _labels in loader:  # the labels are never looked at
            loss = contrastive_loss(model(torch.cat([augment(images), augment(images)])))
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            scheduler.step()
        if epoch % 10 == 9 or epoch == epochs - 1:
            fabric.print(f"  pretrain epoch {epoch + 1:3d}/{epochs}  contrastive loss {loss.item():.3f}")

    if fabric.is_global_zero:
        save_atomically(raw_model.state_dict(), path)
    fabric.barrier()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--series",
        action="store_true",
        help="the larger ViT of the numbered scripts 00-09 (default out: " + str(SERIES_WEIGHTS.name) + ")",
    )
    parser.add_argument(
        "--out", type=Path, help="where to write the state dict (default: " + DEFAULT_WEIGHTS.name + ")"
    )
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE)
    parser.add_argument("--lr", type=float, default=LEARNING_RATE)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch ops (see examples/demo.py)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    fabric = Fabric(accelerator=args.accelerator, precision=args.precision, devices=1)
    fabric.launch()
    seed_everything(args.seed)
    start = time.perf_counter()
    config, default_out = (SERIES_CONFIG, SERIES_WEIGHTS) if args.series else (ViTConfig(), DEFAULT_WEIGHTS)
    out = args.out or default_out
    path = pretrain(fabric, out, config, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr)
    fabric.print(f"saved pretrained weights to {path} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
