"""Classification metrics built on counts: Accuracy, Precision, Recall, F1Score, FBetaScore, ConfusionMatrix, and
their functional forms. Names, arguments and defaults follow torchmetrics' task wrappers
(``Accuracy(task="multiclass", num_classes=10)`` averages ``"micro"``); values equal scikit-learn's.

Inputs are described in ``_inputs`` (where they are checked and formatted). The state is four count vectors
(true/false positives/negatives per class), so memory does not grow with the data.

Macro averages and classes that never occur. With ``average="macro"`` a multiclass class that appears in neither
``preds`` nor ``target`` of all the data seen is left out of the average (torchmetrics' rule; for Accuracy,
Precision and Recall with ``top_k > 1``, a class absent from ``target``). scikit-learn without ``labels=`` does the
same, since it averages over the classes present in ``y_true`` or ``y_pred``. scikit-learn with
``labels=range(num_classes)`` instead counts such a class with the score ``zero_division`` (0 by default), which
pulls the average down. To get that value, take the mean of the per-class scores:
``F1Score(task="multiclass", num_classes=C, average="none").compute().mean()`` (the absent class holds
``zero_division`` there). Two related differences: ``balanced_accuracy_score`` averages recall over the classes
present in ``y_true`` only, so it equals ``Accuracy(average="macro")`` (= macro recall) whenever every predicted
class also occurs in the target; and multilabel macro averages always count every label, as scikit-learn does.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from fabriclite.metrics._inputs import _NORMALIZE, Average, Task, _check_args, _format, _safe_divide
from fabriclite.metrics.metric import Metric

Stats = tuple[Tensor, Tensor, Tensor, Tensor]  # true positives, false positives, true negatives, false negatives

# ------------------------------------------------------------------------------------------- counts and scores


def _stat_scores_update(preds: Tensor, target: Tensor, task: str, size: int, average: Average = "macro") -> Stats:
    """True/false positives/negatives: scalars for binary and multiclass ``micro`` (only their sums over classes
    matter), one per class or label otherwise."""
    if task == "binary":
        tp = (preds * target).sum()
        fp = preds.sum() - tp
        fn = target.sum() - tp
        return tp, fp, target.numel() - tp - fp - fn, fn
    if task == "multiclass" and average == "micro":
        # every miss is a false positive of the predicted class and a false negative of the target class
        tp = (preds == target).sum()
        misses = target.numel() - tp
        return tp, misses, (size - 2) * target.numel() + tp, misses
    if task == "multiclass":
        # (target, hit) pairs counted in one bincount, predictions in another: O(N + C), where torchmetrics'
        # C x C confusion matrix costs O(C^2) memory and time per update
        by_target = torch.bincount(torch.add(preds == target, target, alpha=2), minlength=2 * size).view(size, 2)
        tp, fn = by_target[:, 1], by_target[:, 0]
        fp = torch.bincount(preds, minlength=size) - tp
        return tp, fp, target.numel() - tp - fp - fn, fn
    predicted, positive, negative = preds == 1, target == 1, target == 0
    tp = (predicted & positive).sum(0)
    fp = (predicted & negative).sum(0)
    return tp, fp, negative.sum(0) - fp, positive.sum(0) - tp


def _confusion_matrix_update(preds: Tensor, target: Tensor, task: str, size: int) -> Tensor:
    """Counts ``[target, pred]``: (2, 2) binary, (C, C) multiclass, (L, 2, 2) multilabel."""
    if task == "multiclass":
        return torch.bincount(target * size + preds, minlength=size * size).reshape(size, size)
    tp, fp, tn, fn = _stat_scores_update(preds, target, task, size)  # a few sums: faster than a bincount of cells
    return torch.stack([tn, fp, fn, tp], -1).reshape(*tp.shape, 2, 2)


def _stat_scores_compute(
    stats: Stats, score: str, task: str, average: Average, top_k: int = 1, zero_division: float = 0, beta: float = 1.0
) -> Tensor:
    """``score`` ("accuracy", "precision", "recall" or "fbeta") per class from the counts, averaged as asked
    (``micro`` sums the counts before dividing)."""
    tp, fp, tn, fn = stats
    if score == "fbeta":
        # From the counts rather than from precision and recall: defined (and equal to scikit-learn's) even when one
        # of them is 0/0. top_k=1 on purpose: torchmetrics' F-scores leave out of the macro average only the classes
        # with no tp, fp or fn even with top_k > 1 (its precision and recall leave out the classes absent from target)
        num, top_k = (1 + beta**2) * tp, 1
        denom = num + beta**2 * fn + fp
    elif score == "precision":
        num, denom = tp, tp + fp
    elif score == "recall" or task == "multiclass":
        # multiclass accuracy is recall: each sample is one positive, for its target class
        num, denom = tp, tp + fn
    else:  # accuracy: binary, or per label
        num, denom = tp + tn, tp + tn + fp + fn
    if task == "binary":
        return _safe_divide(num, denom, zero_division)
    if average == "micro":
        return _safe_divide(num.sum(), denom.sum(), zero_division)
    per_class = _safe_divide(num, denom, zero_division)
    if average in ("none", None):
        return per_class
    if average == "weighted":
        weights = (tp + fn).float()
    elif task == "multiclass":
        # torchmetrics' rule (see the module docstring): a class that never occurred does not count
        absent = (tp + fp + fn == 0) if (top_k or 1) == 1 else (tp + fn == 0)
        weights = (~absent).float()
    else:
        weights = torch.ones_like(per_class)
    return _safe_divide((weights * per_class).sum(), weights.sum())


def _check_beta(beta: Any) -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a positive float, got {beta!r}")
    return float(beta)


# ---------------------------------------------------------------------------------------------------- functional


def accuracy(
    preds: Tensor,
    target: Tensor,
    task: Task,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: Average = "micro",
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> Tensor:
    """Accuracy (multilabel: per-label accuracy, i.e. ``1 - hamming_loss`` with ``micro``).

    Usage: ``accuracy(logits, labels, task="multiclass", num_classes=10)``.
    """
    size = _check_args(task, num_classes, num_labels, threshold, average, top_k, ignore_index)
    preds, target = _format(preds, target, task, size, threshold, top_k, ignore_index, validate_args)
    stats = _stat_scores_update(preds, target, task, size, average)
    return _stat_scores_compute(stats, "accuracy", task, average, top_k)


def precision(
    preds: Tensor,
    target: Tensor,
    task: Task,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: Average = "micro",
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
    zero_division: float = 0,
) -> Tensor:
    """Precision, ``tp / (tp + fp)``; ``zero_division`` when nothing was predicted positive.

    Usage: ``precision(logits, labels, task="multiclass", num_classes=10, average="macro")``.
    """
    size = _check_args(task, num_classes, num_labels, threshold, average, top_k, ignore_index, zero_division)
    preds, target = _format(preds, target, task, size, threshold, top_k, ignore_index, validate_args)
    stats = _stat_scores_update(preds, target, task, size, average)
    return _stat_scores_compute(stats, "precision", task, average, top_k, zero_division)


def recall(
    preds: Tensor,
    target: Tensor,
    task: Task,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: Average = "micro",
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
    zero_division: float = 0,
) -> Tensor:
    """Recall, ``tp / (tp + fn)``; ``zero_division`` when there were no positives.

    Usage: ``recall(probs, labels, task="binary")``.
    """
    size = _check_args(task, num_classes, num_labels, threshold, average, top_k, ignore_index, zero_division)
    preds, target = _format(preds, target, task, size, threshold, top_k, ignore_index, validate_args)
    stats = _stat_scores_update(preds, target, task, size, average)
    return _stat_scores_compute(stats, "recall", task, average, top_k, zero_division)


def fbeta_score(
    preds: Tensor,
    target: Tensor,
    task: Task,
    beta: float = 1.0,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: Average = "micro",
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
    zero_division: float = 0,
) -> Tensor:
    """F-beta, ``(1 + b^2) tp / ((1 + b^2) tp + b^2 fn + fp)``.

    Usage: ``fbeta_score(logits, labels, task="multiclass", num_classes=10, beta=2.0)``.
    """
    beta = _check_beta(beta)
    size = _check_args(task, num_classes, num_labels, threshold, average, top_k, ignore_index, zero_division)
    preds, target = _format(preds, target, task, size, threshold, top_k, ignore_index, validate_args)
    stats = _stat_scores_update(preds, target, task, size, average)
    return _stat_scores_compute(stats, "fbeta", task, average, top_k, zero_division, beta)


def f1_score(
    preds: Tensor,
    target: Tensor,
    task: Task,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    average: Average = "micro",
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
    zero_division: float = 0,
) -> Tensor:
    """F1, the harmonic mean of precision and recall (``fbeta_score`` with ``beta=1``).

    Usage: ``f1_score(logits, labels, task="multiclass", num_classes=10, average="macro")``.
    """
    return fbeta_score(beta=1.0, **locals())


def _confusion_matrix_compute(confmat: Tensor, normalize: str | None) -> Tensor:
    if normalize in (None, "none"):
        return confmat.clone()  # never hand out the state itself: the next update would change the user's tensor
    confmat = confmat.float()
    dims = {"true": (-1,), "pred": (-2,), "all": (-2, -1)}[normalize]
    # a row (or column) with no samples normalizes to zeros, as in scikit-learn and torchmetrics
    return _safe_divide(confmat, confmat.sum(dims, keepdim=True).expand_as(confmat))


def _check_normalize(normalize: Any) -> None:
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")


def confusion_matrix(
    preds: Tensor,
    target: Tensor,
    task: Task,
    threshold: float = 0.5,
    num_classes: int | None = None,
    num_labels: int | None = None,
    normalize: Literal["true", "pred", "all", "none"] | None = None,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> Tensor:
    """Confusion matrix with rows = targets, columns = predictions (multilabel: one 2x2 matrix per label).

    Usage: ``confusion_matrix(logits, labels, task="multiclass", num_classes=3, normalize="true")``.
    """
    size = _check_args(task, num_classes, num_labels, threshold, ignore_index=ignore_index)
    _check_normalize(normalize)
    preds, target = _format(preds, target, task, size, threshold, 1, ignore_index, validate_args)
    return _confusion_matrix_compute(_confusion_matrix_update(preds, target, task, size), normalize)


# ------------------------------------------------------------------------------------------------------ classes


class _StatScores(Metric):
    """The states shared by Accuracy, Precision, Recall and the F-scores: tp, fp, tn, fn per class."""

    is_differentiable = False
    higher_is_better = True

    def __init__(
        self,
        task: Task,
        threshold: float = 0.5,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: Average = "micro",
        top_k: int = 1,
        ignore_index: int | None = None,
        validate_args: bool = True,
        zero_division: float = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.size = _check_args(task, num_classes, num_labels, threshold, average, top_k, ignore_index, zero_division)
        self.task, self.num_classes, self.num_labels = task, num_classes, num_labels
        self.threshold, self.average, self.top_k = threshold, average, top_k or 1
        self.ignore_index, self.validate_args, self.zero_division = ignore_index, validate_args, zero_division
        shape = () if task == "binary" or (task == "multiclass" and average == "micro") else (self.size,)
        for name in ("tp", "fp", "tn", "fn"):
            self.add_state(name, torch.zeros(shape, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Count a batch."""
        preds, target = _format(
            preds, target, self.task, self.size, self.threshold, self.top_k, self.ignore_index, self.validate_args
        )
        tp, fp, tn, fn = _stat_scores_update(preds, target, self.task, self.size, self.average)
        self.tp, self.fp, self.tn, self.fn = self.tp + tp, self.fp + fp, self.tn + tn, self.fn + fn

    @property
    def _stats(self) -> Stats:
        return self.tp, self.fp, self.tn, self.fn


