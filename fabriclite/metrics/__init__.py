"""torchmetrics-style metrics that equal scikit-learn, sync across processes, and give the single-process answer
under DDP (rows the data loader marks as padding are dropped).

Usage::

    from fabriclite.metrics import Accuracy            # instead of: from torchmetrics import Accuracy
    acc = Accuracy(task="multiclass", num_classes=10).to(fabric.device)
    for x, y in loader:
        batch_acc = acc(model(x), y)                    # this batch's value; accumulates
    epoch_acc = acc.compute()                           # every rank must call it: it syncs
    acc.reset()

Where things live: the ``Metric`` base (states, caching, syncing, padding) in ``metric``, its syncing in
``_sync``; the checks and formatting of classification inputs in ``_inputs``; count-based classification in
``classification``; score curves in ``curves`` (their points in ``_curve_points``); ``regression``;
``aggregation``; ``MetricCollection`` in ``collection``; the functional API in ``functional``.
"""

from fabriclite.metrics import functional
from fabriclite.metrics.aggregation import MaxMetric, MeanMetric, MinMetric, SumMetric
from fabriclite.metrics.classification import Accuracy, ConfusionMatrix, F1Score, FBetaScore, Precision, Recall
from fabriclite.metrics.collection import MetricCollection
from fabriclite.metrics.curves import AUROC, ROC, AveragePrecision, PrecisionRecallCurve
from fabriclite.metrics.metric import Metric
from fabriclite.metrics.regression import MeanAbsoluteError, MeanSquaredError, R2Score

__all__ = [
    "AUROC",
    "ROC",
    "Accuracy",
    "AveragePrecision",
    "ConfusionMatrix",
    "F1Score",
    "FBetaScore",
    "MaxMetric",
    "MeanAbsoluteError",
    "MeanMetric",
    "MeanSquaredError",
    "Metric",
    "MetricCollection",
    "MinMetric",
    "Precision",
    "PrecisionRecallCurve",
    "R2Score",
    "Recall",
    "SumMetric",
    "functional",
]
