"""Bad inputs and arguments raise a ValueError or TypeError naming the argument and what was expected."""

import pytest
import torch

from fabriclite.metrics import AUROC, Accuracy, F1Score, MeanSquaredError, Precision
from fabriclite.metrics import functional as F

LOGITS = torch.randn(4, 3)
LABELS = torch.tensor([0, 2, 1, 1])


@pytest.mark.parametrize(
    "call, error, message",
    [
        # wrong shapes
        (
            lambda: F.accuracy(torch.randn(4, 5), LABELS, "multiclass", num_classes=3),
            ValueError,
            r"num_classes=3.*\(4, 3\).*got \(4, 5\)",
        ),
        (
            lambda: F.accuracy(torch.tensor([0, 1]), LABELS, "multiclass", num_classes=3),
            ValueError,
            "must have target's shape",
        ),
        (lambda: F.f1_score(torch.rand(4), torch.tensor([0, 1, 1]), "binary"), ValueError, "same shape"),
        (
            lambda: F.precision(torch.rand(4, 2), torch.ones(4, 3, dtype=torch.long), "multilabel", num_labels=3),
            ValueError,
            "num_labels=3",
        ),
        (lambda: F.auroc(torch.rand(4, 2), LABELS, "multiclass", num_classes=3), ValueError, r"\(4, 3\)"),
        (lambda: F.mean_squared_error(torch.rand(4), torch.rand(5)), ValueError, "same shape"),
        # class indices out of range
        (
            lambda: F.accuracy(torch.tensor([0, 3, 1, 1]), LABELS, "multiclass", num_classes=3),
            ValueError,
            "preds holds 3.*num_classes=3",
        ),
        (
            lambda: F.accuracy(LOGITS, torch.tensor([0, 5, 1, 1]), "multiclass", num_classes=3),
            ValueError,
            "target holds 5",
        ),
        (
            lambda: F.accuracy(LOGITS, torch.tensor([0, -1, 1, 1]), "multiclass", num_classes=3, ignore_index=-100),
            ValueError,
            "target holds -1.*ignore_index=-100",
        ),
        (lambda: F.recall(torch.tensor([0, 2]), torch.tensor([0, 1]), "binary"), ValueError, "preds holds 2"),
        # probabilities where labels are expected, and the reverse
        (
            lambda: F.accuracy(LOGITS, LABELS.float(), "multiclass", num_classes=3),
            TypeError,
            "target must hold integer class labels",
        ),
        (lambda: F.accuracy(torch.rand(4), LABELS, "multiclass", num_classes=3), ValueError, "need a class dimension"),
        (
            lambda: F.auroc(torch.tensor([0, 1, 1, 0]), torch.tensor([0, 1, 0, 0]), "binary"),
            TypeError,
            "preds must hold float scores",
        ),
        (
            lambda: F.accuracy(torch.tensor([0, 1, 1, 0]), LABELS, "multiclass", num_classes=3, top_k=2),
            ValueError,
            "top_k > 1 needs float scores",
        ),
        # NaN
        (
            lambda: F.accuracy(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]), "binary"),
            ValueError,
            "preds contains NaN",
        ),
        (
            lambda: F.auroc(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]), "binary"),
            ValueError,
            "preds contains NaN",
        ),
        (
            lambda: F.r2_score(torch.tensor([0.2, 1.0]), torch.tensor([float("nan"), 1.0])),
            ValueError,
            "target contains NaN",
        ),
        # inputs that are not tensors, or on two devices
        (lambda: F.accuracy([0, 1], torch.tensor([0, 1]), "binary"), TypeError, "preds must be a torch.Tensor"),
        (
            lambda: F.accuracy(torch.tensor([0, 1], device="meta"), torch.tensor([0, 1]), "binary"),
            ValueError,
            "preds is on meta but target is on cpu",
        ),
    ],
)
def test_bad_inputs_raise_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Accuracy(task="multi-class", num_classes=3), "task must be one of"),
        (lambda: Accuracy(task="multiclass"), "needs num_classes"),
        (lambda: Accuracy(task="multilabel", num_classes=3), "needs num_labels"),
        (lambda: Precision(task="multiclass", num_classes=3, average="samples"), "average must be one of"),
        (lambda: F1Score(task="multiclass", num_classes=3, top_k=4), r"top_k \(4\) cannot exceed num_classes"),
        (lambda: F1Score(task="binary", top_k=2), "applies to task='multiclass' only"),
        (lambda: Accuracy(task="binary", threshold=1.5), "threshold must be a float in"),
        (lambda: Precision(task="binary", zero_division=0.5), "zero_division must be 0 or 1"),
        (lambda: AUROC(task="multiclass", num_classes=3, average="micro"), "average must be one of"),
        (lambda: AUROC(task="multiclass", num_classes=3, max_fpr=0.5), "max_fpr"),
        (lambda: MeanSquaredError(num_outputs=0), "num_outputs"),
    ],
)
def test_bad_arguments_are_refused_at_construction(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_labels_metric_on_the_metric_device_passes_the_checks():
    metric = Accuracy(task="multiclass", num_classes=3)
    metric.update(LOGITS, LABELS)
    metric.update(torch.empty(0, 3), torch.empty(0, dtype=torch.long))  # an empty batch is fine
    assert metric.update_count == 2
