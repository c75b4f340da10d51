"""Run or log on rank 0 only (Lightning Fabric has it at ``lightning.fabric.utilities.rank_zero``, and so do we).

``rank_zero_only.rank`` is read from the launch variables when this module is imported, and Fabric sets it to the
process's global rank once the processes run (a forked or spawned process imported it before knowing its rank).

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


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., T | None]:
    """Decorate ``fn`` so that it runs on global rank 0 and returns None elsewhere; ``rank_zero_only.rank`` is the
    rank it compares against. Usage: ``@rank_zero_only`` above a function."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> T | None:
        return fn(*args, **kwargs) if rank_zero_only.rank == 0 else None

    return wrapped


rank_zero_only.rank = _rank_from_environment()  # type: ignore[attr-defined]


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
