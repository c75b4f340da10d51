"""What a rank that failed tells the supervisor that started it, and what the supervisor makes of it: which rank
failed first, and whether a failure is an earlier attempt's over again (as torchelastic's agent reads the error file
each worker writes, and names the earliest failure the root cause).

- **The rank** (``record``, at ``Fabric`` creation): when ``FAILURE_FILE_ENV`` names a file, an exception that ends
  the process is written there before Python prints it: its type and message, the time, and the number of the
  run's last checkpoint this process saved or loaded (its progress). Nothing else changes.
- **The supervisor** (``read``, ``first``, ``repeats``): a rank killed by a signal failed first (its siblings' errors
  follow from it), then one that exited without a record (``sys.exit``, or before its ``Fabric`` existed), then the
  earliest recorded exception: a rank whose peer died fails in the collective it was in, moments after the peer
  raised. A failure repeats when the rank named had failed in an earlier attempt too (named then or not: when every
  rank raises it, which one comes first may change) with the same exception and message, from the same checkpoint:
  restarting would only do it again (a failure alternating with another, A, B, A, is caught at its second A).

The records live in a private temporary folder (``records_folder``) that goes with the process that made it, also
when that process ends at once from a watching thread (``exit_now``).

Usage: ``record(checkpointer.last_sequence)`` in a rank; ``first([read(path, rank, code), ...])`` in the
supervisor.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Callable, NamedTuple, NoReturn

FAILURE_FILE_ENV = "FABRICLITE_FAILURE_FILE"  # where a rank writes the exception that ended it
_MESSAGE_CHARS = 4000  # enough to tell two exceptions apart; a traceback is printed in full anyway
_folders: list[str] = []  # the record folders this process made (``records_folder``)
os.register_at_fork(after_in_child=_folders.clear)  # a forked child (a DataLoader worker) does not own them


_FOLDER_PREFIX = "fabriclite-failures-"


def records_folder() -> str:
    """A new private folder (mode 700) for the records of the ranks this process starts, deleted when this process
    ends: at exit (registered now, so it runs after the exit handlers registered later) or by ``exit_now``. Its name
    holds this process's PID: a process killed outright (SIGKILL, the OOM killer) cannot delete it, and the next
    run's call deletes it then (``_sweep``).

    Usage: ``folder = records_folder()``, then each rank's ``FAILURE_FILE_ENV`` names a file in it.
    """
    _sweep()
    folder = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
    _folders.append(folder)
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _sweep() -> None:
    # The record folders, this user's, of processes that no longer run.
    root = tempfile.gettempdir()
    try:
        names = [name for name in os.listdir(root) if name.startswith(_FOLDER_PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(_FOLDER_PREFIX) :].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid.isdigit() or os.stat(path).st_uid != os.getuid() or process_running(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether a process of this machine with this PID runs (any user's; a zombie counts until it is reaped).

    Usage: ``process_running(int(pid_in_a_file_name))``.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def exit_now(code: int) -> NoReturn:
    """End this process at once with ``code``, from any thread (``os._exit``: no exit handlers, no waiting for
    threads stuck in native code), after deleting the record folders, which the exit handlers would have.

    Usage: ``exit_now(130)``.
    """
    for folder in _folders:
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(code)


class Failure(NamedTuple):
    """How one rank failed: ``code`` as ``Popen.returncode`` has it (-N: killed by signal N); what it recorded, if it
    did (``error``: "ValueError: message"; ``at``: when, by ``time.time()``; ``progress``: the number of the run's
    last checkpoint it saved or loaded, 0 for none)."""

    rank: int
    code: int
    error: str | None = None
    at: float | None = None
    progress: int | None = None

    def describe(self, node: int | None = None) -> str:
        """In words: "rank 1 exited with code 1 (ValueError: bad batch)", "rank 9 on node 1 was killed by SIGKILL"."""
        where = "" if node is None else f" on node {node}"
        return f"rank {self.rank}{where} {how_it_ended(self.code)}{self.headline()}"

    def headline(self) -> str:
        """The first line of the exception recorded, as " (ValueError: bad batch)", or "" without one."""
        return f" ({self.error.splitlines()[0][:300]})" if self.error else ""


def how_it_ended(returncode: int) -> str:
    """``returncode`` of a process in words: "exited with code 3", "was killed by SIGKILL"."""
    if returncode >= 0:
        return f"exited with code {returncode}"
    try:
        return f"was killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"was killed by signal {-returncode}"


# The one failure hook of this process, and where it reads the progress: the newest Fabric's checkpointer, held
# weakly (it holds the host copy of the state).
_progress: list[Callable[[], Callable[[], int] | None]] = []
_path: list[str] = []  # the file the supervisor asked for, once ``record`` has taken it


def record(progress: Callable[[], int]) -> None:
    """Write the exception that ends this process to ``FAILURE_FILE_ENV``'s file, with ``progress()`` (the number of
    the run's last checkpoint), if a supervisor asked for it. Once per process; a later call only replaces
    ``progress``. Usage: at ``Fabric`` creation."""
    global _hooked
    if not _hooked:
        _hooked = True
        # Taken out of the environment: a process this one starts (a script of its own) must not write here.
        path = os.environ.pop(FAILURE_FILE_ENV, "")
        if path:
            _path[:] = [path]
            previous = sys.excepthook

            def write_then_report(kind: type, error: BaseException, traceback: Any) -> None:
                record_now(error)
                previous(kind, error, traceback)

            sys.excepthook = write_then_report
    _progress[:] = [weakref.WeakMethod(progress) if hasattr(progress, "__self__") else lambda: progress]


_hooked = False


def current_progress() -> int:
    """The number of the run's last checkpoint this process saved or loaded (0: none, or no ``Fabric`` yet).

    Usage: ``{"progress": current_progress()}`` in a failure's record."""
    progress = _progress[-1]() if _progress else None
    return progress() if progress is not None else 0


