"""Checkpoint files that never lose work: written atomically (a crash mid-write leaves the previous file or folder
whole, and the next save removes what it left), with the modes the umask gives, read safely (checksums verified,
``weights_only`` by default, one ``CheckpointError`` for whatever is wrong), and the ``CheckpointIO`` plugin
interface through which strategies write and read single files.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, Callable

import torch

from fabriclite.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    first_line,
    read_failure,
    save_failure,
)
from fabriclite.checkpoint.integrity import fill_in_crcs, verify_file


# The name of a save in progress: beside its target, hidden, saying which process on which machine writes it, so a
# later save can tell the leftovers of a killed save (its process is gone) from a save still running.
_HOST = socket.gethostname().replace(os.sep, "_") or "localhost"
_PARTIAL = re.compile(r"\.tmp-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+(\.old)?")


def partial_path(target: Path) -> Path:
    """A fresh name beside ``target`` for a file or folder being written (``remove_stale_partials`` knows it)."""
    return target.with_name(f".{target.name}.tmp-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}")


def remove_stale_partials(target: Path) -> None:
    """Remove what killed saves to ``target`` left beside it: partial files and folders written by a process of
    this machine that no longer runs. Partials of live processes, or of other machines, are left alone."""
    prefix = f".{target.name}"
    try:
        entries = [entry for entry in target.parent.iterdir() if entry.name.startswith(prefix + ".tmp-")]
    except OSError:
        return
    for entry in entries:
        match = _PARTIAL.fullmatch(entry.name[len(prefix) :])
        if match and match["host"] == _HOST and not _running(int(match["pid"])):
            remove(entry)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write(file)`` on a new file beside ``path`` and put it at ``path`` only once complete and fsynced, so
    ``path`` holds either the old file or the whole new one, even after a crash or SIGKILL mid-write. The file
    follows the umask; leftovers of killed saves to ``path`` are removed first. Any failure raises
    ``CheckpointError`` (disk full, permission, ...) and leaves no partial file."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            path, "unwritable", f"Cannot save a checkpoint file to {str(path)!r}: it is a directory; pass a file path."
        )
    tmp = partial_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path)
        with open(tmp, "xb") as f:  # open() applies the umask, as torch.save does
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        failure = save_failure(path, error) if isinstance(error, Exception) else None  # while the disk is still full
        tmp.unlink(missing_ok=True)
        if failure is None or failure is error:
            raise
        raise failure from error
    fsync_dir(path.parent)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` through ``atomic_write``: ``path`` holds the old file or the whole new one.

    Every record of the file carries its CRC-32, where torch stores it, which ``safe_load`` checks.
    Usage: ``atomic_save({"model": model.state_dict()}, "last.ckpt")``.
    """
    from torch.utils.serialization import config

    def write(f: BinaryIO) -> None:
        keep = config.save.compute_crc32
        config.save.compute_crc32 = False  # fill_in_crcs computes them faster, on several threads
        try:
            torch.save(obj, f)
        finally:
            config.save.compute_crc32 = keep
        f.flush()
        fill_in_crcs(Path(f.name))

    atomic_write(path, write)


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


def safe_load(
    path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True, verify: bool = True
) -> Any:
    """Load a file written by ``torch.save``; any problem raises one ``CheckpointError`` naming the file and saying
    what is wrong (missing, truncated, corrupt, unsafe, not a checkpoint).

    ``verify=True`` (the default) checks every record against its stored CRC-32, on other threads while torch
    reads, and raises before anything is returned. ``weights_only=True`` (the default) refuses to run code from the
    file; pass ``False`` only for trusted files. Usage: ``checkpoint = safe_load("last.ckpt")``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(path)
    if path.is_dir():
        raise CheckpointError(
            path,
            "not a checkpoint",
            f"Checkpoint path {str(path)!r} is a directory, expected a file written by fabric.save.",
        )
    check = _in_background(_verify, path) if verify else None
    try:
        result = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as error:
        if check is not None:
            check.result()  # damage found by the checksums explains the failure best
        raise _load_failure(path, error, weights_only) from error
    finally:
        if check is not None:
            check.result()
    return result


def _verify(path: Path) -> None:
    try:
        verify_file(path)
    except OSError as error:
        raise read_failure(path, error) from error


def _in_background(fn: Callable, *args: Any) -> Future:
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with the task
    return future


def _load_failure(path: Path, error: Exception, weights_only: bool) -> CheckpointError:
    text = str(error)
    if weights_only and ("Weights only load failed" in text or "weights_only" in text):
        return CheckpointError(
            path,
            "unsafe",
            f"Checkpoint {str(path)!r} holds objects that weights_only loading refuses. If you trust this file, "
            f"load it with weights_only=False. Original error: {text.splitlines()[0]}",
        )
    if isinstance(error, OSError):
        return read_failure(path, error)
    return CheckpointError(
        path,
        "not a checkpoint",
        f"Checkpoint {str(path)!r} could not be read: it is truncated, corrupt or not a torch checkpoint "
        f"({first_line(error)}).",
    )


class CheckpointIO:
    """How one checkpoint file is written and read. Usage: ``Fabric(plugins=[MyCheckpointIO()])``; subclass and
    fill in the three methods (the strategy calls them on rank 0 for saves, on every rank for loads)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        raise NotImplementedError

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True, verify: bool = True
    ) -> dict[str, Any]:
        """Read the checkpoint at ``path``; ``verify``: check its checksums, if the format has them (a plugin
        whose method lacks this argument is called without it)."""
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
        self, path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True, verify: bool = True
    ) -> dict[str, Any]:
        checkpoint = safe_load(path, map_location=map_location, weights_only=weights_only, verify=verify)
        if not isinstance(checkpoint, dict):
            raise CheckpointError(
                path,
                "not a checkpoint",
                f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not the dict fabric.save writes.",
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
