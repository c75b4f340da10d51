"""Checkpoint files that never lose work: written atomically (a crash mid-write leaves the previous file or folder
whole, and the next save removes what it left), never over anything but a checkpoint we wrote
(``check_replaceable``), with the modes the umask gives, read safely (checksums verified, ``weights_only`` by
default, one ``CheckpointError`` for whatever is wrong), and the ``CheckpointIO`` plugin interface through which
strategies write and read single files.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import socket
import stat
import zipfile
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
from fabriclite.checkpoint.integrity import MANIFEST_FILE, fill_in_crcs, read_manifest, verify_file
from fabriclite.processes.failures import process_running


# The name of a save in progress: beside its target, hidden, saying which process on which machine writes it, and,
# for a checkpoint fabric.save writes, which save of which run (a hash of the run's id, its sequence number), so a
# later save can tell the leftovers of a killed save from a save still running, on this machine or any other.
_HOST = socket.gethostname().replace(os.sep, "_") or "localhost"
_WRITER = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]+(?:\.s(?P<run>[0-9a-f]{12})-(?P<sequence>\d+))?(?:\.old)?")


# Where fabric.save keeps what it adds to the user's state: random streams, the loss scaler, the run's series.
META_KEY = "__fabriclite__"


def series_tag(checkpoint: Any) -> tuple[str, int] | None:
    """Which save of which run ``checkpoint`` is, for the names of its partial files: (a hash of the run's id, the
    sequence number), or None for what ``fabric.save`` did not make."""
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    series = meta.get("series") if isinstance(meta, dict) else None
    try:
        return hashlib.sha1(str(series["run"]).encode()).hexdigest()[:12], int(series["sequence"])
    except (TypeError, KeyError, ValueError):
        return None


def partial_path(target: Path, series: tuple[str, int] | None = None) -> Path:
    """A fresh name beside ``target`` for a file or folder being written (``remove_stale_partials`` knows it), for the
    save ``series`` (``series_tag``) if given."""
    tag = f".s{series[0]}-{series[1]}" if series else ""
    return target.with_name(f".{target.name}.tmp-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}{tag}")


def remove_stale_partials(target: Path, series: tuple[str, int] | None = None) -> None:
    """Remove what killed saves left in ``target``'s folder (partial files and folders named by ``partial_path``,
    also a partial of a partial, left by a killed replacement of a folder; nothing else): those written by a
    process of this machine that no longer runs, and, on any machine, those of the run that ``series`` (the save
    about to write) belongs to, with its number or an earlier one: a run makes one save at a time, and this one has
    not begun to write, so those are of saves that ended or were killed (a restart, a requeue onto other hosts)."""
    try:
        entries = [entry for entry in target.parent.iterdir() if entry.name.startswith(".")]
    except OSError:
        return
    for entry in entries:
        writer = _writer(entry.name)
        if writer is None:
            continue
        dead_here = writer["host"] == _HOST and not process_running(int(writer["pid"]))
        earlier = series is not None and writer["run"] == series[0] and int(writer["sequence"]) <= series[1]
        if dead_here or earlier:
            remove(entry)


def _writer(name: str) -> re.Match | None:
    # ".last.ckpt.tmp-<writer>", or "..last.ckpt.tmp-<writer>.tmp-<writer>" (a partial written inside a partial's
    # name): the first writer made them all.
    head, tmp, rest = name.partition(".tmp-")
    if not tmp or len(head) < 2:
        return None
    writers = [_WRITER.fullmatch(part) for part in rest.split(".tmp-")]
    return writers[0] if all(writers) else None


# What is at a checkpoint path before a save: only a checkpoint fabriclite writes may be replaced, never a user's file.
# torch.save's legacy (non-zip) format starts with this pickled magic number.
_LEGACY_TORCH_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint in a format fabriclite writes, so a save may replace it: a ``torch.save``
    file (a zip archive with a ``data.pkl`` record, or torch's legacy format), or a sharded folder with a valid
    ``manifest.json`` that lists every file in the folder (a file added to it by hand makes it not ours).

    Reads only the zip directory or the manifest, never unpickles. A symbolic link is never a checkpoint (saving
    replaces the link, not the file it points to). Usage: ``if is_checkpoint("runs/last.ckpt"): ...``.
    """
    return _kind(Path(path)) in ("checkpoint file", "checkpoint folder")


