"""On two real gloo processes, with the batches split unevenly between ranks (one rank sometimes empty), every
rank's compute() equals scikit-learn on all the data, forward returns the local batch value, and compute() leaves
the local states as they were.

All cases run in one process group (``metric_dist_helpers.run_cases``) to pay the start-up once; each case is still
its own test, reading its result from the shared run.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from metric_dist_helpers import run_cases
from metric_tester import (
    assert_close,
    binary_inputs,
    labels_of,
    multiclass_inputs,
    multilabel_inputs,
    regression_inputs,
    softmax_if_logits,
    split,
)
from sklearn import metrics as skm

from fabriclite._padding import set_padding
from fabriclite.metrics import (
    AUROC,
    ROC,
    Accuracy,
    AveragePrecision,
    ConfusionMatrix,
    F1Score,
    MaxMetric,
    MeanAbsoluteError,
    MeanMetric,
    MeanSquaredError,
    Metric,
    MetricCollection,
    MinMetric,
    PrecisionRecallCurve,
    R2Score,
    Recall,
    SumMetric,
)
from fabriclite.metrics._sync import sync_states

CASES: dict[str, Callable[[int, int], None]] = {}
SIZES = [31, 17, 45, 8, 60, 39]  # 200 samples in uneven batches
MOSTLY_RANK_0 = [0, 0, 1, 0, 0, 0]  # who gets each batch: rank 1 gets one of six
ALL_RANK_0 = [0] * 6  # rank 1 gets nothing: its cat states stay empty


def case(function: Callable[[int, int], None]) -> Callable[[int, int], None]:
    CASES[function.__name__] = function
    return function


def snapshot(metric: Metric) -> dict[str, Any]:
    return {k: [t.clone() for t in v] if isinstance(v, list) else v.clone() for k, v in metric.metric_state.items()}


def assert_same_states(before: dict[str, Any], after: dict[str, Any]) -> None:
    for name, value in before.items():
        if isinstance(value, list):
            assert len(value) == len(after[name]) and all(torch.equal(a, b) for a, b in zip(value, after[name])), name
        else:
            assert torch.equal(value, after[name]), f"{name}: {value} became {after[name]}"


def feed_and_compute(
    metric: Any, inputs: tuple, owners: list[int], rank: int, reference: Callable, batch_checks: bool = True
) -> None:
    """Feed this rank's batches through forward (each value vs the reference on that batch), then compute() vs the
    reference on all the data, with the local states unchanged by compute()."""
    for owner, batch in zip(owners, split(inputs, SIZES)):
        if owner == rank:
            value = metric(*batch)
            if batch_checks:
                assert_close(value, reference(*(t.numpy() for t in batch)), what="local batch value")
    metrics = metric.values() if isinstance(metric, MetricCollection) else [metric]
    before = [snapshot(m) for m in metrics]
    assert_close(metric.compute(), reference(*(t.numpy() for t in inputs)), atol=1e-5, what="synced compute()")
    for m, states in zip(metrics, before):
        assert_same_states(states, snapshot(m))


@case
def count_metrics_equal_sklearn_on_all_data(rank: int, world: int) -> None:
    inputs = multiclass_inputs(200, 5, seed=1, absent=4)
    collection = MetricCollection(
        {
            "acc": Accuracy(task="multiclass", num_classes=5),
            "f1": F1Score(task="multiclass", num_classes=5, average="macro"),
            "recall": Recall(task="multiclass", num_classes=5, average="none"),
            "cm": ConfusionMatrix(task="multiclass", num_classes=5, normalize="true"),
        }
    )

    def reference(preds, target):
        labels = labels_of(preds, "multiclass")
        return {
            "acc": skm.accuracy_score(target, labels),
            "f1": skm.f1_score(target, labels, average="macro", zero_division=0),
            "recall": skm.recall_score(target, labels, average=None, labels=list(range(5)), zero_division=0),
            "cm": skm.confusion_matrix(target, labels, labels=list(range(5)), normalize="true"),
        }

    feed_and_compute(collection, inputs, MOSTLY_RANK_0, rank, reference)


@case
def multilabel_scores_with_ignore_index_equal_sklearn(rank: int, world: int) -> None:
    preds, target = multilabel_inputs(200, 3, seed=2)
    target = target.clone()
    target[5::4, 1] = -1

    def reference(preds, target):
        valid = target != -1
        labels = labels_of(preds, "multilabel")
        return np.mean([skm.f1_score(target[valid[:, j], j], labels[valid[:, j], j]) for j in range(3)])

    metric = F1Score(task="multilabel", num_labels=3, average="macro", ignore_index=-1)
    feed_and_compute(metric, (preds, target), MOSTLY_RANK_0, rank, reference)


@case
def exact_curves_equal_sklearn_with_an_empty_rank(rank: int, world: int) -> None:
    inputs = binary_inputs(200, seed=3, kind="logits")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 1 computes nothing locally and says so
        feed_and_compute(AUROC(task="binary"), inputs, ALL_RANK_0, rank, lambda p, t: skm.roc_auc_score(t, p))
        feed_and_compute(
            AveragePrecision(task="binary"), inputs, ALL_RANK_0, rank, lambda p, t: skm.average_precision_score(t, p)
        )
        feed_and_compute(
            PrecisionRecallCurve(task="binary"),
            inputs,
            ALL_RANK_0,
            rank,
            lambda p, t: skm.precision_recall_curve(t, 1 / (1 + np.exp(-p))),
        )

        def roc_reference(preds, target):
            fpr, tpr, thresholds = skm.roc_curve(
                target, 1 / (1 + np.exp(-preds.astype(np.float64))), drop_intermediate=False
            )
            return fpr, tpr

        roc = ROC(task="binary")
        for owner, batch in zip(ALL_RANK_0, split(inputs, SIZES)):
            if owner == rank:
                roc.update(*batch)
        fpr, tpr, _ = roc.compute()
        assert_close((fpr, tpr), roc_reference(*(t.numpy() for t in inputs)))
        assert (len(roc.preds) == 0) == (rank == 1)


@case
def multiclass_auroc_equals_one_vs_rest_sklearn_exact_and_binned(rank: int, world: int) -> None:
    inputs = multiclass_inputs(200, 4, seed=4)

    def reference(preds, target):
        return skm.roc_auc_score(target, softmax_if_logits(preds), multi_class="ovr", labels=list(range(4)))

    feed_and_compute(AUROC(task="multiclass", num_classes=4), inputs, MOSTLY_RANK_0, rank, reference)

    grid = torch.linspace(0, 1, 30)
    metric = AUROC(task="multiclass", num_classes=4, thresholds=30)
    for owner, batch in zip(MOSTLY_RANK_0, split(inputs, SIZES)):
        if owner == rank:
            metric.update(*batch)
    probs, target = softmax_if_logits(inputs[0].numpy()), inputs[1].numpy()
    rounded = np.searchsorted(grid.numpy(), inputs[0].softmax(1).numpy(), side="right")
    expected = np.mean([skm.roc_auc_score(target == c, rounded[:, c]) for c in range(4)])
    assert_close(metric.compute(), expected)
    assert probs.shape == (200, 4)


@case
def regression_metrics_equal_sklearn(rank: int, world: int) -> None:
    inputs = regression_inputs(200, seed=5)
    feed_and_compute(MeanSquaredError(), inputs, MOSTLY_RANK_0, rank, lambda p, t: skm.mean_squared_error(t, p))
    feed_and_compute(
        MeanSquaredError(squared=False),
        inputs,
        MOSTLY_RANK_0,
        rank,
        lambda p, t: math.sqrt(skm.mean_squared_error(t, p)),
    )
    feed_and_compute(MeanAbsoluteError(), inputs, ALL_RANK_0, rank, lambda p, t: skm.mean_absolute_error(t, p))
    # R2's spread is merged by a callable reduction: gathered, then combined
    feed_and_compute(R2Score(), inputs, MOSTLY_RANK_0, rank, lambda p, t: skm.r2_score(t, p))
    feed_and_compute(R2Score(), inputs, ALL_RANK_0, rank, lambda p, t: skm.r2_score(t, p))


@case
def aggregators_fold_every_rank(rank: int, world: int) -> None:
    values = regression_inputs(200, seed=6)[0]
    for cls, reference in ((MeanMetric, np.mean), (SumMetric, np.sum), (MaxMetric, np.max), (MinMetric, np.min)):
        metric = cls()
        for owner, (batch,) in zip(ALL_RANK_0, split((values,), SIZES)):
            if owner == rank:
                metric.update(batch)
        assert_close(metric.compute(), reference(values.double().numpy()), atol=1e-4, what=cls.__name__)


@case
def padding_from_distributed_sampler_gives_the_single_process_answer(rank: int, world: int) -> None:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    preds, target = multiclass_inputs(9, 3, seed=7)  # 9 samples on 2 ranks: one index repeated
    dataset = TensorDataset(torch.arange(9), preds, target)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    metrics = MetricCollection(
        {"acc": Accuracy(task="multiclass", num_classes=3), "auroc": AUROC(task="multiclass", num_classes=3)}
    )
    mean_index = MeanMetric()
    position = rank  # the sampler's padded index list is dealt out round-robin: entries >= len(dataset) repeat
    for index, p, t in DataLoader(dataset, batch_size=2, sampler=sampler):
        positions = torch.arange(position, position + world * len(index), world)[: len(index)]
        position += world * len(index)
        set_padding(positions >= len(dataset))
        metrics.update(p, t)
        mean_index.update(index.float())
    set_padding(None)
    values = metrics.compute()
    assert_close(values["acc"], skm.accuracy_score(target, preds.argmax(1)))
    assert_close(values["auroc"], skm.roc_auc_score(target, preds.softmax(1).numpy(), multi_class="ovr"), atol=1e-5)
    assert_close(mean_index.compute(), 4.0)  # mean of 0..8, each counted once


@case
def sync_gathers_rows_of_any_length_shape_and_dtype_including_none(rank: int, world: int) -> None:
    states = {
        "rows": [torch.arange(6.0).reshape(3, 2)] if rank == 0 else [],
        "flags": [torch.tensor([True, False])] if rank == 0 else [torch.tensor([True])],
        "tensor_rows": torch.full((rank + 1, 2), rank, dtype=torch.long),
        "stacked": torch.tensor([rank, 10 * rank]),
        "summed_by_callable": torch.tensor([1.0, rank]),
        "nothing": [],
    }
    reductions = {
        "rows": "cat",
        "flags": "cat",
        "tensor_rows": "cat",
        "stacked": None,
        "summed_by_callable": lambda stacked: stacked.sum(0),
        "nothing": "cat",
    }
    synced = sync_states(states, reductions, None, torch.device("cpu"))
    assert torch.equal(synced["rows"][0], torch.arange(6.0).reshape(3, 2))
    assert synced["flags"][0].tolist() == [True, False, True]
    assert synced["tensor_rows"].tolist() == [[0, 0], [1, 1], [1, 1]]
    assert synced["stacked"].tolist() == [[0, 0], [1, 10]]
    assert synced["summed_by_callable"].tolist() == [2.0, 1.0]
    assert synced["nothing"] == []
    assert states["rows"] == [] or states["rows"][0].shape == (3, 2)  # the inputs are left alone


@case
def ranks_whose_states_cannot_be_gathered_raise_together_instead_of_hanging(rank: int, world: int) -> None:
    states = {"rows": [torch.ones(2)] if rank == 0 else [torch.ones(2, dtype=torch.long)]}
    with pytest.raises(RuntimeError, match="different dtype or row shape"):
        sync_states(states, {"rows": "cat"}, None, torch.device("cpu"))
    dist.barrier()  # every rank is still in step


@case
def compute_syncs_every_time_so_a_rank_never_answers_from_a_stale_cache(rank: int, world: int) -> None:
    metric = SumMetric()
    metric.update(torch.tensor(1.0))
    assert metric.compute().item() == 2.0
    if rank == 1:
        metric.update(torch.tensor(5.0))
    assert metric.compute().item() == 7.0  # rank 0 did not update, yet sees rank 1's value


@case
def sync_and_unsync_by_hand(rank: int, world: int) -> None:
    metric = Accuracy(task="binary")
    metric.update(torch.tensor([1, 1]), torch.tensor([1, rank]))
    local = snapshot(metric)
    metric.sync()
    assert metric.tp.item() == 3 and metric.fp.item() == 1  # rank 0: one hit, one miss; rank 1: two hits
    with pytest.raises(RuntimeError, match="already synced"):
        metric.sync()
    with pytest.raises(RuntimeError, match="is synced"):
        metric.update(torch.tensor([1]), torch.tensor([1]))
    metric.unsync()
    assert_same_states(local, snapshot(metric))
    with metric.sync_context():
        assert metric.tp.item() == 3
    assert_same_states(local, snapshot(metric))


# ------------------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def results() -> list[dict[str, str]]:
    return run_cases(__name__, list(CASES), world_size=2, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_on_two_gloo_processes(name: str, results: list[dict[str, str]]) -> None:
    for rank, outcome in enumerate(results):
        assert outcome[name] == "ok", f"rank {rank}:\n{outcome[name]}"
