"""A folder of checkpoints as a run's history: ``newest_complete`` finds the checkpoint a restarted run resumes
from, ``keep_last`` removes the older ones a run no longer needs.

Every checkpoint ``fabric.save`` writes says which run wrote it and where it falls in that run's history
(``series``, in fabriclite's entry of the checkpoint: the run's id, a sequence number that goes up by one at every
save of the run, across restarts, and the time of the save); this, not the file's modification time, says which
is newest. A requeue onto a host whose clock differs, or a copied folder, leaves the order as it was. What is not
a checkpoint ``fabric.save`` wrote (a ``torch.save`` of something else, a logger's file) is never a candidate and
never removed; ``keep_last`` removes only the run's own checkpoints, never another run's in a shared folder.

"Complete" means written to the end and verified: the checksums of a file (``verify_file``) or of every file a
folder's manifest lists match. A save killed mid-write leaves only a hidden partial beside its target (see
``files.atomic_write``), which is never a candidate. A checkpoint cut short or damaged afterwards (a file whose zip
directory is gone is still known by its first record, which torch writes first) fails verification: ``load_latest``
says so and sets it aside, renamed ``NAME.damaged``, never removed, so that the run goes on from the one before and
its next save of that name finds the name free.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import Iterable, NamedTuple

from fabriclite.checkpoint.errors import CheckpointError, read_failure
from fabriclite.checkpoint.files import META_KEY, describe, is_checkpoint, remove
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


class Series(NamedTuple):
    """What a checkpoint says of its place in a run's history (see the module's docstring), and its top-level keys."""

    run: str | None  # None: saved by a fabriclite from before runs were recorded
    sequence: int
    saved_at: float
    keys: frozenset


# Checkpoints read by this process, by (path, modification time, size): what they say of themselves.
_series: dict[tuple[str, int, int], Series | None] = {}


def series_of(path: Path, weights_only: bool = True) -> Series | None:
    """What the checkpoint at ``path`` says of itself, or None for what ``fabric.save`` did not write (or cannot be
    read: a damaged file). Reads the checkpoint's structure, not its tensors (mapped, not read)."""
    try:
        key = _stat_key(path)
    except OSError:
        return None
    if key not in _series:
        _series[key] = _read_series(path, weights_only)
    return _series[key]


def _read_series(path: Path, weights_only: bool) -> Series | None:
    import torch

    from fabriclite.checkpoint.sharded import STRUCTURE_FILE

    target = path / STRUCTURE_FILE if path.is_dir() else path
    try:
        checkpoint = torch.load(target, map_location="cpu", weights_only=weights_only, mmap=True)
    except Exception:  # cut short (no zip directory)? its first record may still say what it was
        checkpoint = None if target.is_dir() or zipfile.is_zipfile(target) else _structure_of_cut_file(target)
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    if not isinstance(meta, dict):
        return None
    keys = frozenset(key for key in checkpoint if key != META_KEY)
    series = meta.get("series")
    if not isinstance(series, dict):
        return Series(None, -1, float("-inf"), keys)
    try:
        return Series(str(series["run"]), int(series["sequence"]), float(series["saved_at"]), keys)
    except (KeyError, TypeError, ValueError):
        return None


