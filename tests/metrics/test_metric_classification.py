"""Count-based classification metrics equal scikit-learn: per batch (forward), over uneven batches (compute), and in
their functional form; with ignore_index, absent classes, zero_division, top_k, multilabel, and random inputs."""

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
    labels_of,
    multiclass_inputs,
    multilabel_inputs,
    per_label,
    uneven_sizes,
)
from sklearn import metrics as skm

from fabriclite.metrics import Accuracy, ConfusionMatrix, F1Score, FBetaScore, Precision, Recall
from fabriclite.metrics import functional as F

C = 5
N = 240

# name -> (class, functional, scikit-learn score, extra keyword arguments)
SCORES = {
    "precision": (Precision, F.precision, skm.precision_score, {}),
    "recall": (Recall, F.recall, skm.recall_score, {}),
    "f1": (F1Score, F.f1_score, skm.f1_score, {}),
    "fbeta2": (FBetaScore, F.fbeta_score, partial(skm.fbeta_score, beta=2.0), {"beta": 2.0}),
    "fbeta05": (FBetaScore, F.fbeta_score, partial(skm.fbeta_score, beta=0.5), {"beta": 0.5}),
}


def multiclass_reference(score, average, ignore_index=None, zero_division=0):
    def reference(preds, target):
        p, t = drop_ignored(labels_of(preds, "multiclass"), target, ignore_index)
        if average in (None, "none"):
            return score(t, p, average=None, labels=list(range(C)), zero_division=zero_division)
        return score(t, p, average=average, zero_division=zero_division)

    return reference


def accuracy_multiclass_reference(average, ignore_index=None):
    def reference(preds, target):
        p, t = drop_ignored(labels_of(preds, "multiclass"), target, ignore_index)
        if average == "micro":
            return skm.accuracy_score(t, p)
        # multiclass accuracy per class is recall; its macro average is macro recall
        return multiclass_reference(skm.recall_score, average)(p, t)

    return reference


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
@pytest.mark.parametrize("kind", ["logits", "probs", "labels"])
@pytest.mark.parametrize("name", list(SCORES))
def test_multiclass_scores_equal_sklearn_per_batch_and_over_uneven_batches(name, kind, average):
    cls, fn, score, extra = SCORES[name]
    inputs = multiclass_inputs(N, C, seed=1, kind=kind)
    kwargs = dict(task="multiclass", num_classes=C, average=average, **extra)
    check_metric(cls(**kwargs), inputs, multiclass_reference(score, average), uneven_sizes(N, 2), partial(fn, **kwargs))


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
@pytest.mark.parametrize("kind", ["logits", "labels"])
def test_multiclass_accuracy_equals_sklearn_accuracy_and_macro_recall(kind, average):
    inputs = multiclass_inputs(N, C, seed=3, kind=kind)
    kwargs = dict(task="multiclass", num_classes=C, average=average)
    check_metric(
        Accuracy(**kwargs),
        inputs,
        accuracy_multiclass_reference(average),
        uneven_sizes(N, 4),
        partial(F.accuracy, **kwargs),
    )


def test_accuracy_is_the_default_micro_average_of_torchmetrics_task_wrapper():
    preds, target = multiclass_inputs(N, C, seed=5)
    assert Accuracy(task="multiclass", num_classes=C).average == "micro"
    assert_close(Accuracy(task="multiclass", num_classes=C)(preds, target), skm.accuracy_score(target, preds.argmax(1)))


def test_macro_accuracy_equals_balanced_accuracy_when_every_predicted_class_occurs_in_the_target():
    preds, target = multiclass_inputs(2000, C, seed=6, kind="logits", absent=2)
    metric = Accuracy(task="multiclass", num_classes=C, average="macro")
    for batch in zip(preds.split(300), target.split(300)):
        metric.update(*batch)
    assert_close(metric.compute(), skm.balanced_accuracy_score(target, preds.argmax(1)))