class Accuracy(_StatScores):
    """Accuracy, as ``torchmetrics.Accuracy`` (the task wrapper: ``average="micro"`` by default).

    Usage: ``acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device); acc(logits, labels)``.
    Multiclass ``average="macro"`` is balanced accuracy (macro recall); multilabel accuracy is per label.
    """

    def __init__(
        self,
        task: Task,
        threshold: float = 0.5,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: Average = "micro",
        top_k: int = 1,
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            task, threshold, num_classes, num_labels, average, top_k, ignore_index, validate_args, **kwargs
        )

    def compute(self) -> Tensor:
        """The accuracy of everything seen (all processes)."""
        return _stat_scores_compute(self._stats, "accuracy", self.task, self.average, self.top_k)


class Precision(_StatScores):
    """Precision, as ``torchmetrics.Precision``.

    Usage: ``Precision(task="multiclass", num_classes=10, average="macro")``.
    """

    def compute(self) -> Tensor:
        """The precision of everything seen (all processes)."""
        return _stat_scores_compute(self._stats, "precision", self.task, self.average, self.top_k, self.zero_division)


class Recall(_StatScores):
    """Recall, as ``torchmetrics.Recall``.

    Usage: ``Recall(task="binary", threshold=0.3)``.
    """

    def compute(self) -> Tensor:
        """The recall of everything seen (all processes)."""
        return _stat_scores_compute(self._stats, "recall", self.task, self.average, self.top_k, self.zero_division)


