"""Run or log on rank 0 only (Lightning Fabric has it at ``lightning.fabric.utilities.rank_zero``, and so do we).

``rank_zero_only.rank`` is read from the launch variables (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``,
``JSM_NAMESPACE_RANK``) until a parallel strategy sets it to the process's global rank once the processes run (a
forked or spawned process imported fabriclite before knowing its rank), or the user sets it.

Usage::

    @rank_zero_only
    def save_samples(images): ...
    rank_zero_info("epoch %d done", epoch)
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class _StderrUntilConfigured(logging.Handler):
    """Prints fabriclite's log records (INFO and up, as Lightning Fabric's logger does) to the ``sys.stderr`` of the
    moment, while the application has configured no logging; once the root logger has a handler, records reach
    the application's handlers only, never twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            print(self.format(record), file=sys.stderr)


log = logging.getLogger("fabriclite")
log.setLevel(logging.INFO)
log.addHandler(_StderrUntilConfigured())


def _rank_from_environment() -> int:
    # SLURM_PROCID can be set without SLURM starting the processes, so the launchers' own variables come first.
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"Environment variable {name}={value!r} must be an integer.") from None
    return 0


class _RankZeroOnly:
    """The ``rank_zero_only`` decorator: the decorated function runs on global rank 0 and returns None elsewhere.
    ``rank_zero_only.rank`` is the rank it compares against: set by a parallel strategy (or by you); until then read
    from the launch variables whenever it is asked, so it is right in a process whatever its variables were when
    fabriclite was imported (Lightning reads them when its module is imported). Usage: ``@rank_zero_only``.
    """

    def __init__(self) -> None:
        self._rank: int | None = None

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else _rank_from_environment()

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    def __call__(self, fn: Callable[..., T]) -> Callable[..., T | None]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> T | None:
            return fn(*args, **kwargs) if self.rank == 0 else None

        return wrapped


rank_zero_only = _RankZeroOnly()


@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on rank 0. Usage: ``rank_zero_debug("batch %d", i)``."""
    log.debug(*args, stacklevel=stacklevel, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on rank 0. Usage: ``rank_zero_info("epoch %d done", epoch)``."""
    log.info(*args, stacklevel=stacklevel, **kwargs)


class PossibleUserWarning(UserWarning):
    """A warning about something that may be the user's mistake, or may be intended (Lightning's category, so
    filters written for it work). Usage: ``warnings.filterwarnings("ignore", category=PossibleUserWarning)``."""


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn`` on rank 0 (``category=`` as there). Usage: ``rank_zero_warn("no validation set")``."""
    warnings.warn(message, stacklevel=stacklevel, **kwargs)


def rank_zero_deprecation(message: str | Warning, stacklevel: int = 5, **kwargs: Any) -> None:
    """A ``DeprecationWarning`` on rank 0. Usage: ``rank_zero_deprecation("`old` is deprecated, use `new`")``."""
    kwargs.setdefault("category", DeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, **kwargs)