def describe(path: str | os.PathLike) -> str:
    """What is at ``path``, in a few words for an error message: "nothing", "an empty folder", "a folder with 3
    entries: a.txt, b/, c.ckpt", "a text file of 120 bytes beginning 'epoch 1 ...'", "a checkpoint file of 4.0 MiB",
    "a symbolic link to 'x'", ... Usage: ``raise ValueError(f"{path} holds {describe(path)}")``."""
    path = Path(path)
    kind = _kind(path)
    if kind == "nothing":
        return "nothing"
    if kind == "link":
        return f"a symbolic link to {os.readlink(path)!r}"
    if kind in ("folder", "checkpoint folder", "empty folder"):
        if kind == "empty folder":
            return "an empty folder"
        entries = _entries(path)
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        what = "a sharded checkpoint folder" if kind == "checkpoint folder" else "a folder"
        return f"{what} with {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}: {shown}"
    if kind == "other":
        return _special_kind(path)
    size = _size(path)
    if kind == "empty file":
        return "an empty file"
    if kind == "checkpoint file":
        return f"a checkpoint file of {size}"
    head = _head(path, 512)
    if head is None:
        return f"a file of {size} that cannot be read"
    if kind == "zip":
        return f"a zip archive of {size} (not torch.save's format)"
    if head.startswith(b"\x80") and len(head) > 1 and head[1] <= 5:
        return f"a pickle file of {size} (not torch.save's format)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return f"a binary file of {size}"
    first = text.strip().splitlines()[0][:40] if text.strip() else ""
    return f"a text file of {size}" + (f" beginning {first!r}" if first else "")


def check_replaceable(path: str | os.PathLike) -> None:
    """Raise ``CheckpointError`` (reason "occupied"), naming ``path`` and what is there, unless a save may put a
    checkpoint at ``path``: nothing is there, an empty folder, or a checkpoint fabriclite writes (``is_checkpoint``).
    Touches nothing. Usage: ``check_replaceable(path)`` before writing, on the rank that writes."""
    path = Path(path)
    kind = _kind(path)
    if kind in ("nothing", "empty folder", "checkpoint file", "checkpoint folder"):
        return
    inside = f"pass a path inside it (such as {str(path / 'last.ckpt')!r}), " if kind == "folder" else ""
    raise CheckpointError(
        path,
        "occupied",
        f"Will not save a checkpoint to {str(path)!r}: {describe(path)} is there, and fabric.save replaces only a "
        f"checkpoint it wrote. Nothing was changed. To save, {inside}choose another path, or move that away first.",
    )


def _kind(path: Path) -> str:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return "nothing"
    except OSError:
        return "other"
    if stat.S_ISLNK(mode):
        return "link"
    if stat.S_ISDIR(mode):
        entries = _entries(path)
        if not entries:
            return "empty folder"
        return "checkpoint folder" if _is_checkpoint_folder(path, entries) else "folder"
    if not stat.S_ISREG(mode):
        return "other"
    if path.lstat().st_size == 0:
        return "empty file"
    head = _head(path, len(_LEGACY_TORCH_MAGIC))
    if head == _LEGACY_TORCH_MAGIC:
        return "checkpoint file"
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return "file"
    return "checkpoint file" if any(name.endswith("/data.pkl") for name in names) else "zip"


def _entries(folder: Path) -> list[str]:
    try:
        return sorted(
            entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else "") for entry in folder.iterdir()
        )
    except OSError:
        return ["(unreadable)"]


def _is_checkpoint_folder(folder: Path, entries: list[str]) -> bool:
    if MANIFEST_FILE not in entries:
        return False
    try:
        listed = read_manifest(folder)
    except (CheckpointError, OSError):
        return False
    return all(
        name == MANIFEST_FILE or (name in listed and stat.S_ISREG((folder / name).lstat().st_mode)) for name in entries
    )


def _head(path: Path, size: int) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return None


def _size(path: Path) -> str:
    size = path.lstat().st_size
    return f"{size} bytes" if size < 2**20 else f"{size / 2**20:.1f} MiB"


