"""How a checkpoint failure reaches the user: always as ``CheckpointError`` (an ``Exception``), naming the path and
what is wrong with it, with torch's or the operating system's error chained; and, in a multi-process run, raised on
every rank at once, so no rank is left waiting in a collective for one that failed.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any, Callable

# What can be wrong; ``CheckpointError.reason`` is one of these.
REASONS = (
    "missing",
    "truncated",
    "incomplete",
    "corrupt",
    "unsafe",
    "not a checkpoint",
    "disk full",
    "permission denied",
    "unwritable",
    "unreadable",
    "occupied",
    "mismatch",
)


class CheckpointError(RuntimeError):
    """A checkpoint that could not be saved or loaded: ``path`` names it, ``reason`` says what is wrong (one of
    ``REASONS``). Usage: ``except CheckpointError as err: print(err.reason, err.path)``."""

    def __init__(self, path: str | os.PathLike, reason: str, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"CheckpointError reason {reason!r} is not one of {REASONS}.")
        super().__init__(message)
        self.path = str(path)
        self.reason = reason

    def __reduce__(self) -> tuple:  # so the error travels between processes (broadcast, spawn) intact
        return type(self), (self.path, self.reason, str(self))


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist; also a ``FileNotFoundError``, as torch and Lightning raise."""

    def __init__(self, path: str | os.PathLike, reason: str = "missing", message: str = "") -> None:
        super().__init__(path, reason, message or f"Checkpoint {str(path)!r} does not exist.")


def mismatch(path: str | os.PathLike, message: str, like: type[Exception] = RuntimeError) -> CheckpointError:
    """A ``CheckpointError`` (reason "mismatch": the checkpoint does not fit what it is loaded into) that is also an
    instance of ``like``, the type torch or Lightning raises there (``KeyError`` for a missing key, ``RuntimeError``
    for a size mismatch, ``ValueError`` for an optimizer of other parameter groups), so ``except CheckpointError``
    and ``except like`` both catch it. Usage: ``raise mismatch(path, "...", KeyError) from error``."""
    return error_like(like)(path, "mismatch", message)


def error_like(like: type[Exception]) -> type[CheckpointError]:
    """The subclass of ``CheckpointError`` and ``like`` (``CheckpointError`` itself where it already is one, or
    where ``like`` cannot be combined with it); picklable, so it travels between processes."""
    if issubclass(CheckpointError, like):
        return CheckpointError
    if like not in _CLASSES:
        try:
            _CLASSES[like] = type(
                f"Checkpoint{like.__name__}",
                (CheckpointError, like),
                {"__str__": BaseException.__str__, "__reduce__": _reduce_mixed, "__module__": __name__},
            )
        except TypeError:  # a type that cannot be combined with RuntimeError
            return CheckpointError
    return _CLASSES[like]


_CLASSES: dict[type, type] = {}


def _reduce_mixed(error: CheckpointError) -> tuple:
    like = next(base for base in type(error).__bases__ if base is not CheckpointError)
    return _rebuild, (like, error.path, error.reason, str(error))


def _rebuild(like: type[Exception], path: str, reason: str, message: str) -> CheckpointError:
    return error_like(like)(path, reason, message)


def save_failure(path: Path, error: BaseException, plugin: bool = False) -> CheckpointError:
    """The ``CheckpointError`` for a save of ``path`` that failed with ``error``: a full disk, a refused permission,
    or anything else, saying that the previous checkpoint at ``path`` (if any) is untouched, or with ``plugin`` (a
    ``CheckpointIO`` plugin wrote it, which fabriclite cannot vouch for) that the plugin decides what is left."""
    if isinstance(error, CheckpointError):
        return error
    kept = (
        "A CheckpointIO plugin wrote it: whether it left a partial file or changed a previous checkpoint there is "
        "up to the plugin."
        if plugin
        else "The previous checkpoint there, if any, is intact and no partial file was left behind."
    )
    if _disk_full(path, error):
        free = _free_bytes(path)
        where = f" ({free / 2**20:.1f} MiB free on its file system)" if free is not None else ""
        return CheckpointError(
            path, "disk full", f"Could not save checkpoint {str(path)!r}: no space left on device{where}. {kept}"
        )
    if _errno_in_chain(error, {errno.EACCES, errno.EPERM, errno.EROFS}):
        return CheckpointError(
            path, "permission denied", f"Could not save checkpoint {str(path)!r}: permission denied ({error}). {kept}"
        )
    return CheckpointError(path, "unwritable", f"Could not save checkpoint {str(path)!r}: {first_line(error)}. {kept}")


def read_failure(path: Path, error: BaseException) -> CheckpointError:
    """The ``CheckpointError`` for a file or folder at ``path`` that exists but could not be read."""
    if isinstance(error, CheckpointError):
        return error
    if _errno_in_chain(error, {errno.EACCES, errno.EPERM}):
        return CheckpointError(path, "permission denied", f"Cannot read checkpoint {str(path)!r}: {error}.")
    return CheckpointError(path, "unreadable", f"Cannot read checkpoint {str(path)!r}: {first_line(error)}.")


def agreed(strategy: Any, rank_zero_work: Callable[[], Any], path: Path, fail: Callable = save_failure) -> Any:
    """Run ``rank_zero_work`` on rank 0 and return its result on every rank; if it fails, every rank raises the same
    ``CheckpointError`` (built by ``fail(path, error)``), instead of the others waiting forever for rank 0."""
    outcome: Any = None
    if strategy.is_global_zero:
        try:
            outcome = ("ok", rank_zero_work())
        except Exception as error:
            failure = fail(path, error)
            if failure is not error:
                failure.__cause__ = error
            outcome = ("failed", failure)
    status, value = strategy.broadcast(outcome)
    if status == "failed":
        raise outcome[1] if strategy.is_global_zero else value  # rank 0's own object keeps its cause
    return value


def first_line(error: BaseException) -> str:
    """``Type: first line of the message`` of ``error``: enough to say what torch or the OS reported."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__


def _chain(error: BaseException | None):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        for inner in dcp_failures(error):
            yield from _chain(inner)
        error = error.__cause__ or error.__context__


def is_dcp_failure(error: BaseException) -> bool:
    """Whether ``error`` is torch.distributed.checkpoint's ``CheckpointException`` (a ``BaseException``, which
    ``except Exception`` lets through)."""
    return type(error).__name__ == "CheckpointException" and hasattr(error, "failures")


def dcp_failures(error: BaseException) -> list[BaseException]:
    """The errors of each rank inside a DCP ``CheckpointException`` (which keeps them as (error, traceback))."""
    if not is_dcp_failure(error):
        return []
    found = []
    for value in error.failures.values():
        inner = value[0] if isinstance(value, tuple) and value else value
        if isinstance(inner, BaseException):
            found.append(inner)
    return found


def _errno_in_chain(error: BaseException, numbers: set[int]) -> bool:
    return any(isinstance(e, OSError) and e.errno in numbers for e in _chain(error))


def _disk_full(path: Path, error: BaseException) -> bool:
    if _errno_in_chain(error, {errno.ENOSPC, errno.EDQUOT}):
        return True
    if any("No space left on device" in str(e) for e in _chain(error)):
        return True
    # torch's writer reports a short write as "unexpected pos", without the errno: ask the file system.
    free = _free_bytes(path)
    return free is not None and free < 2**20


def _free_bytes(path: Path) -> int | None:
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None
