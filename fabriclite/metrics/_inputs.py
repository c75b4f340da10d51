"""Arguments and inputs of the classification and curve metrics, checked and formatted in one place: the task
(binary, multiclass, multilabel) and its size, the shapes and ranges of ``preds`` and ``target``, scores turned into
probabilities or labels, ignored samples dropped. Every check is a reduction over the tensor (no per-element
Python); the offending value is looked up only on the way to an error.

Inputs:

- ``task="binary"``: ``preds`` of shape ``(N, ...)``, labels 0/1 or float scores turned into labels by
  ``preds > threshold`` (scores outside [0, 1] are taken for logits and go through a sigmoid first);
  ``target`` 0/1 of the same shape.
- ``task="multiclass"``: ``preds`` of shape ``(N, ...)`` holding labels, or float scores ``(N, C, ...)`` reduced by
  argmax (with ``top_k > 1``: a sample counts as predicting its target when the target is among its ``top_k``
  highest scores, as its top-1 class otherwise); ``target`` of shape ``(N, ...)`` in ``[0, C)``.
- ``task="multilabel"``: ``preds`` and ``target`` of shape ``(N, L, ...)``, as for binary, one column per label.

Extra dimensions ``...`` count as more samples. Targets equal to ``ignore_index`` are left out.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import torch
from torch import Tensor

Task = Literal["binary", "multiclass", "multilabel"]
Average = Optional[Literal["micro", "macro", "weighted", "none"]]

_TASKS = ("binary", "multiclass", "multilabel")
_AVERAGES = ("micro", "macro", "weighted", "none", None)
_NORMALIZE = ("true", "pred", "all", "none", None)
Thresholds = Union[int, list, Tensor, None]


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
    scores = task == "multiclass" and preds.is_floating_point()
    preds, target = _flatten(preds, target, task, size, ignore_index, class_dim=scores or task == "multilabel")
    if scores:
        preds = _top_k_labels(preds, target, top_k or 1)
    elif preds.is_floating_point():
        preds = _probabilities(preds, "sigmoid") > threshold
    return preds.long(), target


def _flatten(
    preds: Tensor, target: Tensor, task: str, size: int, ignore_index: int | None, class_dim: bool
) -> tuple[Tensor, Tensor]:
    """Samples along dim 0, extra dimensions folded in: ``preds`` ``(M,)``, or ``(M, size)`` when it has a class or
    label dimension; ``target`` ``(M,)`` with ignored samples dropped, or multilabel ``(M, L)`` with ignored entries
    set to -1."""
    preds = preds.movedim(1, -1).reshape(-1, size) if class_dim else preds.reshape(-1)
    if task == "multilabel":
        target = target.movedim(1, -1).reshape(-1, size).long()
        if ignore_index is not None:
            target = target.masked_fill(target == ignore_index, -1)
        return preds, target
    target = target.reshape(-1).long()
    if ignore_index is not None:
        keep = target != ignore_index
        preds, target = preds[keep], target[keep]
    return preds, target


def _top_k_labels(scores: Tensor, target: Tensor, top_k: int) -> Tensor:
    """One label per sample: the argmax, or with ``top_k > 1`` the target when it is among the k best scores."""
    if top_k == 1:
        return scores.max(1).indices  # argmax's value, but faster on CPU for few classes
    best = scores.topk(top_k, dim=1).indices
    return torch.where((best == target.unsqueeze(1)).any(1), target, best[:, 0])


def _safe_divide(num: Tensor, denom: Tensor, zero_division: float = 0.0) -> Tensor:
    num = num if num.is_floating_point() else num.float()
    denom = denom if denom.is_floating_point() else denom.float()
    return torch.where(denom != 0, num / denom, torch.full_like(num, zero_division))


# ----------------------------------------------------------------------------------------------- curve inputs


def _adjust_thresholds(thresholds: Thresholds) -> Tensor | None:
    """``thresholds`` as an increasing 1-D float tensor in [0, 1], or None for exact curves."""
    if thresholds is None:
        return None
    if isinstance(thresholds, bool):
        raise ValueError(f"thresholds must be None, an int, a list of floats or a 1-D tensor, got {thresholds!r}")
    if isinstance(thresholds, int):
        if thresholds < 2:
            raise ValueError(
                f"thresholds as an int is how many evenly spaced values in [0, 1]; it must be >= 2, got {thresholds}"
            )
        return torch.linspace(0, 1, thresholds)
    if isinstance(thresholds, (list, tuple)):
        thresholds = torch.tensor(thresholds, dtype=torch.float32)
    if not isinstance(thresholds, Tensor):
        raise ValueError(
            f"thresholds must be None, an int, a list of floats or a 1-D tensor, got {type(thresholds).__name__}"
        )
    if thresholds.ndim != 1 or thresholds.numel() == 0 or not thresholds.is_floating_point():
        raise ValueError(
            f"thresholds must be a non-empty 1-D float tensor, got {thresholds.dtype} of shape {tuple(thresholds.shape)}"
        )
    if bool((thresholds[1:] <= thresholds[:-1]).any()) or bool((thresholds < 0).any() | (thresholds > 1).any()):
        raise ValueError(f"thresholds must be strictly increasing values in [0, 1], got {thresholds.tolist()}")
    return thresholds


def _check_curve_args(
    task: Any, num_classes: Any, num_labels: Any, ignore_index: Any, average: Any = "macro", max_fpr: Any = None
) -> int:
    size = _check_task(task, num_classes, num_labels)
    if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
        raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
    allowed = (
        ("micro", "macro", "weighted", "none", None) if task == "multilabel" else ("macro", "weighted", "none", None)
    )
    if average not in allowed:
        raise ValueError(f"average must be one of {allowed} for task={task!r}, got {average!r}")
    if max_fpr is not None:
        if task != "binary":
            raise ValueError(f"max_fpr (partial AUROC) applies to task='binary' only, got task={task!r}")
        if isinstance(max_fpr, bool) or not isinstance(max_fpr, (int, float)) or not 0 < max_fpr <= 1:
            raise ValueError(f"max_fpr must be a float in (0, 1], got {max_fpr!r}")
    return size


def _check_curve_inputs(preds: Tensor, target: Tensor, task: str, size: int, ignore_index: int | None) -> None:
    _check_pair(preds, target)
    if not preds.is_floating_point():
        raise TypeError(
            f"preds must hold float scores (probabilities or logits) to rank samples by, got a {preds.dtype} tensor. "
            "Hard labels give no ranking: for them use Accuracy, Precision, Recall or ConfusionMatrix."
        )
    _check_labels(target)
    _check_not_nan(preds)
    if task == "multiclass":
        expected = (target.shape[0], size, *target.shape[1:]) if target.ndim else None
        if expected is None or tuple(preds.shape) != expected:
            raise ValueError(
                f"task='multiclass' expects preds of shape (N, num_classes={size}, ...) matching target "
                f"{tuple(target.shape)}, i.e. {expected}; got {tuple(preds.shape)}"
            )
        _check_range(target, "target", size, ignore_index, f"class indices for num_classes={size}")
        return
    if preds.shape != target.shape or (task == "multilabel" and (preds.ndim < 2 or preds.shape[1] != size)):
        expected = "the same shape" if task == "binary" else f"shape (N, num_labels={size}, ...)"
        raise ValueError(
            f"task={task!r} expects preds and target of {expected}, got {tuple(preds.shape)} and {tuple(target.shape)}"
        )
    _check_range(target, "target", 2, ignore_index, "binary labels")


def _format_curve(
    preds: Tensor, target: Tensor, task: str, size: int, ignore_index: int | None, validate_args: bool
) -> tuple[Tensor, Tensor]:
    """Probabilities and int64 targets: ``(M,)`` binary, ``(M, C)`` scores with ``(M,)`` targets multiclass (ignored
    samples dropped), ``(M, L)`` both multilabel (ignored entries of ``target`` set to -1)."""
    if validate_args:
        _check_curve_inputs(preds, target, task, size, ignore_index)
    preds, target = _flatten(preds, target, task, size, ignore_index, class_dim=task != "binary")
    return _probabilities(preds, "softmax" if task == "multiclass" else "sigmoid"), target
