"""The points of a curve from a metric's state, for the curve metrics: the binned state (a histogram of scores per
class and target) and its counts per threshold, and the exact curves over every distinct score, computed as
scikit-learn does (``_binary_clf_curve``) but with a faster sort.
"""

from __future__ import annotations

import warnings
from typing import Union

import torch
from torch import Tensor

from fabriclite.metrics._inputs import _safe_divide

# (preds, target) for exact curves, a histogram for binned ones
CurveState = Union[tuple[Tensor, Tensor], Tensor]


# ---------------------------------------------------------------------------------------------- binned state


def _binned_update(preds: Tensor, target: Tensor, thresholds: Tensor, task: str, size: int) -> Tensor:
    """Histogram ``[class, is_positive, bucket]``; bucket ``b`` holds scores with exactly ``b`` thresholds <= score."""
    buckets = thresholds.numel() + 1
    bucket = torch.bucketize(preds.contiguous(), thresholds.to(preds.dtype), right=True)
    if task == "binary":
        return torch.bincount(target * buckets + bucket, minlength=2 * buckets).reshape(2, buckets)
    if task == "multiclass":
        positive = (target.unsqueeze(1) == torch.arange(size, device=target.device)).long()
    else:
        positive = target
    cells = (torch.arange(size, device=target.device) * 2 + positive) * buckets + bucket
    if task == "multilabel":
        cells = cells[target >= 0]
    return torch.bincount(cells.reshape(-1), minlength=size * 2 * buckets).reshape(size, 2, buckets)


def _binned_counts(hist: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """True and false positives at each threshold (score >= threshold), and the totals of positives and negatives."""
    at_least = hist.flip(-1).cumsum(-1).flip(-1)[..., 1:]  # drop bucket 0: below every threshold
    totals = hist.sum(-1, keepdim=True)
    return at_least[..., 1, :], at_least[..., 0, :], totals[..., 1, :], totals[..., 0, :]


# ----------------------------------------------------------------------------------------------- exact curves


def _sort_descending(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Scores from high to low, and the permutation that sorts them.

    Sorted through integer keys in the same order as the floats: on the CPU torch sorts integers by radix, several
    times faster than floats (1M scores: about 20 ms instead of 90 ms), and the sort dominates an exact curve.
    """
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}.get(scores.dtype)
    if int_dtype is None:
        return torch.sort(scores, descending=True)
    bits = (scores + 0.0).view(int_dtype)  # + 0.0 turns -0.0 into 0.0, which it must tie with
    # Positive floats order like their bits; negative ones in reverse, so flip all but their sign bit. Then ~
    # reverses the whole order, so that an ascending sort (the fast one) yields descending scores.
    keys = ~(bits ^ ((bits >> (8 * bits.element_size() - 1)) & torch.iinfo(int_dtype).max))
    order = torch.sort(keys, stable=True).indices
    return scores[order], order


def _clf_curve(preds: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """False and true positives at every distinct score, scores descending (scikit-learn's ``_binary_clf_curve``)."""
    scores, order = _sort_descending(preds)
    run_ends = torch.ones_like(scores, dtype=torch.bool)
    run_ends[:-1] = scores[1:] != scores[:-1]  # the last sample of each run of equal scores
    ends = run_ends.nonzero().squeeze(1)
    tps = target[order].cumsum(0)[ends]
    return ends + 1 - tps, tps, scores[ends]


def _per_class(state: tuple[Tensor, Tensor], task: str, size: int) -> list[tuple[Tensor, Tensor]]:
    """One-vs-rest binary problems: (scores, 0/1 targets) per class or label."""
    preds, target = state
    if task == "multiclass":
        return [(preds[:, c], (target == c).long()) for c in range(size)]
    problems = []
    for label in range(size):
        valid = target[:, label] >= 0
        problems.append((preds[valid, label], target[valid, label]))
    return problems


def _as_binary(state: CurveState, thresholds: Tensor | None) -> CurveState:
    """All labels of a multilabel state as one binary problem (``average="micro"``)."""
    if thresholds is not None:
        return state.sum(0)
    preds, target = state
    valid = target >= 0
    return preds[valid], target[valid]


def _exact_roc(preds: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    fps, tps, scores = _clf_curve(preds, target)
    zero = fps.new_zeros(1)
    fps, tps = torch.cat([zero, fps]), torch.cat([zero, tps])
    thresholds = torch.cat([scores.new_ones(1), scores])  # the curve starts at (0, 0)
    if fps[-1] <= 0:
        warnings.warn(
            "No negative samples in target: the false positive rate is undefined and set to 0",
            UserWarning,
            stacklevel=3,
        )
    if tps[-1] <= 0:
        warnings.warn(
            "No positive samples in target: the true positive rate is undefined and set to 0", UserWarning, stacklevel=3
        )
    return _safe_divide(fps, fps[-1].expand_as(fps)), _safe_divide(tps, tps[-1].expand_as(tps)), thresholds


def _exact_pr(preds: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    fps, tps, scores = _clf_curve(preds, target)
    precision = tps / (tps + fps)
    if tps.numel() == 0 or tps[-1] <= 0:
        warnings.warn("No positive samples in target: recall is undefined and set to 1", UserWarning, stacklevel=3)
        recall = torch.ones_like(precision)
    else:
        recall = tps / tps[-1]
    # increasing thresholds, decreasing recall, ending at (recall 0, precision 1) as scikit-learn
    precision = torch.cat([precision.flip(0), precision.new_ones(1)])
    recall = torch.cat([recall.flip(0), recall.new_zeros(1)])
    return precision, recall, scores.flip(0)
