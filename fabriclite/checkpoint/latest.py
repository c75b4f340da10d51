"""A folder of checkpoints as a run's history: ``newest_complete`` finds the checkpoint a restarted run resumes
from, ``keep_last`` removes the older ones a run no longer needs.

"Complete" means written to the end and verified: the checksums of a file (``verify_file``) or of every file a
folder's manifest lists match. A save killed mid-write leaves only a hidden partial beside its target (see
``files.atomic_write``), which is never a candidate; a file cut short or damaged afterwards fails verification and
is skipped with a warning. "Newest" is the latest modification time (an atomic save sets it when the checkpoint
appears), then the larger number in the name. Nothing that is not a checkpoint fabriclite writes (``is_checkpoint``)
is ever read as one or removed.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from fabriclite.checkpoint.errors import CheckpointError, read_failure
from fabriclite.checkpoint.files import describe, is_checkpoint, remove
from fabriclite.checkpoint.integrity import MANIFEST_FILE, read_manifest, verify_file, verify_folder

# Checkpoints verified by this process, by (path, modification time, size): keep_last does not read them again.
_verified: set[tuple[str, int, int]] = set()


def check_folder(folder: str | os.PathLike) -> Path:
    """``folder`` as a Path; ``ValueError`` naming it when something other than a folder is there."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"fabric.load_latest expects a folder of checkpoints, but {str(folder)!r} is {describe(folder)}. Pass "
            "the folder your checkpoints are saved in (e.g. fabric.save(folder / f'step-{step}.ckpt', state))."
        )
    return folder


def check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(
            f"keep_last={keep_last!r} must be a whole number of checkpoints, 1 or more, or None (keep all)."
        )


def candidates(folder: Path, like: Path | None = None) -> list[Path]:
    """The checkpoints in ``folder``, newest first; with ``like``, only those named as it is but for its numbers
    (``step-0030.ckpt`` is like ``step-0020.ckpt``, not like ``best.ckpt``). Hidden entries (partial saves) are left
    out."""
    pattern = _name_pattern(like.name) if like is not None else None
    try:
        entries = [entry for entry in folder.iterdir() if not entry.name.startswith(".")]
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        if pattern is not None and not pattern.fullmatch(entry.name):
            continue
        if is_checkpoint(entry):
            found.append(entry)
    return sorted(found, key=_age_key, reverse=True)


def problem(path: Path) -> CheckpointError | None:
    """Why ``path`` is not a complete checkpoint (its ``CheckpointError``), or None when it is one."""
    try:
        key = _stat_key(path)
        if key in _verified:
            return None
        if path.is_dir():
            files = read_manifest(path)
            verify_folder(path, sorted(files), files)
        else:
            verify_file(path)
    except CheckpointError as error:
        return error
    except OSError as error:
        return read_failure(path, error)
    _verified.add(key)
    return None


def newest_complete(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``folder``, or None (no folder, or no complete checkpoint in it); every
    newer one that fails verification is named on stderr. Usage: ``path = newest_complete("checkpoints")``."""
    for path in candidates(check_folder(folder)):
        error = problem(path)
        if error is None:
            return path
        print(f"fabriclite: load_latest skips {str(path)!r}: {error}", file=sys.stderr, flush=True)
    return None


def keep_last(saved: str | os.PathLike, count: int) -> list[Path]:
    """Remove the checkpoints beside ``saved`` named like it that are older than its ``count`` newest complete ones
    (``saved`` itself, just written, counts as the newest); return what was removed. A damaged checkpoint newer than
    those is kept and does not count; anything that is not a checkpoint is never touched.

    Usage: ``keep_last("checkpoints/step-0300.ckpt", 3)``.
    """
    saved = Path(saved)
    others = [path for path in candidates(saved.parent, like=saved) if path != saved]
    complete = 1  # saved
    removed = []
    for path in others:
        if complete < count:
            complete += problem(path) is None
            continue
        remove(path)
        removed.append(path)
    return removed


def _name_pattern(name: str) -> re.Pattern:
    parts = re.split(r"\d+", name)
    return re.compile(r"\d+".join(re.escape(part) for part in parts))


def _stat_key(path: Path) -> tuple[str, int, int]:
    target = path / MANIFEST_FILE if path.is_dir() else path
    info = target.stat()
    return str(path.resolve()), info.st_mtime_ns, info.st_size


def _age_key(path: Path) -> tuple[int, list]:
    try:
        target = path / MANIFEST_FILE if path.is_dir() else path
        mtime = target.stat().st_mtime_ns
    except OSError:
        mtime = 0
    numbers = [int(number) for number in re.findall(r"\d+", path.name)]
    return mtime, numbers