@pytest.mark.parametrize("ignore_index", [-100, 0])
@pytest.mark.parametrize("name", ["precision", "recall", "f1"])
def test_multiclass_ignore_index_leaves_those_samples_out(name, ignore_index):
    cls, fn, score, extra = SCORES[name]
    preds, target = multiclass_inputs(N, C, seed=7)
    target = target.clone()
    target[2::5] = ignore_index
    kwargs = dict(task="multiclass", num_classes=C, average="macro", ignore_index=ignore_index)
    reference = multiclass_reference(score, "macro", ignore_index)
    check_metric(cls(**kwargs), (preds, target), reference, uneven_sizes(N, 8), partial(fn, **kwargs))


def test_multiclass_accuracy_with_ignore_index_counts_only_the_other_samples():
    preds, target = multiclass_inputs(N, C, seed=8, kind="labels")
    target = target.clone()
    target[1::3] = 255
    kwargs = dict(task="multiclass", num_classes=C, ignore_index=255)
    check_metric(Accuracy(**kwargs), (preds, target), accuracy_multiclass_reference("micro", 255), uneven_sizes(N, 9))


@pytest.mark.parametrize("name", ["precision", "recall", "f1"])
def test_a_class_absent_from_preds_and_target_is_left_out_of_the_macro_average_as_sklearn_without_labels(name):
    cls, fn, score, extra = SCORES[name]
    preds, target = multiclass_inputs(N, C, seed=10, absent=3)
    metric = cls(task="multiclass", num_classes=C, average="macro")
    metric.update(preds, target)
    assert_close(metric.compute(), score(target, preds.argmax(1), average="macro", zero_division=0))
    # ... and differs from sklearn with labels=range(C), which the mean of the per-class scores reproduces
    with_labels = score(target, preds.argmax(1), average="macro", labels=list(range(C)), zero_division=0)
    assert not np.isclose(metric.compute().item(), with_labels)
    per_class = cls(task="multiclass", num_classes=C, average="none")
    per_class.update(preds, target)
    assert_close(per_class.compute().mean(), with_labels)


@pytest.mark.parametrize("zero_division", [0, 1])
@pytest.mark.parametrize("name", ["precision", "recall", "f1"])
def test_zero_division_is_the_score_of_a_class_with_an_empty_denominator(name, zero_division):
    cls, fn, score, extra = SCORES[name]
    preds, target = multiclass_inputs(N, C, seed=11, absent=1)
    kwargs = dict(task="multiclass", num_classes=C, average="none", zero_division=zero_division)
    reference = multiclass_reference(score, "none", zero_division=zero_division)
    check_metric(cls(**kwargs), (preds, target), reference, uneven_sizes(N, 12), partial(fn, **kwargs))


def test_binary_precision_without_positive_predictions_is_zero_division():
    preds, target = torch.zeros(6, dtype=torch.long), torch.tensor([0, 1, 1, 0, 1, 0])
    for zero_division in (0, 1):
        value = F.precision(preds, target, task="binary", zero_division=zero_division)
        assert_close(value, skm.precision_score(target, preds, zero_division=zero_division))


@pytest.mark.parametrize("top_k", [2, 3])
def test_top_k_accuracy_equals_sklearn_top_k_accuracy_score(top_k):
    inputs = multiclass_inputs(N, C, seed=13, kind="logits")
    kwargs = dict(task="multiclass", num_classes=C, top_k=top_k)

    def reference(preds, target):
        return skm.top_k_accuracy_score(target, preds, k=top_k, labels=list(range(C)))

    check_metric(Accuracy(**kwargs), inputs, reference, uneven_sizes(N, 14), partial(F.accuracy, **kwargs))


@pytest.mark.parametrize("average", ["micro", "macro", "none"])
@pytest.mark.parametrize("name", ["precision", "recall"])
def test_top_k_precision_and_recall_count_a_sample_as_its_target_when_the_target_is_among_the_top_k(name, average):
    cls, fn, score, extra = SCORES[name]
    inputs = multiclass_inputs(N, C, seed=15, kind="logits")

    def reference(preds, target):
        best = np.argsort(-preds, 1)[:, :2]
        effective = np.where((best == target[:, None]).any(1), target, best[:, 0])
        if average == "macro":  # with top_k > 1 only classes absent from the target drop out (torchmetrics)
            return score(target, effective, average="macro", labels=np.unique(target), zero_division=0)
        return multiclass_reference(score, average)(effective, target)

    kwargs = dict(task="multiclass", num_classes=C, top_k=2, average=average)
    check_metric(cls(**kwargs), inputs, reference, uneven_sizes(N, 16), partial(fn, **kwargs))


