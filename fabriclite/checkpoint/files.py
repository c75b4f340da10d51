"""Checkpoint files that never lose work: written atomically (a crash mid-write leaves the previous file or folder
whole), read safely (``weights_only`` by default, one clear error for a missing, truncated or corrupt file), and
the ``CheckpointIO`` plugin interface through which strategies write and read single files.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be read: truncated, corrupt, or not a checkpoint."""


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` so that ``path`` holds either the old file or the complete new one.

    The bytes go to a temporary file in the same folder, are flushed and fsynced, and the file is renamed over
    ``path`` (atomic on POSIX and Windows). A crash or SIGKILL mid-write leaves the previous checkpoint intact.
    Usage: ``atomic_save({"model": model.state_dict()}, "last.ckpt")``.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(path)!r}: it is a directory; pass a file path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_load(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Load a file written by ``torch.save``; a missing, truncated or corrupt file raises one clear error naming it.

    ``weights_only=True`` (the default) refuses to run code from the file; pass ``False`` only for trusted files.
    Usage: ``checkpoint = safe_load("last.ckpt")``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint file {str(path)!r} does not exist.")
    if path.is_dir():
        raise CheckpointError(f"Checkpoint path {str(path)!r} is a directory, expected a file written by fabric.save.")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        text = str(err)
        if weights_only and ("Weights only load failed" in text or "weights_only" in text):
            raise CheckpointError(
                f"Checkpoint {str(path)!r} holds objects that weights_only loading refuses. If you trust this file, "
                f"load it with weights_only=False. Original error: {text.splitlines()[0]}"
            ) from err
        raise CheckpointError(
            f"Checkpoint {str(path)!r} could not be read: it is truncated, corrupt or not a torch checkpoint "
            f"({type(err).__name__}: {text.splitlines()[0] if text else ''})."
        ) from err


class CheckpointIO:
    """How one checkpoint file is written and read. Usage: ``Fabric(plugins=[MyCheckpointIO()])``; subclass and
    fill in the three methods (the strategy calls them on rank 0 for saves, on every rank for loads)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        raise NotImplementedError

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True
    ) -> dict[str, Any]:
        raise NotImplementedError

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        remove(Path(path))


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` made atomic (``atomic_save``) and ``torch.load`` made safe (``safe_load``): the default.

    Usage: ``TorchCheckpointIO().save_checkpoint({"step": 1}, "last.ckpt")``.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"TorchCheckpointIO.save_checkpoint takes no storage_options, got {storage_options!r}; write a "
                "CheckpointIO plugin of your own to use them."
            )
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True
    ) -> dict[str, Any]:
        checkpoint = safe_load(path, map_location=map_location, weights_only=weights_only)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(
                f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not the dict fabric.save writes."
            )
        return checkpoint


_RENAME_EXCHANGE = 2


def replace(new: Path, target: Path) -> None:
    """Put ``new`` (a file or directory) at ``target``, which at every moment holds either the old or the new."""
    if not target.exists():
        os.replace(new, target)
    elif not _exchange(new, target):
        # No atomic exchange here (not Linux, or a file system without it): a short window where target is missing.
        old = new.with_name(new.name + ".old")
        os.replace(target, old)
        os.replace(new, target)
        new = old
    fsync_dir(target.parent)
    remove(new)  # now the previous checkpoint


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