class _Placeholder(dict):
    """What ``_structure_of_cut_file`` makes of every object that is not a plain value (a tensor, an OrderedDict)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:  # any state (a NumPy array's is a tuple): not needed
        pass


class _StructureOnly(pickle.Unpickler):
    # Imports nothing and reads no tensor: every global is a placeholder, so no code of the file can run.
    def find_class(self, module: str, name: str) -> type:
        return _Placeholder

    def persistent_load(self, pid: object) -> None:
        return None


def _structure_of_cut_file(path: Path) -> object:
    """The dicts and plain values of a ``torch.save`` file whose end is missing (no zip directory), read from its
    first record, ``data.pkl``, which torch writes before the tensors; None when that cannot be read either."""
    try:
        with open(path, "rb") as f:
            header = f.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                return None
            name_length, extra_length = struct.unpack("<HH", header[26:30])
            if not f.read(name_length).endswith(b"/data.pkl"):
                return None
            f.seek(extra_length, os.SEEK_CUR)
            return _StructureOnly(f).load()
    except Exception:
        return None


def candidates(
    folder: Path, like: Path | None = None, run: str | None = None, keys: Iterable[str] = (), weights_only: bool = True
) -> list[tuple[Path, Series]]:
    """The checkpoints ``fabric.save`` wrote in ``folder``, newest first: with ``like``, only those named as it is
    but for its numbers (``step-0030.ckpt`` is like ``step-0020.ckpt``, not like ``best.ckpt``); with ``keys``,
    only those holding every key; with ``run``, that run's only, if it has any. Newest: the run saved last (by the
    time recorded in each checkpoint), then the largest sequence number. Hidden entries (partial saves) are left
    out."""
    pattern = _name_pattern(like.name) if like is not None else None
    try:
        entries = [entry for entry in folder.iterdir() if not entry.name.startswith(".")]
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        if (pattern is not None and not pattern.fullmatch(entry.name)) or _SET_ASIDE.search(entry.name):
            continue
        if not is_checkpoint(entry) and not (entry.is_file() and _structure_of_cut_file(entry) is not None):
            continue
        series = series_of(entry, weights_only)
        if series is not None:
            found.append((entry, series))
    lacking = [(path, sorted(set(keys) - series.keys)) for path, series in found if not set(keys) <= series.keys]
    for path, missing in lacking:
        print(f"fabriclite: load_latest passes over {str(path)!r}: it has no {', '.join(map(repr, missing))}, which "
              "the state asks for.", file=sys.stderr, flush=True)  # fmt: skip
    found = [(path, series) for path, series in found if set(keys) <= series.keys]
    if run is not None and any(series.run == run for _, series in found):
        found = [(path, series) for path, series in found if series.run == run]
    last_save = {}
    for _, series in found:
        last_save[series.run] = max(last_save.get(series.run, float("-inf")), series.saved_at)
    found.sort(key=lambda item: (last_save[item[1].run], item[1].sequence, _numbers(item[0])), reverse=True)
    return found


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


def newest_complete(
    folder: str | os.PathLike, run: str | None = None, keys: Iterable[str] = (), weights_only: bool = True
) -> Path | None:
    """The newest complete checkpoint in ``folder`` (of the run ``run``, if it has any there; holding every key of
    ``keys``), or None (no folder, or no such checkpoint in it); every newer one that fails verification is named
    on stderr and set aside (``set_aside``), so the run can go on.
    Usage: ``path = newest_complete("checkpoints", keys=state)``."""
    for path, _ in candidates(check_folder(folder), run=run, keys=keys, weights_only=weights_only):
        error = problem(path)
        if error is None:
            return path
        try:
            done = f"set aside as {set_aside(path).name!r}"
        except OSError as failure:
            done = f"skipped (it could not be set aside: {failure.strerror or failure})"
        print(f"fabriclite: load_latest: {str(path)!r} is damaged, {done}: {error}", file=sys.stderr, flush=True)
    return None


def set_aside(path: Path) -> Path:
    """Rename the damaged checkpoint at ``path`` to ``NAME.damaged`` (or ``NAME.damaged-2``, ...) beside it, never a
    candidate again, never removed, and return the new path: a later save may then use its name again."""
    for number in range(1, 1000):
        aside = path.with_name(f"{path.name}.damaged" + (f"-{number}" if number > 1 else ""))
        if not aside.exists() and not aside.is_symlink():
            os.rename(path, aside)
            return aside
    raise FileExistsError(errno.EEXIST, f"{path.name}.damaged-1 to -999 are all taken", str(path))


def keep_last(saved: str | os.PathLike, count: int, run: str | None = None) -> list[Path]:
    """Remove the checkpoints of the run ``run`` (by default, the run that wrote ``saved``) beside ``saved`` named
    like it that are older than its ``count`` newest complete ones (``saved`` itself, just written, counts as the
    newest); return what was removed. A damaged checkpoint newer than those is kept and does not count; another
    run's checkpoints, and anything that is not a checkpoint ``fabric.save`` wrote, are never touched.

    Usage: ``keep_last("checkpoints/step-0300.ckpt", 3)``.
    """
    saved = Path(saved)
    if run is None:
        mine = series_of(saved)
        run = mine.run if mine is not None else None
    if run is None:  # nothing says which run `saved` belongs to: remove nothing
        return []
    siblings = candidates(saved.parent, like=saved, run=run)
    others = [path for path, series in siblings if path != saved and series.run == run]
    complete = 1  # saved
    removed = []
    for path in others:
        if complete < count:
            complete += problem(path) is None
            continue
        remove(path)
        removed.append(path)
    return removed


_SET_ASIDE = re.compile(r"\.damaged(-\d+)?$")  # set_aside's names


def _name_pattern(name: str) -> re.Pattern:
    parts = re.split(r"\d+", name)
    return re.compile(r"\d+".join(re.escape(part) for part in parts))


def _stat_key(path: Path) -> tuple[str, int, int]:
    target = path / MANIFEST_FILE if path.is_dir() else path
    info = target.stat()
    return str(path.resolve()), info.st_mtime_ns, info.st_size


def _numbers(path: Path) -> list[int]:
    return [int(number) for number in re.findall(r"\d+", path.name)]
