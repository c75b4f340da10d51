"""Metrics on score curves: ROC, PrecisionRecallCurve, AUROC, AveragePrecision, and their functional forms.
Names, arguments and defaults follow torchmetrics' task wrappers; values equal scikit-learn's.

Inputs are float scores: ``(N, ...)`` for binary, ``(N, C, ...)`` for multiclass (one-vs-rest per class),
``(N, L, ...)`` for multilabel; scores outside [0, 1] are taken for logits (sigmoid, or softmax over classes).
Targets as in :mod:`fabriclite.metrics._inputs`; ``ignore_index`` leaves samples (or label entries) out.

Two ways to keep the state, chosen by ``thresholds``:

- ``thresholds=None`` (exact): every score and target is kept (``cat`` states) and the curve has a point at every
  distinct score, as scikit-learn's. Memory grows with the data.
- ``thresholds=int`` (that many evenly spaced in [0, 1]) or a list / 1-D tensor of increasing values (binned):
  a histogram of how many positives and negatives fall between consecutive thresholds. Memory is constant
  (``(classes, 2, thresholds + 1)`` counts), an update costs one ``bucketize`` and one ``bincount``, and the curve is
  the exact curve of the scores rounded down to the threshold grid.

As in torchmetrics: an exact ROC starts at threshold 1.0 (scikit-learn: ``inf``) and keeps every point
(scikit-learn's ``drop_intermediate=False``); a binned precision is NaN at thresholds no score reaches.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable, Literal, Optional

import torch
from torch import Tensor

from fabriclite.metrics._curve_points import CurveState, _as_binary, _binned_counts, _binned_update, _per_class
from fabriclite.metrics._curve_points import _exact_pr, _exact_roc
from fabriclite.metrics._inputs import Task, Thresholds, _adjust_thresholds, _check_curve_args, _format_curve
from fabriclite.metrics._inputs import _safe_divide
from fabriclite.metrics.metric import Metric

CurveAverage = Optional[Literal["micro", "macro", "weighted", "none"]]


# -------------------------------------------------------------------------------------------- shared compute


def _exact_state(
    preds: list[Tensor] | Tensor, target: list[Tensor] | Tensor, task: str, size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    if isinstance(preds, Tensor):
        return preds, target
    if preds:
        return torch.cat(preds), torch.cat(target)
    shape = (0,) if task == "binary" else (0, size)
    target_shape = shape if task == "multilabel" else (0,)
    return torch.zeros(shape, device=device), torch.zeros(target_shape, dtype=torch.long, device=device)


def _roc_compute(state: CurveState, thresholds: Tensor | None, task: str, size: int) -> tuple[Any, Any, Any]:
    """(fpr, tpr, thresholds): tensors for binary and binned curves (``(C, T)`` per class), lists per class otherwise."""
    if thresholds is not None:
        tps, fps, positives, negatives = _binned_counts(state)
        fpr, tpr = _safe_divide(fps, negatives.expand_as(fps)), _safe_divide(tps, positives.expand_as(tps))
        return fpr.flip(-1), tpr.flip(-1), thresholds.flip(0)  # thresholds descending, as for exact curves
    return _exact_curves(_exact_roc, state, task, size)


def _pr_compute(state: CurveState, thresholds: Tensor | None, task: str, size: int) -> tuple[Any, Any, Any]:
    """(precision, recall, thresholds), shaped as ``_roc_compute``'s."""
    if thresholds is not None:
        tps, fps, positives, _ = _binned_counts(state)
        nan = float("nan")
        precision = _safe_divide(tps, tps + fps, nan)
        recall = _safe_divide(tps, positives.expand_as(tps), nan)
        ones, zeros = precision.new_ones((*precision.shape[:-1], 1)), recall.new_zeros((*recall.shape[:-1], 1))
        return torch.cat([precision, ones], -1), torch.cat([recall, zeros], -1), thresholds
    return _exact_curves(_exact_pr, state, task, size)


