"""Curve metrics equal scikit-learn: exact curves point for point, binned ones as the exact curve of scores
rounded down to the threshold grid, whose state does not grow with the data."""

from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from metric_tester import (
    assert_close,
    binary_inputs,
    check_metric,
    drop_ignored,
    multiclass_inputs,
    multilabel_inputs,
    per_label,
    sigmoid_if_logits,
    softmax_if_logits,
)
from sklearn import metrics as skm

from fabriclite.metrics import AUROC, ROC, AveragePrecision, PrecisionRecallCurve
from fabriclite.metrics import functional as F
from fabriclite.metrics._curve_points import _sort_descending

C = 4
N = 240
SIZES = [23, 57, 40, 80, 40]  # uneven, and each batch large enough to hold both classes (a curve needs them)


def check_curve(metric, inputs, reference, functional):
    check_metric(metric, inputs, reference, SIZES, functional)


# ----------------------------------------------------------------------------------------------- exact values


@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_binary_auroc_equals_roc_auc_score(kind):
    inputs = binary_inputs(N, seed=1, kind=kind)
    check_curve(AUROC(task="binary"), inputs, lambda p, t: skm.roc_auc_score(t, p), partial(F.auroc, task="binary"))


@pytest.mark.parametrize("max_fpr", [0.1, 0.5])
def test_binary_partial_auroc_equals_roc_auc_score_with_max_fpr(max_fpr):
    inputs = binary_inputs(N, seed=2, kind="logits")
    kwargs = dict(task="binary", max_fpr=max_fpr)
    check_curve(
        AUROC(**kwargs), inputs, lambda p, t: skm.roc_auc_score(t, p, max_fpr=max_fpr), partial(F.auroc, **kwargs)
    )


@pytest.mark.parametrize("average", ["macro", "weighted", "none"])
@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_multiclass_auroc_equals_one_vs_rest_roc_auc_score(kind, average):
    inputs = multiclass_inputs(N, C, seed=3, kind=kind)

    def reference(preds, target):
        probs = softmax_if_logits(preds)
        if average == "none":
            return np.array([skm.roc_auc_score(target == c, probs[:, c]) for c in range(C)])
        return skm.roc_auc_score(target, probs, multi_class="ovr", average=average, labels=list(range(C)))

    kwargs = dict(task="multiclass", num_classes=C, average=average)
    check_curve(AUROC(**kwargs), inputs, reference, partial(F.auroc, **kwargs))


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
def test_multilabel_auroc_equals_roc_auc_score(average):
    inputs = multilabel_inputs(N, 3, seed=4, kind="logits")
    kwargs = dict(task="multilabel", num_labels=3, average=average)

    def reference(preds, target):
        return skm.roc_auc_score(target, sigmoid_if_logits(preds), average=None if average == "none" else average)

    check_curve(AUROC(**kwargs), inputs, reference, partial(F.auroc, **kwargs))


def test_binary_average_precision_equals_average_precision_score():
    inputs = binary_inputs(N, seed=5, kind="logits")
    reference = lambda p, t: skm.average_precision_score(t, p)  # noqa: E731
    check_curve(AveragePrecision(task="binary"), inputs, reference, partial(F.average_precision, task="binary"))


@pytest.mark.parametrize("average", ["macro", "weighted", "none"])
def test_multiclass_average_precision_equals_average_precision_score(average):
    inputs = multiclass_inputs(N, C, seed=6, kind="logits")
    kwargs = dict(task="multiclass", num_classes=C, average=average)

    def reference(preds, target):
        return skm.average_precision_score(
            target, softmax_if_logits(preds), average=None if average == "none" else average
        )

    check_curve(AveragePrecision(**kwargs), inputs, reference, partial(F.average_precision, **kwargs))


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
def test_multilabel_average_precision_equals_average_precision_score(average):
    inputs = multilabel_inputs(N, 3, seed=7)
    kwargs = dict(task="multilabel", num_labels=3, average=average)

    def reference(preds, target):
        return skm.average_precision_score(target, preds, average=None if average == "none" else average)

    check_curve(AveragePrecision(**kwargs), inputs, reference, partial(F.average_precision, **kwargs))


