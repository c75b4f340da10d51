"""The logger interface and the helpers the file-based loggers share.

A logger receives plain python numbers: the Fabric calls ``.item()`` on tensors and only calls loggers
on global rank 0, so nothing here knows about devices or ranks.
"""

from __future__ import annotations

import argparse
import numbers
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

_SEPARATOR = "-"  # joins a logger's prefix and a metric name, as Lightning does: "train-loss"


class Logger(ABC):
    """Where metrics and hyperparameters go. Subclass it to send them somewhere new.

    Usage::

        class PrintLogger(Logger):
            name, version = "print", 0
            def log_metrics(self, metrics, step=None): print(step, metrics)
            def log_hyperparams(self, params): print(params)
    """

    @property
    @abstractmethod
    def name(self) -> str | None:
        """The experiment name."""

    @property
    @abstractmethod
    def version(self) -> int | str | None:
        """The experiment version."""

    @property
    def root_dir(self) -> str | None:
        """The folder holding all versions of this experiment, if the logger writes files."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The folder this run writes to, if the logger writes files."""
        return None

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Record scalar ``metrics`` at ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: Mapping[str, Any] | argparse.Namespace) -> None:
        """Record the run's hyperparameters."""

    def save(self) -> None:  # noqa: B027 - optional hook, loggers without a buffer have nothing to write
        """Write out anything still buffered."""

    def finalize(self, status: str) -> None:
        """Called once at the end of the run; ``status`` is e.g. ``"success"`` or ``"failed"``."""
        self.save()


class LoggerError(OSError):
    """A logger could not write its files: ``.filename`` is the file or folder, ``.errno`` the system's code, and
    the message says what to do. Usage: ``except LoggerError as err: print(err.filename)``."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class _VersionedLogger(Logger):
    """A logger writing under ``root_dir/name/version_N``, the folder layout of Lightning's loggers."""

    def __init__(
        self,
        root_dir: str | os.PathLike,
        name: str | None,
        version: int | str | None,
        prefix: str,
        expand: bool = False,
    ) -> None:
        is_folder_name = isinstance(version, str) and version != ""
        is_number = isinstance(version, int) and not isinstance(version, bool) and version >= 0
        if not (version is None or is_folder_name or is_number):
            raise ValueError(
                f"version={version!r} is not valid: pass None to use the next free version_N folder, "
                "an int N >= 0 for version_N, or a non-empty str used as the folder name as is."
            )
        self._given_root_dir = os.fspath(root_dir)  # what root_dir returns, as in Lightning
        # Where the files go: with ``expand``, variables and a leading "~" expanded (TensorBoardLogger, as Lightning).
        self._root_dir = (
            os.path.expanduser(os.path.expandvars(self._given_root_dir)) if expand else self._given_root_dir
        )
        self._name = name or ""
        self._version = version
        self._prefix = prefix

    @property
    def name(self) -> str:
        """The experiment name, the folder under ``root_dir`` (empty for none)."""
        return self._name

    @property
    def version(self) -> int | str:
        """The run's version; when none was given, the next free ``version_N`` number, fixed on first use."""
        if self._version is None:
            self._version = _next_version(self._experiment_dir)
        return self._version

    @property
    def root_dir(self) -> str:
        """The ``root_dir`` argument as given, as in Lightning (the versions of this experiment are in
        ``root_dir/name``; ``log_dir`` is where this run writes)."""
        return self._given_root_dir

    @property
    def _experiment_dir(self) -> str:
        return os.path.join(self._root_dir, self._name) if self._name else self._root_dir

    @property
    def log_dir(self) -> str:
        """The folder this run writes to: ``root_dir/name/version_N`` (expanded where the logger expands), or the
        str version as is instead of ``version_N``."""
        version = self.version if isinstance(self.version, str) else f"version_{self.version}"
        return os.path.join(self._experiment_dir, version)

    def _check_writable(self) -> None:
        """Create ``log_dir``, or raise an ``OSError`` naming it and what is in the way (a file where a folder
        should be, no permission, a read-only file system)."""
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            probe = os.path.join(self.log_dir, f".write-test-{os.getpid()}")
            with open(probe, "w"):
                pass
            os.remove(probe)
        except OSError as err:
            in_the_way = isinstance(err, (FileExistsError, NotADirectoryError))
            reason = "a file is where a folder should be" if in_the_way else (err.strerror or str(err))
            raise LoggerError(
                err.errno,
                f"{type(self).__name__} cannot write into {self.log_dir}: {reason}. Pass a root_dir it can create "
                "and write, or remove what is in the way.",
                self.log_dir,
            ) from err

    def _prepare_metrics(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        """Check ``metrics``, turn 0-dim tensors into python numbers and apply the prefix."""
        if not isinstance(metrics, Mapping):
            raise TypeError(
                f"metrics must be a mapping of names to numbers, like {{'loss': 0.5}}, "
                f"got {type(metrics).__name__}: {metrics!r}"
            )
        prepared = {}
        for key, value in metrics.items():
            prepared[f"{self._prefix}{_SEPARATOR}{key}" if self._prefix else str(key)] = _number(key, value)
        return prepared


def _next_version(folder: str) -> int:
    """One more than the highest ``version_N`` sub-folder of ``folder``, 0 when there is none."""
    if not os.path.isdir(folder):
        return 0
    versions = []
    for entry in os.listdir(folder):
        suffix = entry[len("version_") :]
        if entry.startswith("version_") and suffix.isdigit() and os.path.isdir(os.path.join(folder, entry)):
            versions.append(int(suffix))
    return max(versions) + 1 if versions else 0


def _number(key: Any, value: Any) -> float:
    """``value`` as a python number; 0-dim tensors and numpy scalars go through ``.item()``."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (RuntimeError, ValueError) as err:  # torch and numpy refuse .item() on several elements
            raise ValueError(
                f"metric {key!r} must be a single number, got a value of shape "
                f"{tuple(getattr(value, 'shape', ()))}; log its mean or one entry per name instead."
            ) from err
    if not isinstance(value, numbers.Real):
        raise TypeError(f"metric {key!r} must be a real number, got {type(value).__name__}: {value!r}")
    return value


def _params_dict(params: Mapping[str, Any] | argparse.Namespace) -> dict[str, Any]:
    """Hyperparameters as a dict of plain, yaml-safe values; anything unusual becomes its ``str``."""
    if isinstance(params, argparse.Namespace):
        params = vars(params)
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a dict or an argparse.Namespace, got {type(params).__name__}: {params!r}")
    return {str(key): _plain(value) for key, value in params.items()}


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        return value.item()
    # Types yaml.safe_dump refuses (paths, enums, classes, modules, ...) are kept readable, not dropped.
    return str(value)


def _flatten(params: Mapping[str, Any], parent: str = "") -> dict[str, Any]:
    """Nested dicts as one level with ``/``-joined keys, since TensorBoard hparams are flat."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else key
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat
