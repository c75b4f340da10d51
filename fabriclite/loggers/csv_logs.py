"""A logger writing metrics to ``metrics.csv`` and hyperparameters to ``hparams.yaml``."""

from __future__ import annotations

import argparse
import atexit
import csv
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

from fabriclite.loggers.base import LoggerError, _number, _params_dict, _VersionedLogger


class CSVLogger(_VersionedLogger):
    """Log to ``root_dir/name/version_N/metrics.csv``, the layout of Lightning Fabric's ``CSVLogger``.

    Rows are buffered and written every ``flush_logs_every_n_steps`` calls to ``log_metrics``, at least every
    10 seconds, on ``save()``, on ``finalize()`` and when the interpreter exits. The header is the union of all
    metric names seen plus ``step``, sorted (as Lightning's); when new names appear, the file is rewritten under the
    wider header. A row logged without a step gets Lightning's: the number of rows buffered and not yet written.

    The first row checks that ``log_dir`` can be written, and raises an ``OSError`` naming it if not. A write that
    fails raises, naming the file and the rows not written; those rows stay buffered, and the next write tries
    again. Rows that cannot be written at exit are reported on stderr, never dropped in silence.

    Usage::

        logger = CSVLogger("logs", name="mnist")
        logger.log_metrics({"loss": 0.25}, step=10)
        logger.finalize("success")
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if (
            not isinstance(flush_logs_every_n_steps, int)
            or isinstance(flush_logs_every_n_steps, bool)
            or flush_logs_every_n_steps < 1
        ):
            raise ValueError(
                f"flush_logs_every_n_steps={flush_logs_every_n_steps!r} is not valid: pass an int >= 1 "
                "(1 writes every row at once, larger values write less often)."
            )
        super().__init__(root_dir, name, version, prefix)
        self._flush_every = flush_logs_every_n_steps
        self._rows: list[dict[str, float]] = []
        self._columns: list[str] = ["step"]
        self._columns_on_disk: list[str] | None = None  # None until this logger first writes the file
        self._rows_logged = 0
        self._hparams: dict[str, Any] = {}
        self._last_save = time.monotonic()
        self._reuse_checked = False

    def _warn_if_replacing(self) -> None:
        # Once, at .experiment or the first row, as Lightning warns; the old file is replaced only at the first write
        # (Lightning deletes it here), so a run that never logs leaves it in place.
        if self._reuse_checked:
            return
        self._reuse_checked = True
        if self._columns_on_disk is None and os.path.isfile(os.path.join(self.log_dir, "metrics.csv")):
            warnings.warn(
                f"Experiment logs directory {self.log_dir} exists and is not empty: its metrics.csv from an earlier "
                "run is replaced when this logger first writes. Pass version=None to log into a new version_N "
                "folder instead.",
                stacklevel=4,
            )

    @property
    def experiment(self) -> _ExperimentWriter:
        """The writer of ``metrics.csv``, as Lightning's ``CSVLogger.experiment``: ``log_metrics(metrics_dict,
        step)`` (no prefix added), ``save()``, ``metrics`` (the buffered rows), ``metrics_file_path``, ``log_dir``.
        As in Lightning, asking for it creates ``log_dir``, so files can be written next to ``metrics.csv``.

        Usage: ``logger.experiment.log_metrics({"loss": 0.25}, step=3)``
        """
        self._warn_if_replacing()
        os.makedirs(self.log_dir, exist_ok=True)
        return _ExperimentWriter(self)

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Buffer one row; ``step`` defaults to the number of rows buffered and not yet written (Lightning's rule).

        Usage: ``logger.log_metrics({"loss": 0.25, "acc": 0.9}, step=100)``
        """
        self._add_row(self._prepare_metrics(metrics), step)

    def _add_row(self, row: dict[str, float], step: int | None) -> None:
        if step is None:
            step = len(self._rows)
        elif hasattr(step, "item") and not isinstance(step, int):
            step = step.item()
        if not isinstance(step, int) or isinstance(step, bool):
            raise TypeError(f"step must be an int or None, got {type(step).__name__}: {step!r}")
        if self._rows_logged == 0 and self._columns_on_disk is None:
            self._check_writable()  # at the first row, as Lightning: not hours later, at the first flush
            self._warn_if_replacing()
        row["step"] = step
        if not row.keys() <= set(self._columns):
            self._columns = sorted(set(self._columns) | row.keys())
        self._rows.append(row)
        self._rows_logged += 1
        _UNSAVED.add(self)
        if len(self._rows) >= self._flush_every or time.monotonic() - self._last_save >= _SAVE_EVERY_S:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Merge ``params`` into ``hparams.yaml`` next to ``metrics.csv`` and write it at once.

        Usage: ``logger.log_hyperparams({"lr": 1e-3, "batch_size": 32})``
        """
        import yaml  # lazily: importing fabriclite.loggers must stay cheap

        self._hparams.update(_params_dict(params))
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, "hparams.yaml"), "w") as file:
            yaml.safe_dump(self._hparams, file, sort_keys=False)

    def save(self) -> None:
        """Write the buffered rows to ``metrics.csv``.

        Usage: ``logger.save()``
        """
        self._last_save = time.monotonic()
        if not self._rows:
            return
        path = os.path.join(self.log_dir, "metrics.csv")
        try:
            self._write(path)
        except OSError as err:
            raise LoggerError(
                err.errno,
                f"{_unwritten(len(self._rows), path, err)}. They stay buffered: the next fabric.log or logger.save() "
                "tries again.",
                path,
            ) from err
        self._rows.clear()
        _UNSAVED.discard(self)

    def _write(self, path: str) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        if self._columns_on_disk == self._columns:
            size = os.path.getsize(path)
            try:
                with open(path, "a", newline="") as file:
                    csv.DictWriter(file, fieldnames=self._columns).writerows(self._rows)
            except OSError:
                os.truncate(path, size)  # no half-written rows: a retry appends them whole
                raise
        else:
            if self._columns_on_disk is None:
                old_rows = []  # an earlier run's file is replaced (the warning came with the first row)
            else:
                with open(path, newline="") as file:
                    old_rows = list(csv.DictReader(file))
            # Write the wider file next to the old one and swap, so a crash mid-rewrite keeps the old rows.
            tmp_path = path + ".tmp"
            with open(tmp_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=self._columns)
                writer.writeheader()
                writer.writerows(old_rows)
                writer.writerows(self._rows)
            os.replace(tmp_path, path)
            self._columns_on_disk = list(self._columns)


_SAVE_EVERY_S = 10.0
_UNSAVED: set[CSVLogger] = set()  # loggers holding rows not yet on disk; saved at exit


@atexit.register
def _save_at_exit() -> None:
    # A script that never calls finalize() still gets its rows. A failure here cannot raise to anyone: say what
    # was lost, where, and why.
    for logger in list(_UNSAVED):
        try:
            logger.save()
        except OSError as err:
            cause = err.__cause__ if isinstance(err.__cause__, OSError) else err
            lost = _unwritten(len(logger._rows), err.filename, cause)
            print(f"fabriclite: {lost}; the run is ending, so these rows are lost.", file=sys.stderr, flush=True)


def _unwritten(rows: int, path: str, err: OSError) -> str:
    return f"CSVLogger could not write {rows} rows to {path}: {err.strerror or err}"


class _ExperimentWriter:
    """``CSVLogger.experiment``: the logger's own buffer and file, seen as Lightning's experiment writer."""

    def __init__(self, logger: CSVLogger) -> None:
        self._logger = logger

    @property
    def log_dir(self) -> str:
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str:
        return os.path.join(self._logger.log_dir, "metrics.csv")

    @property
    def metrics(self) -> list[dict[str, float]]:
        """The rows buffered since the last save."""
        return self._logger._rows

    def log_metrics(self, metrics_dict: Mapping[str, float], step: int | None = None) -> None:
        """Buffer one row as it is (the logger's prefix is not added)."""
        self._logger._add_row({str(key): _number(key, value) for key, value in metrics_dict.items()}, step)

    def save(self) -> None:
        self._logger.save()
