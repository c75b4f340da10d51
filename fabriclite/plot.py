"""``fabriclite plot``: draw the metrics that ``CSVLogger`` wrote, one subplot per metric and one line per run.

A run is one ``metrics.csv`` (``root_dir/name/version_N/metrics.csv``): a ``step`` column, a column per metric, and
empty cells where a metric was not logged at that step. matplotlib is optional (``pip install 'fabriclite[plot]'``)
and imported only when a figure is drawn, so importing this module stays cheap.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from pathlib import Path

from fabriclite.choices import did_you_mean

FORMATS = (".png", ".pdf", ".svg")
MISSING_MATPLOTLIB = "fabriclite plot needs matplotlib: pip install 'fabriclite[plot]'"

# {run label: {metric: (xs, ys)}}, with the points where the x column or the metric was empty left out
Runs = dict[str, dict[str, tuple[list[float], list[float]]]]


def plot_runs(
    paths: Sequence[str | os.PathLike], output: str | os.PathLike, metrics: Sequence[str] | None = None, x: str = "step"
) -> Path:
    """Draw ``metrics`` (default: every numeric column) of the runs below ``paths`` against column ``x`` into
    ``output`` (.png, .pdf or .svg), written atomically; print what was drawn and return the path.

    Each path is a ``metrics.csv``, a ``version_N`` folder or any folder above (every ``metrics.csv`` below it is a
    run). Raises ``ValueError`` for bad input, ``ImportError`` without matplotlib.
    Usage: ``plot_runs(["logs/gpt"], "curves.png", metrics=["loss", "accuracy"])``.
    """
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise ValueError(f"output {str(output)!r} must end in .png, .pdf or .svg: the name picks the image format.")
    runs = _collect_runs(paths, x)
    metrics = _choose_metrics(runs, metrics)
    figure = _draw(runs, metrics, x)
    output.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file next to the output, renamed over it: a viewer or a crash never sees half an image.
    tmp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(tmp, format=output.suffix[1:].lower())
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    print(f"Wrote {output}: {', '.join(metrics)} against {x} for {len(runs)} run(s): {', '.join(runs)}")
    return output


def _collect_runs(paths: Sequence[str | os.PathLike], x: str = "step") -> Runs:
    """Read every run below ``paths``; labels are the run folders relative to their common parent."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted(path.rglob("metrics.csv"))
            if not found:
                raise ValueError(
                    f"{str(path)!r} has no metrics.csv below it: pass a CSVLogger log folder "
                    "(root_dir/name/version_N or any folder above it) or a metrics.csv file."
                )
        else:
            raise ValueError(
                f"{str(path)!r} does not exist: pass a metrics.csv file, a CSVLogger version_N folder or any folder "
                f"above it (relative paths start at {os.getcwd()})."
            )
        files += [file.resolve() for file in found if file.resolve() not in files]
    # A run is its version_N folder, or the file itself when it has another name (a.csv, b.csv side by side).
    # Labels start below the runs' common parent folder, so a single run is "version_0", not ".".
    runs = {file: file.parent if file.name == "metrics.csv" else file for file in files}
    parent = Path(os.path.commonpath([run.parent for run in runs.values()]))
    return {run.relative_to(parent).as_posix(): _read_run(file, x) for file, run in runs.items()}


def _read_run(file: Path, x: str) -> dict[str, tuple[list[float], list[float]]]:
    try:
        with open(file, newline="") as handle:
            reader = csv.DictReader(handle)
            columns = reader.fieldnames or []
            rows = list(reader)
    except (csv.Error, UnicodeDecodeError) as error:
        raise ValueError(
            f"{str(file)!r} is not a CSV file ({error}): pass the metrics.csv a CSVLogger wrote."
        ) from None
    if x not in columns:
        raise ValueError(
            f"{str(file)!r} has no {x!r} column for the x axis; its columns: {', '.join(columns) or 'none'}. "
            "Pass a metrics.csv written by fabriclite's CSVLogger, or choose the x column with --x."
        )
    xs = _numbers(rows, x)
    if xs is None:
        raise ValueError(f"column {x!r} of {str(file)!r} is not numeric, so it cannot be the x axis; choose another.")
    series = {}
    for column in columns:
        ys = _numbers(rows, column)
        if column in (x, "step") or ys is None:
            continue  # step is a counter, not a curve, and so is a text column (a tag, a file name)
        points = [(a, b) for a, b in zip(xs, ys) if not (math.isnan(a) or math.isnan(b))]
        if points:
            series[column] = ([a for a, _ in points], [b for _, b in points])
    return series


def _numbers(rows: list[dict[str, str | None]], column: str) -> list[float] | None:
    """The column as floats, NaN for empty cells; None when a cell is not a number."""
    try:
        return [float(cell) if cell else math.nan for cell in ((row.get(column) or "").strip() for row in rows)]
    except ValueError:
        return None


def _choose_metrics(runs: Runs, metrics: Sequence[str] | None) -> list[str]:
    available = list(dict.fromkeys(name for series in runs.values() for name in series))
    listed = ", ".join(available) or "none"
    for name in metrics or ():
        if name not in available:
            raise ValueError(f"unknown metric {name!r}; the runs have: {listed}.{did_you_mean(name, available)}")
    chosen = available if metrics is None else list(dict.fromkeys(metrics))
    if not chosen:
        raise ValueError(f"nothing to plot: name at least one metric; the runs have: {listed}.")
    return chosen


def _draw(runs: Runs, metrics: list[str], x: str):  # -> matplotlib.figure.Figure, imported lazily
    try:
        import matplotlib  # noqa: F401 - only to tell "not installed" apart from "installed but broken"
    except ModuleNotFoundError as error:
        if error.name != "matplotlib":
            raise
        raise ImportError(MISSING_MATPLOTLIB) from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A bare Figure on the Agg canvas: no display, no pyplot state, no change to the caller's backend.
    columns = min(len(metrics), 3)
    rows = math.ceil(len(metrics) / columns)
    figure = Figure(figsize=(5 * columns, 3.5 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False).flat
    for metric, ax in zip(metrics, axes):  # metrics first: zip must not use up an extra axes
        for index, (label, series) in enumerate(runs.items()):
            if metric in series:
                xs, ys = series[metric]
                # one color per run in every subplot; a lone point gets a marker, else it would not show
                ax.plot(xs, ys, label=label, color=f"C{index % 10}", marker="o" if len(xs) == 1 else None)
        ax.set_title(metric)
        ax.set_xlabel(x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes:  # the rest of the last row
        ax.set_visible(False)
    return figure
