"""A logger writing TensorBoard event files through ``torch.utils.tensorboard.SummaryWriter``."""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import os
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from fabriclite.loggers.base import _flatten, _params_dict, _VersionedLogger

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_MISSING = (
    "TensorBoardLogger needs the tensorboard package, which is not installed. "
    'Install it with `pip install "fabriclite[tensorboard]"` (or `pip install tensorboard`), '
    "or use fabriclite.loggers.CSVLogger, which needs nothing extra."
)


class TensorBoardLogger(_VersionedLogger):
    """Log to TensorBoard under ``root_dir/name/version_N[/sub_dir]``, like Lightning Fabric's logger; environment
    variables in these parts and a leading ``~`` are expanded, as Lightning does.

    The ``SummaryWriter`` (``experiment``) is created on first use, with ``**kwargs`` passed to it. It
    writes from a background thread every ``flush_secs`` (120 s by default); call ``finalize()`` (or
    ``save()``) before the script ends, since events still queued when the interpreter exits are lost.

    Usage::

        logger = TensorBoardLogger("logs", name="mnist")
        logger.log_hyperparams({"lr": 1e-3})
        logger.log_metrics({"loss": 0.25}, step=10)
        logger.finalize("success")
    """

    def __init__(
        self,
        root_dir: str | os.PathLike,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ) -> None:
        # find_spec only locates the package: the cost of importing tensorboard is paid on first use,
        # and only by the rank that logs, yet a missing install fails here, before training starts.
        if importlib.util.find_spec("tensorboard") is None:
            raise ModuleNotFoundError(_MISSING)
        # Lightning expands variables (and a leading "~") in the log_dir it writes to: root_dir="$SCRATCH/logs",
        # name="run_$SLURM_JOB_ID". Expanding the parts here keeps the version_N scan in that same folder.
        name = os.path.expandvars(name) if name else name
        version = os.path.expandvars(version) if isinstance(version, str) else version
        super().__init__(root_dir, name, version, prefix, expand=True)
        self._default_hp_metric = default_hp_metric
        self._sub_dir = None if sub_dir is None else os.path.expandvars(os.fspath(sub_dir))
        self._kwargs = kwargs
        self._experiment: SummaryWriter | None = None

    @property
    def sub_dir(self) -> str | None:
        """The optional folder under the version folder that the events go to."""
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        """The folder the event files go to: ``root_dir/name/version_N[/sub_dir]``."""
        log_dir = super().log_dir
        return log_dir if self._sub_dir is None else os.path.join(log_dir, self._sub_dir)

    @property
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter``, created on first access; use it for images, histograms and the like.

        Usage: ``logger.experiment.add_histogram("weights", model.fc.weight, step)``
        """
        if self._experiment is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ModuleNotFoundError as err:
                raise ModuleNotFoundError(_MISSING) from err
            self._check_writable()  # the writer's own thread would only print its failures
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
            _OPEN.add(self)
        return self._experiment

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        """Write each metric as a scalar at ``step``.

        Usage: ``logger.log_metrics({"loss": 0.25, "acc": 0.9}, step=100)``
        """
        writer = self.experiment
        for key, value in self._prepare_metrics(metrics).items():
            writer.add_scalar(key, value, step)

    def log_hyperparams(
        self, params: Mapping[str, Any] | argparse.Namespace, metrics: Mapping[str, float] | None = None
    ) -> None:
        """Record ``params`` for TensorBoard's HPARAMS tab, linked to ``metrics``.

        Without ``metrics`` and with ``default_hp_metric=True``, ``hp_metric=-1`` is logged as a placeholder
        so the tab shows the run; log ``hp_metric`` yourself later to fill it in.

        Usage: ``logger.log_hyperparams({"lr": 1e-3, "batch_size": 32})``
        """
        from torch.utils.tensorboard.summary import hparams

        # The hparams plugin takes flat numbers, bools and strs only: nested dicts become "a/b", the rest str.
        params = {
            key: value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in _flatten(_params_dict(params)).items()
        }
        if metrics is None:
            metrics = {"hp_metric": -1} if self._default_hp_metric else {}
        metrics = self._prepare_metrics(metrics)
        writer = self.experiment
        for key, value in metrics.items():
            writer.add_scalar(key, value, 0)
        # add_hparams() would write into a new timestamped sub-run; writing the summaries through this
        # run's own file writer keeps params and curves in one run.
        for summary in hparams(params, metrics):
            writer.file_writer.add_summary(summary)

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Write the model's graph, traced on ``input_array`` (a tensor, or a tuple of ``forward``'s positional
        arguments; by default ``model.example_input_array``). Without a usable input it warns and writes nothing.

        Usage: ``logger.log_graph(model, torch.randn(1, 3, 32, 32))``
        """
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        # A model from fabric.setup (compiled afterwards or not) is traced as the user's module, as Lightning's
        # _unwrap_objects does; any other module, a DDP wrapper say, is traced as it is.
        original = getattr(model, "_original_module", None)
        model = original if isinstance(original, torch.nn.Module) else model
        if input_array is None:
            warnings.warn(
                "Could not log computational graph to TensorBoard: The `model.example_input_array` attribute is not "
                "set or `input_array` was not given. Pass input_array, or set model.example_input_array.",
                UserWarning,
                stacklevel=2,
            )
            return
        if not isinstance(input_array, (torch.Tensor, tuple)):
            warnings.warn(
                "Could not log computational graph to TensorBoard: The `input_array` or `model.example_input_array` "
                f"has type {type(input_array)} which can't be traced by TensorBoard. Make the input array a tuple "
                "representing the positional arguments to the model's `forward()` implementation.",
                UserWarning,
                stacklevel=2,
            )
            return
        if callable(getattr(model, "_on_before_batch_transfer", None)) and callable(
            getattr(model, "_apply_batch_transfer_handler", None)
        ):  # a LightningModule: its batch hooks move the input to its device, as they do for Lightning
            input_array = model._apply_batch_transfer_handler(model._on_before_batch_transfer(input_array))
        self.experiment.add_graph(model, input_array)

    def save(self) -> None:
        """Flush pending events to disk.

        Usage: ``logger.save()``
        """
        if self._experiment is not None:
            self._experiment.flush()

    def finalize(self, status: str) -> None:
        """Flush and close the event file; a later log call opens a new one.

        Usage: ``logger.finalize("success")``
        """
        if self._experiment is not None:
            self._experiment.close()
            self._experiment = None

    def __getstate__(self) -> dict[str, Any]:
        # The writer holds a thread and an open file, which cannot be pickled (e.g. to spawned processes).
        state = self.__dict__.copy()
        state["_experiment"] = None
        return state


_OPEN: weakref.WeakSet[TensorBoardLogger] = weakref.WeakSet()  # loggers whose writer may hold unwritten events


@atexit.register
def _flush_at_exit() -> None:
    # The writer's thread writes every flush_secs; a script that never calls finalize() (as Lightning's examples)
    # would lose what it wrote last. Under Lightning those events reach the file too.
    for logger in list(_OPEN):
        try:
            logger.save()
        except Exception as err:  # nobody to raise to at exit: say what was lost
            print(
                f"fabriclite: TensorBoardLogger could not write its last events to {logger.log_dir}: {err}",
                file=sys.stderr,
            )