def sklearn_roc(preds, target):
    fpr, tpr, thresholds = skm.roc_curve(target, preds, drop_intermediate=False)
    return fpr, tpr, thresholds


def test_binary_roc_equals_roc_curve_without_dropped_points_and_starts_at_threshold_one():
    inputs = binary_inputs(N, seed=8)
    # ties, so that several samples share a point of the curve
    inputs = (torch.round(inputs[0] * 20) / 20, inputs[1])
    metric = ROC(task="binary")
    metric.update(*inputs)
    fpr, tpr, thresholds = metric.compute()
    expected_fpr, expected_tpr, expected_thresholds = sklearn_roc(*(t.numpy() for t in inputs))
    assert_close(fpr, expected_fpr)
    assert_close(tpr, expected_tpr)
    assert thresholds[0] == 1.0  # scikit-learn: inf
    assert_close(thresholds[1:], expected_thresholds[1:])
    assert_close(F.roc(*inputs, task="binary"), (fpr, tpr, thresholds))


def test_multiclass_roc_is_one_curve_per_class_each_equal_to_roc_curve():
    preds, target = multiclass_inputs(N, C, seed=9, kind="probs")
    fprs, tprs, thresholds = ROC(task="multiclass", num_classes=C)(preds, target)
    for c in range(C):
        expected = sklearn_roc(preds[:, c].numpy(), (target == c).numpy())
        assert_close(
            (fprs[c], tprs[c], thresholds[c][1:]), (expected[0], expected[1], expected[2][1:]), what=f"class {c}"
        )


@pytest.mark.parametrize("kind", ["probs", "logits"])
def test_binary_precision_recall_curve_equals_sklearn(kind):
    inputs = binary_inputs(N, seed=10, kind=kind)

    def reference(preds, target):
        return skm.precision_recall_curve(target, sigmoid_if_logits(preds))

    check_curve(
        PrecisionRecallCurve(task="binary"), inputs, reference, partial(F.precision_recall_curve, task="binary")
    )


def test_multilabel_precision_recall_curve_is_one_curve_per_label():
    preds, target = multilabel_inputs(N, 3, seed=11)
    precisions, recalls, thresholds = F.precision_recall_curve(preds, target, "multilabel", num_labels=3)
    for j in range(3):
        expected = skm.precision_recall_curve(target[:, j].numpy(), preds[:, j].numpy())
        assert_close((precisions[j], recalls[j], thresholds[j]), expected, what=f"label {j}")


def test_curve_ignore_index_leaves_samples_or_entries_out():
    preds, target = multiclass_inputs(N, C, seed=12, kind="probs")
    target = target.clone()
    target[3::6] = -1
    p, t = drop_ignored(preds.numpy(), target.numpy(), -1)
    expected = skm.roc_auc_score(t, p, multi_class="ovr")
    assert_close(F.auroc(preds, target, "multiclass", num_classes=C, ignore_index=-1), expected)

    preds, target = multilabel_inputs(N, 3, seed=13)
    target = target.clone()
    target[::4, 0] = -1
    expected = per_label(skm.average_precision_score, preds.numpy(), target.numpy(), "macro", -1)
    metric = AveragePrecision(task="multilabel", num_labels=3, ignore_index=-1)
    for batch in zip(preds.split(50), target.split(50)):
        metric.update(*batch)
    assert_close(metric.compute(), expected)


# ---------------------------------------------------------------------------------------------------- binned


def rounded_down(scores: np.ndarray, thresholds: torch.Tensor) -> np.ndarray:
    """Each score replaced by how many thresholds it reaches: the scores a binned curve sees exactly."""
    return np.searchsorted(thresholds.numpy(), scores.astype(np.float32), side="right")