def record_now(error: BaseException) -> None:
    """Write ``error`` as what ends this process, where a supervisor asked (``record``): also for an end that no
    exception carries, ``exit_now`` from a watching thread. Usage: ``record_now(RuntimeError(why)); exit_now(1)``."""
    if not _path:
        return
    try:
        _write(_path[0], type(error), error, current_progress())
    except Exception:  # the report of the failure must never hide the failure itself
        pass


def _write(path: str, kind: type, error: BaseException, progress: int) -> None:
    if issubclass(kind, KeyboardInterrupt):
        return  # an interrupt is no failure of the run's own
    text = json.dumps(
        {
            "error": f"{kind.__qualname__}: {error}"[:_MESSAGE_CHARS],
            "at": time.time(),
            "progress": int(progress),
        }
    )
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # the supervisor never reads half a record


def read(path: str | os.PathLike, rank: int, code: int) -> Failure:
    """The failure of ``rank`` (exit ``code``) with what it recorded at ``path``, if anything readable is there."""
    try:
        content = json.loads(Path(path).read_text())
        return Failure(rank, code, str(content["error"]), float(content["at"]), int(content["progress"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Failure(rank, code)


def first(failures: list[Failure]) -> Failure:
    """The failure to name among ``failures`` (in the order they were seen): the first a signal killed, else the first
    without a record, else the earliest recorded exception."""

    def order(item: tuple[int, Failure]) -> tuple:
        seen, failure = item
        if failure.code < 0:
            return (0, seen, 0.0)
        if failure.at is None:
            return (1, seen, 0.0)
        return (2, 0, failure.at)

    return min(enumerate(failures), key=order)[1]


def repeats(failure: Failure, previous: list[Failure]) -> bool:
    """Whether ``failure`` is an earlier attempt's over again: an exception recorded the same (type, message), on a
    rank that failed so in an earlier attempt (``previous``, their failures), from the same checkpoint."""
    if failure.error is None:
        return False
    return any(
        (old.rank, old.error, old.progress) == (failure.rank, failure.error, failure.progress) for old in previous
    )