class FBetaScore(_StatScores):
    """F-beta score, as ``torchmetrics.FBetaScore``.

    Usage: ``FBetaScore(task="multilabel", num_labels=5, beta=2.0, average="macro")``.
    """

    def __init__(
        self,
        task: Task,
        beta: float = 1.0,
        threshold: float = 0.5,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: Average = "micro",
        top_k: int = 1,
        ignore_index: int | None = None,
        validate_args: bool = True,
        zero_division: float = 0,
        **kwargs: Any,
    ) -> None:
        arguments = (threshold, num_classes, num_labels, average, top_k, ignore_index, validate_args, zero_division)
        super().__init__(task, *arguments, **kwargs)
        self.beta = _check_beta(beta)

    def compute(self) -> Tensor:
        """The F-beta score of everything seen (all processes)."""
        args = self.task, self.average, self.top_k, self.zero_division, self.beta
        return _stat_scores_compute(self._stats, "fbeta", *args)


class F1Score(FBetaScore):
    """F1 score, as ``torchmetrics.F1Score``.

    Usage: ``F1Score(task="multiclass", num_classes=10, average="macro")``.
    """

    beta = 1.0
    __init__ = _StatScores.__init__  # F1's arguments are F-beta's without beta: those of Precision and Recall


class ConfusionMatrix(Metric):
    """Confusion matrix, as ``torchmetrics.ConfusionMatrix``: rows are targets, columns predictions.

    Usage: ``cm = ConfusionMatrix(task="multiclass", num_classes=3, normalize="true"); cm(logits, labels)``.
    Shapes: (2, 2) binary, (C, C) multiclass, (L, 2, 2) multilabel.
    """

    is_differentiable = False
    higher_is_better = None

    def __init__(
        self,
        task: Task,
        threshold: float = 0.5,
        num_classes: int | None = None,
        num_labels: int | None = None,
        normalize: Literal["true", "pred", "all", "none"] | None = None,
        ignore_index: int | None = None,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.size = _check_args(task, num_classes, num_labels, threshold, ignore_index=ignore_index)
        _check_normalize(normalize)
        self.task, self.num_classes, self.num_labels = task, num_classes, num_labels
        self.threshold, self.normalize = threshold, normalize
        self.ignore_index, self.validate_args = ignore_index, validate_args
        shape = {"binary": (2, 2), "multiclass": (self.size, self.size), "multilabel": (self.size, 2, 2)}[task]
        self.add_state("confmat", torch.zeros(shape, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Count a batch."""
        preds, target = _format(
            preds, target, self.task, self.size, self.threshold, 1, self.ignore_index, self.validate_args
        )
        self.confmat = self.confmat + _confusion_matrix_update(preds, target, self.task, self.size)

    def compute(self) -> Tensor:
        """The confusion matrix of everything seen (all processes), normalized as asked."""
        return _confusion_matrix_compute(self.confmat, self.normalize)