@pytest.mark.parametrize("thresholds", [10, 101, [0.0, 0.2, 0.25, 0.7, 1.0], torch.linspace(0, 1, 33)])
def test_binned_binary_auroc_and_average_precision_equal_sklearn_on_scores_rounded_to_the_grid(thresholds):
    inputs = binary_inputs(N, seed=14)
    grid = (
        torch.linspace(0, 1, thresholds)
        if isinstance(thresholds, int)
        else torch.as_tensor(thresholds, dtype=torch.float32)
    )
    kwargs = dict(task="binary", thresholds=thresholds)
    auroc_reference = lambda p, t: skm.roc_auc_score(t, rounded_down(p, grid))  # noqa: E731
    check_curve(AUROC(**kwargs), inputs, auroc_reference, partial(F.auroc, **kwargs))
    ap_reference = lambda p, t: skm.average_precision_score(t, rounded_down(p, grid))  # noqa: E731
    check_curve(AveragePrecision(**kwargs), inputs, ap_reference, partial(F.average_precision, **kwargs))


@pytest.mark.parametrize("average", ["macro", "weighted"])
def test_binned_multiclass_auroc_equals_per_class_sklearn_on_rounded_scores(average):
    preds, target = multiclass_inputs(N, C, seed=15, kind="probs")
    grid = torch.linspace(0, 1, 50)
    metric = AUROC(task="multiclass", num_classes=C, thresholds=50, average=average)
    for batch in zip(preds.split(70), target.split(70)):
        metric.update(*batch)
    per_class = np.array([skm.roc_auc_score(target == c, rounded_down(preds[:, c].numpy(), grid)) for c in range(C)])
    weights = np.ones(C) if average == "macro" else np.bincount(target, minlength=C)
    assert_close(metric.compute(), (per_class * weights).sum() / weights.sum())


def test_binned_roc_and_precision_recall_points_count_the_scores_at_or_above_each_threshold():
    preds, target = binary_inputs(N, seed=16)
    grid = torch.linspace(0, 1, 21)
    p, t = preds.numpy(), target.numpy().astype(bool)
    at_least = p[:, None] >= grid.numpy()[None, :]
    tps, fps = (at_least & t[:, None]).sum(0), (at_least & ~t[:, None]).sum(0)

    fpr, tpr, thresholds = F.roc(preds, target, "binary", thresholds=21)
    assert_close(fpr, (fps / (~t).sum())[::-1])
    assert_close(tpr, (tps / t.sum())[::-1])
    assert_close(thresholds, grid.numpy()[::-1])

    precision, recall, thresholds = F.precision_recall_curve(preds, target, "binary", thresholds=21)
    with np.errstate(invalid="ignore"):
        expected_precision = np.append(tps / (tps + fps), 1.0)  # NaN where no score reaches the threshold
    assert_close(precision, expected_precision)
    assert_close(recall, np.append(tps / t.sum(), 0.0))
    assert_close(thresholds, grid)


def test_binned_multilabel_roc_is_a_tensor_per_label_and_threshold():
    preds, target = multilabel_inputs(N, 3, seed=17)
    fpr, tpr, thresholds = ROC(task="multilabel", num_labels=3, thresholds=11)(preds, target)
    assert fpr.shape == tpr.shape == (3, 11) and thresholds.shape == (11,)
    for j in range(3):
        single = F.roc(preds[:, j], target[:, j], "binary", thresholds=11)
        assert_close((fpr[j], tpr[j]), single[:2])


def test_binned_state_has_the_same_size_whatever_the_number_of_samples():
    metric = AUROC(task="multiclass", num_classes=C, thresholds=100)
    sizes = []
    for seed in range(5):
        metric.update(*multiclass_inputs(1000 * (seed + 1), C, seed=seed, kind="probs"))
        sizes.append(sum(v.numel() * v.element_size() for v in metric.metric_state.values()))
    assert len(set(sizes)) == 1 and sizes[0] == C * 2 * 101 * 8


def test_binned_thresholds_must_be_increasing_values_in_zero_one():
    for bad in ([0.5, 0.2], [0.1, 1.5], 1, torch.zeros(2, 2)):
        with pytest.raises(ValueError, match="thresholds"):
            AUROC(task="binary", thresholds=bad)


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(allow_nan=False, width=32), max_size=60),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_property_the_integer_key_sort_orders_any_floats_as_torch_sort(values, dtype):
    scores = torch.tensor(values, dtype=dtype)
    ordered, order = _sort_descending(scores)
    assert torch.equal(ordered, torch.sort(scores, descending=True).values)
    assert torch.equal(scores[order], ordered)