def _exact_curves(curve: Callable, state: CurveState, task: str, size: int) -> tuple[Any, Any, Any]:
    """The exact ``curve`` of a binary problem, or the lists of its one-vs-rest curves, one per class or label."""
    if task == "binary":
        return curve(*state)
    first, second, thresholds = zip(*(curve(*problem) for problem in _per_class(state, task, size)))
    return list(first), list(second), list(thresholds)


def _support(state: CurveState, thresholds: Tensor | None, task: str, size: int) -> Tensor:
    """Positives per class: the weights of ``average="weighted"``."""
    if thresholds is not None:
        return state[:, 1, :].sum(-1)
    if task == "multiclass":
        return torch.bincount(state[1], minlength=size)
    return (state[1] == 1).sum(0)


def _reduce_classes(scores: Tensor, average: CurveAverage, support: Tensor) -> Tensor:
    if average in ("none", None):
        return scores
    defined = ~torch.isnan(scores)
    if not bool(defined.all()):
        warnings.warn(
            f"The score of some classes is NaN; they are left out of the {average} average", UserWarning, stacklevel=3
        )
    if average == "macro":
        return scores[defined].mean()
    weights = support[defined].float()
    return _safe_divide((scores[defined] * weights).sum(), weights.sum())


def _auc(x: Tensor, y: Tensor) -> Tensor:
    return torch.trapezoid(y, x, dim=-1)


def _auroc_compute(
    state: CurveState, thresholds: Tensor | None, task: str, size: int, average: CurveAverage, max_fpr: float | None
) -> Tensor:
    area = _auc if max_fpr is None or max_fpr == 1 else functools.partial(_partial_auc, max_fpr=max_fpr)
    return _area_compute(_roc_compute, area, state, thresholds, task, size, average)


def _average_precision_compute(
    state: CurveState, thresholds: Tensor | None, task: str, size: int, average: CurveAverage
) -> Tensor:
    return _area_compute(_pr_compute, _step_area, state, thresholds, task, size, average)


def _area_compute(
    curve: Callable,
    area: Callable,
    state: CurveState,
    thresholds: Tensor | None,
    task: str,
    size: int,
    average: CurveAverage,
) -> Tensor:
    """The ``area`` under ``curve`` per class, averaged as asked (multilabel micro: all labels as one binary problem)."""
    if task == "multilabel" and average == "micro":
        state, task, size = _as_binary(state, thresholds), "binary", 1
    x, y, _ = curve(state, thresholds, task, size)
    if task == "binary":
        return area(x, y)
    # binned: (C, T) tensors, one area per row; exact: a curve per class
    scores = area(x, y) if thresholds is not None else torch.stack([area(*xy) for xy in zip(x, y)])
    return _reduce_classes(scores, average, _support(state, thresholds, task, size))


def _partial_auc(fpr: Tensor, tpr: Tensor, max_fpr: float) -> Tensor:
    """Area under the ROC up to ``max_fpr``, McClish-standardized (0.5 = chance, 1 = perfect), as scikit-learn."""
    if bool(fpr.sum() == 0) or bool(tpr.sum() == 0):
        return _auc(fpr, tpr)
    limit = torch.tensor(max_fpr, dtype=fpr.dtype, device=fpr.device)
    stop = int(torch.bucketize(limit, fpr, right=True))
    weight = (limit - fpr[stop - 1]) / (fpr[stop] - fpr[stop - 1])
    tpr = torch.cat([tpr[:stop], torch.lerp(tpr[stop - 1], tpr[stop], weight).view(1)])
    fpr = torch.cat([fpr[:stop], limit.view(1)])
    min_area = 0.5 * limit**2
    return 0.5 * (1 + (_auc(fpr, tpr) - min_area) / (limit - min_area))