@pytest.mark.parametrize("kind", ["probs", "logits", "labels"])
@pytest.mark.parametrize("name", list(SCORES) + ["accuracy"])
def test_binary_scores_equal_sklearn(name, kind):
    cls, fn, score, extra = SCORES.get(name, (Accuracy, F.accuracy, skm.accuracy_score, {}))
    inputs = binary_inputs(N, seed=17, kind=kind)
    kwargs = dict(task="binary", threshold=0.3, **extra)

    def reference(preds, target):
        return score(target, labels_of(preds, "binary", 0.3), **({} if name == "accuracy" else {"zero_division": 0}))

    check_metric(cls(**kwargs), inputs, reference, uneven_sizes(N, 18), partial(fn, **kwargs))


def test_binary_ignore_index_leaves_those_samples_out():
    preds, target = binary_inputs(N, seed=19)
    target = target.clone()
    target[2::4] = -1
    kwargs = dict(task="binary", ignore_index=-1)

    def reference(preds, target):
        p, t = drop_ignored(labels_of(preds, "binary"), target, -1)
        return skm.f1_score(t, p)

    check_metric(F1Score(**kwargs), (preds, target), reference, uneven_sizes(N, 20), partial(F.f1_score, **kwargs))


@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
@pytest.mark.parametrize("name", list(SCORES) + ["accuracy"])
def test_multilabel_scores_equal_sklearn_per_label(name, average):
    cls, fn, score, extra = SCORES.get(name, (Accuracy, F.accuracy, skm.accuracy_score, {}))
    inputs = multilabel_inputs(N, 4, seed=21, kind="logits")
    kwargs = dict(task="multilabel", num_labels=4, average=average, **extra)
    binary = score if name == "accuracy" else partial(score, zero_division=0)

    def reference(preds, target):
        return per_label(binary, labels_of(preds, "multilabel"), target, average)

    check_metric(cls(**kwargs), inputs, reference, uneven_sizes(N, 22), partial(fn, **kwargs))


def test_multilabel_micro_accuracy_is_one_minus_hamming_loss_and_macro_f1_matches_sklearn():
    preds, target = multilabel_inputs(N, 4, seed=23, kind="labels")
    assert_close(F.accuracy(preds, target, "multilabel", num_labels=4), 1 - skm.hamming_loss(target, preds))
    assert_close(
        F.f1_score(preds, target, "multilabel", num_labels=4, average="macro"),
        skm.f1_score(target, preds, average="macro"),
    )


def test_multilabel_ignore_index_leaves_those_entries_out():
    preds, target = multilabel_inputs(N, 3, seed=24)
    target = target.clone()
    target[2::3, 1] = -1
    target[3::7, 2] = -1
    kwargs = dict(task="multilabel", num_labels=3, average="macro", ignore_index=-1)

    def reference(preds, target):
        return per_label(
            partial(skm.recall_score, zero_division=0), labels_of(preds, "multilabel"), target, "macro", -1
        )

    check_metric(Recall(**kwargs), (preds, target), reference, uneven_sizes(N, 25), partial(F.recall, **kwargs))


def test_extra_dimensions_count_as_more_samples():
    logits = torch.randn(8, C, 7)
    target = torch.randint(0, C, (8, 7))
    flat_logits, flat_target = logits.movedim(1, -1).reshape(-1, C), target.reshape(-1)
    for fn in (F.accuracy, F.f1_score):
        kwargs = dict(task="multiclass", num_classes=C, average="macro")
        assert_close(fn(logits, target, **kwargs), fn(flat_logits, flat_target, **kwargs))


@pytest.mark.parametrize("normalize", [None, "true", "pred", "all"])
def test_multiclass_confusion_matrix_equals_sklearn(normalize):
    inputs = multiclass_inputs(N, C, seed=26, absent=4)
    kwargs = dict(task="multiclass", num_classes=C, normalize=normalize)

    def reference(preds, target):
        return skm.confusion_matrix(target, labels_of(preds, "multiclass"), labels=list(range(C)), normalize=normalize)

    check_metric(
        ConfusionMatrix(**kwargs), inputs, reference, uneven_sizes(N, 27), partial(F.confusion_matrix, **kwargs)
    )


