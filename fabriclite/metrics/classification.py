"""Classification metrics built on counts: Accuracy, Precision, Recall, F1Score, FBetaScore, ConfusionMatrix, and
their functional forms. Names, arguments and defaults follow torchmetrics' task wrappers
(``Accuracy(task="multiclass", num_classes=10)`` averages ``"micro"``); values equal scikit-learn's.

Inputs:

- ``task="binary"``: ``preds`` of shape ``(N, ...)``, labels 0/1 or float scores turned into labels by
  ``preds > threshold`` (scores outside [0, 1] are taken for logits and go through a sigmoid first);
  ``target`` 0/1 of the same shape.
- ``task="multiclass"``: ``preds`` of shape ``(N, ...)`` holding labels, or float scores ``(N, C, ...)`` reduced by
  argmax (with ``top_k > 1``: a sample counts as predicting its target when the target is among its ``top_k``
  highest scores, as its top-1 class otherwise); ``target`` of shape ``(N, ...)`` in ``[0, C)``.
- ``task="multilabel"``: ``preds`` and ``target`` of shape ``(N, L, ...)``, as for binary, one column per label.

Extra dimensions ``...`` count as more samples. Targets equal to ``ignore_index`` are left out. The state is four
count vectors (true/false positives/negatives per class), so memory does not grow with the data.

Macro averages and classes that never occur. With ``average="macro"`` a multiclass class that appears in neither
``preds`` nor ``target`` of all the data seen is left out of the average (torchmetrics' rule; for Accuracy,
Precision and Recall with ``top_k > 1``, a class absent from ``target``). scikit-learn without ``labels=`` does the
same, since it averages over the classes present in ``y_true`` or ``y_pred``. scikit-learn with ``labels=range(num_classes)`` instead counts such a
class with the score ``zero_division`` (0 by default), which pulls the average down. To get that value, take the
mean of the per-class scores: ``F1Score(task="multiclass", num_classes=C, average="none").compute().mean()`` (the
absent class holds ``zero_division`` there). Two related differences: ``balanced_accuracy_score`` averages recall
over the classes present in ``y_true`` only, so it equals ``Accuracy(average="macro")`` (= macro recall) whenever
every predicted class also occurs in the target; and multilabel macro averages always count every label, as
scikit-learn does.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from torch import Tensor

from fabriclite.metrics.metric import Metric

Task = Literal["binary", "multiclass", "multilabel"]
Average = Optional[Literal["micro", "macro", "weighted", "none"]]

_TASKS = ("binary", "multiclass", "multilabel")
_AVERAGES = ("micro", "macro", "weighted", "none", None)
_NORMALIZE = ("true", "pred", "all", "none", None)


# ------------------------------------------------------------------------------------------------- arguments


def _check_task(task: Any, num_classes: Any, num_labels: Any) -> int:
    """Validate the task and return the number of classes (multiclass), labels (multilabel), or 1 (binary)."""
    if task not in _TASKS:
        raise ValueError(f"task must be one of {_TASKS}, got {task!r}")
    if task == "multiclass":
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"task='multiclass' needs num_classes, an int >= 2, got {num_classes!r}")
        return num_classes
    if task == "multilabel":
        if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"task='multilabel' needs num_labels, an int >= 1, got {num_labels!r}")
        return num_labels
    return 1


def _check_args(
    task: Any,
    num_classes: Any,
    num_labels: Any,
    threshold: Any = 0.5,
    average: Any = "micro",
    top_k: Any = 1,
    ignore_index: Any = None,
    zero_division: Any = 0,
) -> int:
    """Validate the arguments every count-based metric takes; done once, at construction or at a functional call."""
    size = _check_task(task, num_classes, num_labels)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be a float in [0, 1], got {threshold!r}")
    if average not in _AVERAGES:
        raise ValueError(f"average must be one of {_AVERAGES}, got {average!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if (top_k or 1) > 1 and task != "multiclass":
        raise ValueError(f"top_k > 1 applies to task='multiclass' only, got top_k={top_k} with task={task!r}")
    if (top_k or 1) > size and task == "multiclass":
        raise ValueError(f"top_k ({top_k}) cannot exceed num_classes ({size})")
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
    if zero_division not in (0, 1):
        raise ValueError(f"zero_division must be 0 or 1, got {zero_division!r}")
    return size


# ------------------------------------------------------------------------------------------- input checking
# Every check is a reduction over the tensor (no per-element Python); the offending value is looked up only on
# the way to an error.


def _check_pair(preds: Any, target: Any) -> None:
    for name, value in (("preds", preds), ("target", target)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if preds.device != target.device:
        raise ValueError(f"preds is on {preds.device} but target is on {target.device}; put both on the same device")


def _check_labels(target: Tensor, name: str = "target") -> None:
    if target.is_floating_point() or target.is_complex():
        raise TypeError(
            f"{name} must hold integer class labels (an integer or bool tensor), got a {target.dtype} tensor. "
            f"If the values are labels stored as floats, pass {name}.long()."
        )


def _check_not_nan(preds: Tensor, name: str = "preds") -> None:
    # The sum is NaN whenever an element is (one fast reduction, no bool copy of the input); it can also be NaN
    # from +inf and -inf together, which the exact check then clears.
    if preds.is_floating_point() and bool(torch.isnan(preds.sum())) and bool(torch.isnan(preds).any()):
        raise ValueError(f"{name} contains NaN; a score must be a number (check the model's outputs or the loss)")


def _check_range(values: Tensor, name: str, high: int, ignore_index: int | None, what: str) -> None:
    """Raise unless every value is in ``[0, high)`` or equals ``ignore_index``."""
    if values.numel() == 0 or values.dtype == torch.bool:
        return
    if ignore_index is None:
        low_value, high_value = torch.aminmax(values)
        if low_value >= 0 and high_value < high:
            return
        valid = (values >= 0) & (values < high)
    else:
        valid = ((values >= 0) & (values < high)) | (values == ignore_index)
        if bool(valid.all()):
            return
    bad = values[~valid][0].item()
    hint = f" or ignore_index={ignore_index}" if ignore_index is not None else ""
    raise ValueError(f"{name} holds {bad}, but {what} must be in [0, {high - 1}]{hint}")


def _check_inputs(
    preds: Tensor, target: Tensor, task: str, size: int, ignore_index: int | None, top_k: int = 1
) -> None:
    _check_pair(preds, target)
    _check_labels(target)
    _check_not_nan(preds)
    scores = preds.is_floating_point()
    if task == "binary":
        if preds.shape != target.shape:
            raise ValueError(
                f"task='binary' expects preds and target of the same shape, got {tuple(preds.shape)} and {tuple(target.shape)}"
            )
        if not scores:
            _check_range(preds, "preds", 2, None, "binary labels")
        _check_range(target, "target", 2, ignore_index, "binary labels")
    elif task == "multiclass":
        if scores:
            expected = (target.shape[0], size, *target.shape[1:]) if target.ndim else None
            if preds.shape == target.shape:
                raise ValueError(
                    f"preds is a float tensor of target's shape {tuple(target.shape)}. Class scores (probabilities or "
                    f"logits) need a class dimension, shape {expected}; labels must be an integer tensor (preds.long())."
                )
            if expected is None or tuple(preds.shape) != expected:
                raise ValueError(
                    f"preds holds float scores, so its shape must be (N, num_classes={size}, ...) matching target "
                    f"{tuple(target.shape)}, i.e. {expected}; got {tuple(preds.shape)}"
                )
        else:
            if (top_k or 1) > 1:
                raise ValueError("top_k > 1 needs float scores of shape (N, num_classes, ...), but preds holds labels")
            if preds.shape != target.shape:
                raise ValueError(
                    f"preds holds integer labels, so it must have target's shape {tuple(target.shape)}, got "
                    f"{tuple(preds.shape)}; for class scores pass a float tensor of shape (N, {size}, ...)"
                )
            _check_range(preds, "preds", size, None, f"class indices for num_classes={size}")
        _check_range(target, "target", size, ignore_index, f"class indices for num_classes={size}")
    else:
        if preds.shape != target.shape or preds.ndim < 2 or preds.shape[1] != size:
            raise ValueError(
                f"task='multilabel' expects preds and target of shape (N, num_labels={size}, ...), got "
                f"{tuple(preds.shape)} and {tuple(target.shape)}"
            )
        if not scores:
            _check_range(preds, "preds", 2, None, "multilabel labels")
        _check_range(target, "target", 2, ignore_index, "multilabel labels")


# ------------------------------------------------------------------------------------------------ formatting


def _probabilities(scores: Tensor, normalization: Literal["sigmoid", "softmax"]) -> Tensor:
    """Scores as probabilities: unchanged inside [0, 1], else taken for logits (torchmetrics' rule, per call)."""
    if scores.numel() == 0:
        return scores
    low, high = torch.aminmax(scores)
    if bool((low < 0) | (high > 1)):
        return scores.sigmoid() if normalization == "sigmoid" else scores.softmax(1)
    return scores


def _format(
    preds: Tensor,
    target: Tensor,
    task: str,
    size: int,
    threshold: float = 0.5,
    top_k: int = 1,
    ignore_index: int | None = None,
    validate_args: bool = True,
) -> tuple[Tensor, Tensor]:
    """Turn the inputs into flat int64 labels.

    Binary and multiclass: ``preds`` and ``target`` of shape ``(M,)``, ignored samples dropped. Multilabel: shape
    ``(M, L)`` with ignored entries of ``target`` set to -1.
    """
    if validate_args:
        _check_inputs(preds, target, task, size, ignore_index, top_k)
    if task == "multilabel":
        preds = preds.movedim(1, -1).reshape(-1, size)
        target = target.movedim(1, -1).reshape(-1, size).long()
        if preds.is_floating_point():
            preds = _probabilities(preds, "sigmoid") > threshold
        if ignore_index is not None:
            target = target.masked_fill(target == ignore_index, -1)
        return preds.long(), target
    scores = task == "multiclass" and preds.is_floating_point()
    preds = preds.movedim(1, -1).reshape(-1, size) if scores else preds.reshape(-1)
    target = target.reshape(-1).long()
    if ignore_index is not None:
        keep = target != ignore_index
        preds, target = preds[keep], target[keep]
    if scores:
        preds = _top_k_labels(preds, target, top_k or 1)
    elif preds.is_floating_point():
        preds = _probabilities(preds, "sigmoid") > threshold
    return preds.long(), target


def _top_k_labels(scores: Tensor, target: Tensor, top_k: int) -> Tensor:
    """One label per sample: the argmax, or with ``top_k > 1`` the target when it is among the k best scores."""
    if top_k == 1:
        return scores.max(1).indices  # argmax's value, but faster on CPU for few classes
    best = scores.topk(top_k, dim=1).indices
    return torch.where((best == target.unsqueeze(1)).any(1), target, best[:, 0])


# ---------------------------------------------------------------------------------------------------- counting


def _stat_scores_update(
    preds: Tensor, target: Tensor, task: str, size: int, average: Average = "macro"
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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


def _stat_scores(
    preds: Tensor,
    target: Tensor,
    task: str,
    size: int,
    average: Average,
    threshold: float,
    top_k: int,
    ignore_index: int | None,
    validate_args: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    preds, target = _format(preds, target, task, size, threshold, top_k, ignore_index, validate_args)
    return _stat_scores_update(preds, target, task, size, average)


def _safe_divide(num: Tensor, denom: Tensor, zero_division: float = 0.0) -> Tensor:
    num = num if num.is_floating_point() else num.float()
    denom = denom if denom.is_floating_point() else denom.float()
    return torch.where(denom != 0, num / denom, torch.full_like(num, zero_division))


def _average(
    num: Tensor, denom: Tensor, stats: tuple[Tensor, ...], task: str, average: Average, top_k: int, zero_division: float
) -> Tensor:
    """``num / denom`` per class, averaged as asked (``micro`` sums the counts before dividing)."""
    if task == "binary":
        return _safe_divide(num, denom, zero_division)
    if average == "micro":
        return _safe_divide(num.sum(), denom.sum(), zero_division)
    score = _safe_divide(num, denom, zero_division)
    if average in ("none", None):
        return score
    tp, fp, _, fn = stats
    if average == "weighted":
        weights = (tp + fn).float()
    elif task == "multiclass":
        # torchmetrics' rule (see the module docstring): a class that never occurred does not count
        absent = (tp + fp + fn == 0) if (top_k or 1) == 1 else (tp + fn == 0)
        weights = (~absent).float()
    else:
        weights = torch.ones_like(score)
    return _safe_divide((weights * score).sum(), weights.sum())


def _accuracy_compute(stats: tuple[Tensor, ...], task: str, average: Average, top_k: int = 1) -> Tensor:
    tp, fp, tn, fn = stats
    if task == "multiclass":  # each sample is one positive for its target class: accuracy is recall
        return _average(tp, tp + fn, stats, task, average, top_k, 0)
    return _average(tp + tn, tp + tn + fp + fn, stats, task, average, top_k, 0)


def _precision_compute(
    stats: tuple[Tensor, ...], task: str, average: Average, top_k: int, zero_division: float
) -> Tensor:
    tp, fp, _, _ = stats
    return _average(tp, tp + fp, stats, task, average, top_k, zero_division)


def _recall_compute(stats: tuple[Tensor, ...], task: str, average: Average, top_k: int, zero_division: float) -> Tensor:
    tp, _, _, fn = stats
    return _average(tp, tp + fn, stats, task, average, top_k, zero_division)


def _fbeta_compute(stats: tuple[Tensor, ...], beta: float, task: str, average: Average, zero_division: float) -> Tensor:
    tp, fp, _, fn = stats
    # F from the counts rather than from precision and recall: defined (and equal to scikit-learn's) even when
    # one of them is 0/0
    weighted_tp = (1 + beta**2) * tp
    # top_k=1 on purpose: torchmetrics' F-scores leave out of the macro average only the classes with no tp, fp
    # or fn even with top_k > 1 (its precision and recall leave out the classes absent from the target)
    return _average(weighted_tp, weighted_tp + beta**2 * fn + fp, stats, task, average, 1, zero_division)


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
    stats = _stat_scores(preds, target, task, size, average, threshold, top_k, ignore_index, validate_args)
    return _accuracy_compute(stats, task, average, top_k)


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
    stats = _stat_scores(preds, target, task, size, average, threshold, top_k, ignore_index, validate_args)
    return _precision_compute(stats, task, average, top_k, zero_division)


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
    stats = _stat_scores(preds, target, task, size, average, threshold, top_k, ignore_index, validate_args)
    return _recall_compute(stats, task, average, top_k, zero_division)


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
    stats = _stat_scores(preds, target, task, size, average, threshold, top_k, ignore_index, validate_args)
    return _fbeta_compute(stats, beta, task, average, zero_division)


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
    return fbeta_score(
        preds,
        target,
        task,
        1.0,
        threshold,
        num_classes,
        num_labels,
        average,
        top_k,
        ignore_index,
        validate_args,
        zero_division,
    )


def _confusion_matrix_update(preds: Tensor, target: Tensor, task: str, size: int) -> Tensor:
    """Counts ``[target, pred]``: (2, 2) binary, (C, C) multiclass, (L, 2, 2) multilabel."""
    if task == "multilabel":
        cells = torch.arange(size, device=preds.device) * 4 + target * 2 + preds
        return torch.bincount(cells[target >= 0], minlength=4 * size).reshape(size, 2, 2)
    classes = 2 if task == "binary" else size
    return torch.bincount(target * classes + preds, minlength=classes * classes).reshape(classes, classes)


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
        tp, fp, tn, fn = _stat_scores(
            preds,
            target,
            self.task,
            self.size,
            self.average,
            self.threshold,
            self.top_k,
            self.ignore_index,
            self.validate_args,
        )
        self.tp, self.fp, self.tn, self.fn = self.tp + tp, self.fp + fp, self.tn + tn, self.fn + fn

    @property
    def _stats(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
        return _accuracy_compute(self._stats, self.task, self.average, self.top_k)


class Precision(_StatScores):
    """Precision, as ``torchmetrics.Precision``.

    Usage: ``Precision(task="multiclass", num_classes=10, average="macro")``.
    """

    def compute(self) -> Tensor:
        """The precision of everything seen (all processes)."""
        return _precision_compute(self._stats, self.task, self.average, self.top_k, self.zero_division)


class Recall(_StatScores):
    """Recall, as ``torchmetrics.Recall``.

    Usage: ``Recall(task="binary", threshold=0.3)``.
    """

    def compute(self) -> Tensor:
        """The recall of everything seen (all processes)."""
        return _recall_compute(self._stats, self.task, self.average, self.top_k, self.zero_division)


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
        super().__init__(
            task,
            threshold,
            num_classes,
            num_labels,
            average,
            top_k,
            ignore_index,
            validate_args,
            zero_division,
            **kwargs,
        )
        self.beta = _check_beta(beta)

    def compute(self) -> Tensor:
        """The F-beta score of everything seen (all processes)."""
        return _fbeta_compute(self._stats, self.beta, self.task, self.average, self.zero_division)


class F1Score(FBetaScore):
    """F1 score, as ``torchmetrics.F1Score``.

    Usage: ``F1Score(task="multiclass", num_classes=10, average="macro")``.
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
        zero_division: float = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            task,
            1.0,
            threshold,
            num_classes,
            num_labels,
            average,
            top_k,
            ignore_index,
            validate_args,
            zero_division,
            **kwargs,
        )


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