def _step_area(precision: Tensor, recall: Tensor) -> Tensor:
    """``sum_n (R_n - R_{n+1}) P_n``: scikit-learn's average precision, no interpolation."""
    # a binned curve's undefined points (no score above the threshold) add no recall, so they count as 0
    precision, recall = precision.nan_to_num(0.0), recall.nan_to_num(0.0)
    return -((recall[..., 1:] - recall[..., :-1]) * precision[..., :-1]).sum(-1)


def _curve_state(
    preds: Tensor,
    target: Tensor,
    task: str,
    size: int,
    thresholds: Tensor | None,
    ignore_index: int | None,
    validate_args: bool,
) -> CurveState:
    """A functional call's whole state: the formatted inputs (exact) or their histogram (binned)."""
    preds, target = _format_curve(preds, target, task, size, ignore_index, validate_args)
    if thresholds is None:
        return preds, target
    return _binned_update(preds, target, thresholds.to(preds.device), task, size)


# ---------------------------------------------------------------------------------------------------- functional


def roc(
    preds: Tensor,
    target: Tensor,
    task: Task,
    thresholds: Thresholds = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> tuple[Any, Any, Any]:
    """ROC curve ``(fpr, tpr, thresholds)``, thresholds descending.

    Usage: ``fpr, tpr, thresholds = roc(probs, labels, task="binary")``. Multiclass and multilabel: lists with one
    curve per class (exact) or ``(C, T)`` tensors (binned).
    """
    size = _check_curve_args(task, num_classes, num_labels, ignore_index)
    thresholds = _adjust_thresholds(thresholds)
    state = _curve_state(preds, target, task, size, thresholds, ignore_index, validate_args)
    return _roc_compute(state, thresholds, task, size)


def precision_recall_curve(
    preds: Tensor,
    target: Tensor,
    task: Task,
    thresholds: Thresholds = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> tuple[Any, Any, Any]:
    """Precision-recall curve ``(precision, recall, thresholds)``, thresholds increasing.

    Usage: ``precision, recall, thresholds = precision_recall_curve(probs, labels, task="binary")``.
    """
    size = _check_curve_args(task, num_classes, num_labels, ignore_index)
    thresholds = _adjust_thresholds(thresholds)
    state = _curve_state(preds, target, task, size, thresholds, ignore_index, validate_args)
    return _pr_compute(state, thresholds, task, size)


def auroc(
    preds: Tensor,
    target: Tensor,
    task: Task,
    thresholds: Thresholds = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: CurveAverage = "macro",
    max_fpr: float | None = None,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> Tensor:
    """Area under the ROC curve (multiclass: one-vs-rest, as scikit-learn's ``multi_class="ovr"``).

    Usage: ``auroc(probs, labels, task="multiclass", num_classes=5)``.
    """
    size = _check_curve_args(task, num_classes, num_labels, ignore_index, average, max_fpr)
    thresholds = _adjust_thresholds(thresholds)
    state = _curve_state(preds, target, task, size, thresholds, ignore_index, validate_args)
    return _auroc_compute(state, thresholds, task, size, average, max_fpr)


def average_precision(
    preds: Tensor,
    target: Tensor,
    task: Task,
    thresholds: Thresholds = None,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: CurveAverage = "macro",
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> Tensor:
    """Average precision, the step-wise area under the precision-recall curve (scikit-learn's definition).

    Usage: ``average_precision(probs, labels, task="binary")``.
    """
    size = _check_curve_args(task, num_classes, num_labels, ignore_index, average)
    thresholds = _adjust_thresholds(thresholds)
    state = _curve_state(preds, target, task, size, thresholds, ignore_index, validate_args)
    return _average_precision_compute(state, thresholds, task, size, average)


# ------------------------------------------------------------------------------------------------------ classes


class _CurveMetric(Metric):
    """The states shared by the curve metrics: every score and target (exact), or a histogram (binned). Its
    arguments are AUROC's, the widest; the other curve metrics pass theirs on."""

    is_differentiable = False

    def __init__(
        self,
        task: Task,
        thresholds: Thresholds = None,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: CurveAverage = "macro",
        max_fpr: float | None = None,
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.size = _check_curve_args(task, num_classes, num_labels, ignore_index, average, max_fpr)
        self.task, self.num_classes, self.num_labels = task, num_classes, num_labels
        self.ignore_index, self.validate_args = ignore_index, validate_args
        self.average, self.max_fpr = average, max_fpr
        thresholds = _adjust_thresholds(thresholds)
        if thresholds is None:
            self.thresholds = None
            self.add_state("preds", [], dist_reduce_fx="cat")
            self.add_state("target", [], dist_reduce_fx="cat")
        else:
            self.register_buffer("thresholds", thresholds, persistent=False)  # moves with .to(device)
            shape = (2, thresholds.numel() + 1) if task == "binary" else (self.size, 2, thresholds.numel() + 1)
            self.add_state("hist", torch.zeros(shape, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch: keep its scores (exact) or count them into the histogram (binned)."""
        preds, target = _format_curve(preds, target, self.task, self.size, self.ignore_index, self.validate_args)
        if self.thresholds is None:
            self.preds.append(preds)
            self.target.append(target)
        else:
            self.hist = self.hist + _binned_update(preds, target, self.thresholds, self.task, self.size)

    @property
    def _state(self) -> CurveState:
        if self.thresholds is not None:
            return self.hist
        return _exact_state(self.preds, self.target, self.task, self.size, self.device)


class _Curve(_CurveMetric):
    """The arguments of the two curves, which take no average."""

    def __init__(
        self,
        task: Task,
        thresholds: Thresholds = None,
        num_classes: int | None = None,
        num_labels: int | None = None,
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            task, thresholds, num_classes, num_labels, ignore_index=ignore_index, validate_args=validate_args, **kwargs
        )


class ROC(_Curve):
    """ROC curve, as ``torchmetrics.ROC``: ``compute()`` returns ``(fpr, tpr, thresholds)``.

    Usage: ``roc = ROC(task="binary", thresholds=200); roc.update(probs, labels); fpr, tpr, t = roc.compute()``.
    """

    def compute(self) -> tuple[Any, Any, Any]:
        """The curve over everything seen (all processes)."""
        return _roc_compute(self._state, self.thresholds, self.task, self.size)


class PrecisionRecallCurve(_Curve):
    """Precision-recall curve, as ``torchmetrics.PrecisionRecallCurve``: ``(precision, recall, thresholds)``.

    Usage: ``pr = PrecisionRecallCurve(task="multiclass", num_classes=5, thresholds=100)``.
    """

    def compute(self) -> tuple[Any, Any, Any]:
        """The curve over everything seen (all processes)."""
        return _pr_compute(self._state, self.thresholds, self.task, self.size)


class AUROC(_CurveMetric):
    """Area under the ROC curve, as ``torchmetrics.AUROC`` (multiclass: one-vs-rest).

    Usage: ``AUROC(task="binary")`` exact, or ``AUROC(task="binary", thresholds=1000)`` in constant memory.
    """

    higher_is_better = True

    def compute(self) -> Tensor:
        """The AUROC over everything seen (all processes)."""
        return _auroc_compute(self._state, self.thresholds, self.task, self.size, self.average, self.max_fpr)


class AveragePrecision(_CurveMetric):
    """Average precision, as ``torchmetrics.AveragePrecision``.

    Usage: ``AveragePrecision(task="multilabel", num_labels=4, average="micro")``.
    """

    higher_is_better = True

    def __init__(
        self,
        task: Task,
        thresholds: Thresholds = None,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: CurveAverage = "macro",
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            task,
            thresholds,
            num_classes,
            num_labels,
            average,
            ignore_index=ignore_index,
            validate_args=validate_args,
            **kwargs,
        )

    def compute(self) -> Tensor:
        """The average precision over everything seen (all processes)."""
        return _average_precision_compute(self._state, self.thresholds, self.task, self.size, self.average)