def _special_kind(path: Path) -> str:
    mode = path.lstat().st_mode
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def atomic_write(
    path: str | os.PathLike, write: Callable[[BinaryIO], None], series: tuple[str, int] | None = None
) -> None:
    """Call ``write(file)`` on a new file beside ``path`` and put it at ``path`` only once complete and fsynced, so
    ``path`` holds either the old file or the whole new one, even after a crash or SIGKILL mid-write. The file
    follows the umask; leftovers of killed saves beside ``path`` are removed first (``remove_stale_partials``, for
    the save ``series``). Any failure raises ``CheckpointError`` (disk full, permission, ...) and leaves no partial
    file."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            path, "unwritable", f"Cannot save a checkpoint file to {str(path)!r}: it is a directory; pass a file path."
        )
    tmp = partial_path(path, series)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path, series)
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

    atomic_write(path, write, series_tag(obj))


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
    path: str | os.PathLike,
    map_location: Any = "cpu",
    weights_only: bool = True,
    verify: bool = True,
    mmap: bool = False,
) -> Any:
    """Load a file written by ``torch.save``; any problem raises one ``CheckpointError`` naming the file and saying
    what is wrong (missing, truncated, corrupt, unsafe, not a checkpoint).

    ``verify=True`` (the default) checks every record against its stored CRC-32, on other threads while torch
    reads, and raises before anything is returned. ``weights_only=True`` (the default) refuses to run code from the
    file; pass ``False`` only for trusted files. ``mmap=True`` leaves the tensors in the file (torch's ``mmap``):
    their pages are read when touched. Usage: ``checkpoint = safe_load("last.ckpt")``.
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
        result = torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    except Exception as error:
        if check is not None:
            check.result()  # damage found by the checksums explains the failure best
        raise _load_failure(path, error, weights_only) from error
    finally:
        if check is not None:
            check.result()
    return result


def lazy_load(path: str | os.PathLike, weights_only: bool = True, verify: bool = True) -> Any:
    """Load a ``torch.save`` file without reading its tensors into memory: they stay in the file (mapped, read
    when touched), so taking one tensor of a large checkpoint costs that tensor only (Lightning Fabric's
    ``utilities.load._lazy_load``). A file in torch's old, pre-zip format cannot be mapped and is read whole. The
    checksums are still verified (a sequential read that fills no memory); ``weights_only`` refuses code, as in
    ``safe_load``. Usage: ``state = lazy_load("lit_model.pth"); state["lm_head.weight"]``.
    """
    return safe_load(path, weights_only=weights_only, verify=verify, mmap=zipfile.is_zipfile(path))


class NotYetLoadedTensor:
    """Lightning's lazily loaded tensor type (``utilities.load._NotYetLoadedTensor``), for code that names it in
    type hints and ``isinstance`` checks. ``lazy_load`` returns real tensors whose data stays in the file until
    touched (torch's ``mmap``), so no object of this type is ever made."""


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
    if isinstance(error, OSError):
        return read_failure(path, error)
    if _kind(path) != "checkpoint file":
        # A log, a text file, a plain pickle: say what it is. weights_only=False would only fail later, unsafely.
        return CheckpointError(
            path,
            "not a checkpoint",
            f"{str(path)!r} is not a checkpoint: it is {describe(path)}, not a file written by fabric.save or "
            "torch.save (or one cut short or damaged beyond recognition).",
        )
    text = str(error)
    if weights_only and ("Weights only load failed" in text or "weights_only" in text):
        return CheckpointError(
            path,
            "unsafe",
            f"Checkpoint {str(path)!r} holds objects that weights_only loading refuses. If you trust this file, "
            f"load it with weights_only=False. Original error: {text.splitlines()[0]}",
        )
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


def writes_atomically(checkpoint_io: CheckpointIO) -> bool:
    """Whether ``checkpoint_io`` writes with ``TorchCheckpointIO``'s own atomic write (not a plugin's, which may
    leave a partial file or change the previous checkpoint when it fails)."""
    return type(checkpoint_io).save_checkpoint is TorchCheckpointIO.save_checkpoint


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
