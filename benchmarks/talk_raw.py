"""The talk's run in raw PyTorch: the bar `examples/vit/10_talk_vit_b16.py` is measured against, in the same session.

The same work as the talk's script on its synthetic data (`--synthetic`): the same command line, the same in-memory
CIFAR-10-shaped images, DataLoader, model (the examples' ViT, made on the device), resizing on the device, AdamW
(fused on a GPU), loss and evaluation after each epoch, timed the same way (from the moment the process started),
ending with the same RESULT line. Only fabriclite is gone: bf16 autocast written out, `loss.backward()`, and with
`--compile` the model wrapped whole in `torch.compile`, as a raw script does it (`--no-compile`: eager, the talk
issue's "raw eager PyTorch"). One process; `--precision` bf16-mixed or 32-true.

Usage:
    python benchmarks/talk_raw.py --synthetic --no-compile    # raw eager PyTorch, the talk's work
    python benchmarks/talk_raw.py --synthetic --compile       # raw torch.compile (empty caches: a cold start)
"""

import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from vit.model import ViT  # noqa: E402
from vit.series import process_seconds  # noqa: E402

# The talk's own argument parsing, data and preprocessing: the two runs do the same work by construction.
_spec = importlib.util.spec_from_file_location("talk", ROOT / "examples" / "vit" / "10_talk_vit_b16.py")
talk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(talk)
PRECISIONS = {"bf16-mixed": torch.bfloat16, "32-true": None}


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device, size: int, dtype) -> float:
    model.eval()
    correct = total = 0
    for images, labels in loader:
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            correct += (model(talk.preprocess(images, size)).argmax(1) == labels).sum().item()
        total += len(labels)
    model.train()
    return correct / max(total, 1)


def main() -> None:
    args = talk.parse_args()
    if not args.synthetic:
        sys.exit("talk_raw.py runs the talk's synthetic work only: pass --synthetic")
    if args.devices != 1:
        sys.exit(f"--devices {args.devices}: talk_raw.py runs one process (the raw baseline of a one-GPU run)")
    if args.precision not in PRECISIONS:
        sys.exit(f"--precision {args.precision!r}: talk_raw.py takes {' or '.join(PRECISIONS)}")
    dtype = PRECISIONS[args.precision]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the talk's script: the few fp32 matmuls left under bf16
    config = talk.random_init_config(args)
    with torch.device(device):
        model = ViT(config)
    train_set, test_set, data = talk.load_data(args)
    print(f"raw PyTorch: examples' ViT (dim {args.dim}, depth {args.depth}); {args.precision}; compile={args.compile}")
    fused = device.type == "cuda" if args.fused_adamw is None else args.fused_adamw
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=fused or None)
    if args.compile:
        model = torch.compile(model)
    options = {"num_workers": args.workers, "pin_memory": device.type == "cuda", "persistent_workers": args.workers > 0}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True, **options)
    test_loader = DataLoader(test_set, batch_size=2 * args.batch_size, **options)
    print(f"setup: {process_seconds():.1f} s since the process started (fused AdamW: {bool(fused)})")

    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        for images, labels in train_loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(talk.preprocess(images, args.image_size)), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        loss_value = loss.item()  # waits for the GPU: the epoch's time is its work
        train_seconds = time.perf_counter() - epoch_start
        test_accuracy = evaluate(model, test_loader, device, args.image_size, dtype)
        print(
            f"epoch {epoch + 1}/{args.epochs}  loss {loss_value:.3f}  test acc {100 * test_accuracy:.1f}%  "
            f"train {train_seconds:.1f} s, epoch with eval {time.perf_counter() - epoch_start:.1f} s"
        )
    model_name = f"raw PyTorch{' + torch.compile' if args.compile else ''}, examples' ViT"
    train_images = len(train_loader) * args.batch_size
    print(
        talk.closing_lines(
            args, config, device, train_images, len(test_set), train_seconds, test_accuracy, model_name, data
        )
    )


if __name__ == "__main__":
    main()
