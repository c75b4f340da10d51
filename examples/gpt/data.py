"""The text the GPT learns, as bytes, and the windows of it that make up a batch.

Nothing is downloaded: by default the text is the Python source of a fixed list of standard-library modules,
read from this interpreter's installation (about 1.4 MB on Python 3.11), so it is the same on every machine with
the same Python version. ``--text PATH`` trains on any file instead. The last 10% is held out for validation.

Usage:
    text = load_text(None)                       # or load_text(Path("my.txt"))
    train, val = split(text)
    train_set = Windows(train, block_size=128)   # every start position: (x, y) with y = x shifted by one
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

# Modules whose source every CPython from 3.9 on has (pathlib and zipfile, which became packages later, are left
# out), so the text only changes when the Python version does.
STDLIB_MODULES = (
    "abc", "argparse", "ast", "bisect", "calendar", "collections", "contextlib", "copy", "csv", "dataclasses",
    "difflib", "enum", "fnmatch", "fractions", "functools", "glob", "heapq", "inspect", "json.decoder",
    "json.encoder", "logging", "operator", "pprint", "queue", "random", "shutil", "statistics", "string",
    "tempfile", "textwrap", "threading", "tokenize", "typing", "unittest.case", "weakref",
)  # fmt: skip


def stdlib_text() -> bytes:
    """The source files of ``STDLIB_MODULES`` in this interpreter's standard library, concatenated in order.

    Read as files, not through imports: some of them (abc, ...) are frozen into the interpreter, yet their source
    is installed all the same. Usage: ``text = stdlib_text()``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in STDLIB_MODULES:
        base = root.joinpath(*name.split("."))
        path = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if not path.is_file():
            raise FileNotFoundError(
                f"The source of the standard-library module {name!r} is not installed under {root}; some "
                "distributions ship .pyc files only. Train on your own text instead: --text PATH."
            )
        parts.append(path.read_bytes())
    return b"\n".join(parts)


def load_text(path: Path | None) -> bytes:
    """The bytes of ``path``, or of the standard-library sources when ``path`` is None.

    Usage: ``text = load_text(Path("input.txt"))``.
    """
    if path is None:
        return stdlib_text()
    if not path.is_file():
        raise FileNotFoundError(
            f"--text {path}: no such file. Pass a text file, or leave --text out to train on the Python "
            "standard library's source."
        )
    return path.read_bytes()


def split(text: bytes, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """The text as a uint8 tensor, cut into (train, val): the last ``val_fraction`` of it is held out.

    Usage: ``train, val = split(text)``.
    """
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    n_val = int(len(data) * val_fraction)
    return data[: len(data) - n_val], data[len(data) - n_val :]


class Windows(Dataset):
    """Windows of ``block_size + 1`` bytes starting every ``stride`` bytes; item i is (input, target shifted by one).

    Training uses ``stride=1``: every position is a possible start, so a shuffled loader draws random windows as
    nanoGPT does, yet through a sampler whose position a checkpoint records. Validation uses ``stride=block_size``
    (windows that do not overlap) and a fixed number of them, so every evaluation sees the same bytes.
    Usage: ``x, y = Windows(train, 128)[0]``.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1, limit: int | None = None) -> None:
        if len(data) < block_size + 1:
            raise ValueError(
                f"The text has {len(data)} bytes in this split, fewer than one window of block_size + 1 = "
                f"{block_size + 1}; use a longer text."
            )
        self.data = data
        self.block_size = block_size
        self.stride = stride
        count = (len(data) - block_size - 1) // stride + 1
        self.count = count if limit is None else min(count, limit)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]
