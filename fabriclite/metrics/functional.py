"""The functional API: each function computes a metric on one batch with the same ``_format`` / ``_update`` /
``_compute`` helpers as its class, so the math lives in one place (the module named beside each import).

Usage: ``from fabriclite.metrics.functional import accuracy; accuracy(logits, labels, task="multiclass", num_classes=10)``.
Functions do not sync across processes and do not drop padded rows; the classes do.
"""

from fabriclite.metrics.classification import accuracy, confusion_matrix, f1_score, fbeta_score, precision, recall
from fabriclite.metrics.curves import auroc, average_precision, precision_recall_curve, roc
from fabriclite.metrics.regression import mean_absolute_error, mean_squared_error, r2_score

__all__ = [
    "accuracy",
    "auroc",
    "average_precision",
    "confusion_matrix",
    "f1_score",
    "fbeta_score",
    "mean_absolute_error",
    "mean_squared_error",
    "precision",
    "precision_recall_curve",
    "r2_score",
    "recall",
    "roc",
]