def test_binary_and_multilabel_confusion_matrices_equal_sklearn():
    preds, target = binary_inputs(N, seed=28, kind="logits")
    expected = skm.confusion_matrix(target, labels_of(preds.numpy(), "binary"), labels=[0, 1])
    assert_close(ConfusionMatrix(task="binary")(preds, target), expected)
    preds, target = multilabel_inputs(N, 3, seed=29)
    expected = skm.multilabel_confusion_matrix(target, labels_of(preds.numpy(), "multilabel"))
    assert_close(ConfusionMatrix(task="multilabel", num_labels=3)(preds, target), expected)


def test_confusion_matrix_compute_does_not_hand_out_the_state():
    metric = ConfusionMatrix(task="binary")
    metric.update(torch.tensor([0, 1]), torch.tensor([0, 1]))
    first = metric.compute()
    metric.update(torch.tensor([1]), torch.tensor([1]))
    assert first.tolist() == [[1, 0], [0, 1]]


# ------------------------------------------------------------------------------------------ property-based


@st.composite
def multiclass_cases(draw):
    num_classes = draw(st.integers(2, 6))
    n = draw(st.integers(1, 40))
    target = draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n))
    if draw(st.booleans()):
        preds = torch.tensor(draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)))
    else:
        preds = torch.tensor(
            draw(
                st.lists(
                    st.lists(st.floats(-5, 5, width=32), min_size=num_classes, max_size=num_classes),
                    min_size=n,
                    max_size=n,
                )
            )
        )
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    return num_classes, preds, torch.tensor(target), cuts


def _sklearn_labels(preds: torch.Tensor) -> np.ndarray:
    # ties in the scores: torch and numpy argmax both pick the first maximum
    return labels_of(preds.numpy(), "multiclass")


@settings(max_examples=40, deadline=None)
@given(case=multiclass_cases(), average=st.sampled_from(["micro", "macro", "weighted", "none"]))
def test_property_multiclass_scores_and_confusion_matrix_equal_sklearn_for_any_batching(case, average):
    num_classes, preds, target, cuts = case
    labels = _sklearn_labels(preds)
    sizes = np.diff([0, *cuts, len(target)]).tolist()
    for name in ("precision", "recall", "f1"):
        cls, _, score, _ = SCORES[name]
        metric = cls(task="multiclass", num_classes=num_classes, average=average)
        for batch in zip(preds.split(sizes), target.split(sizes)):
            metric.update(*batch)
        if average == "none":
            expected = score(target, labels, average=None, labels=list(range(num_classes)), zero_division=0)
        else:
            expected = score(target, labels, average=average, zero_division=0)
        assert_close(metric.compute(), expected, what=f"{name} {average}")
    expected = skm.confusion_matrix(target, labels, labels=list(range(num_classes)))
    assert_close(F.confusion_matrix(preds, target, "multiclass", num_classes=num_classes), expected)
    assert_close(F.accuracy(preds, target, "multiclass", num_classes=num_classes), skm.accuracy_score(target, labels))


@settings(max_examples=30, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 1)), min_size=1, max_size=50),
    beta=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_property_binary_fbeta_and_confusion_matrix_equal_sklearn(data, beta):
    preds = torch.tensor([p for p, _ in data])
    target = torch.tensor([t for _, t in data])
    assert_close(
        F.fbeta_score(preds, target, "binary", beta=beta), skm.fbeta_score(target, preds, beta=beta, zero_division=0)
    )
    assert_close(F.confusion_matrix(preds, target, "binary"), skm.confusion_matrix(target, preds, labels=[0, 1]))


@settings(max_examples=30, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 30), st.integers(2, 4)),  # sklearn reads one label column as binary data
    seed=st.integers(0, 2**16),
    average=st.sampled_from(["micro", "macro", "weighted"]),
)
def test_property_multilabel_precision_equals_sklearn(shape, seed, average):
    r = np.random.default_rng(seed)
    preds, target = r.integers(0, 2, shape), r.integers(0, 2, shape)
    value = F.precision(
        torch.from_numpy(preds), torch.from_numpy(target), "multilabel", num_labels=shape[1], average=average
    )
    assert_close(value, skm.precision_score(target, preds, average=average, zero_division=0))
