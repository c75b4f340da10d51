"""Rows the data loader marks as padding (DistributedSampler's duplicates) are dropped by update and forward."""

import pytest
import torch
from metric_tester import assert_close, binary_inputs, multiclass_inputs
from sklearn import metrics as skm

from fabriclite._padding import current_padding, set_padding
from fabriclite.metrics import AUROC, Accuracy, MeanMetric, MetricCollection, R2Score


@pytest.fixture(autouse=True)
def no_padding_left_behind():
    yield
    set_padding(None)


MASK = torch.tensor([False, False, True, False, True, True])


def test_update_drops_the_rows_marked_as_padding():
    preds, target = multiclass_inputs(6, 3, seed=1)
    set_padding(MASK)
    metric = Accuracy(task="multiclass", num_classes=3)
    metric.update(preds, target)
    assert metric.tp.sum() + metric.fn.sum() == 3
    assert_close(metric.compute(), skm.accuracy_score(target[~MASK], preds[~MASK].argmax(1)))


def test_forward_drops_them_too_in_its_batch_value_and_in_the_accumulated_state():
    preds, target = binary_inputs(6, seed=2)
    set_padding(MASK)
    metric = AUROC(task="binary")
    batch_value = metric(preds, target)
    assert_close(batch_value, skm.roc_auc_score(target[~MASK], preds[~MASK]))
    assert len(metric.preds[0]) == 3


def test_keyword_inputs_and_aggregators_are_dropped_alike():
    set_padding(MASK)
    metric = MeanMetric()
    metric.update(value=torch.arange(6.0), weight=torch.ones(6))
    assert metric.compute().item() == pytest.approx((0 + 1 + 3) / 3)


def test_inputs_whose_first_dimension_is_not_the_batch_size_are_left_alone():
    # e.g. a per-token metric fed (batch * tokens) rows: which rows are padding is unknown, so nothing is dropped
    set_padding(MASK)
    metric = R2Score()
    metric.update(torch.arange(12.0), torch.arange(12.0) + 0.5)
    assert metric.moments[0, 0].item() == 12


def test_a_metric_can_opt_out_with_drop_padding_false():
    set_padding(MASK)
    metric = MeanMetric(drop_padding=False)
    metric.update(torch.arange(6.0))
    assert metric.compute().item() == 2.5


def test_nothing_is_dropped_once_the_loader_clears_the_mask():
    set_padding(MASK)
    set_padding(None)
    assert current_padding() is None
    metric = MeanMetric()
    metric.update(torch.arange(6.0))
    assert metric.compute().item() == 2.5


@pytest.mark.filterwarnings("ignore:No positive samples")  # three rows cannot hold every class
def test_every_metric_of_a_collection_drops_the_rows_once():
    preds, target = multiclass_inputs(6, 3, seed=3)
    set_padding(MASK)
    collection = MetricCollection(
        {"acc": Accuracy(task="multiclass", num_classes=3), "auroc": AUROC(task="multiclass", num_classes=3)}
    )
    collection(preds, target)
    assert collection["acc"].tp.sum() + collection["acc"].fn.sum() == 3
    assert collection["auroc"].preds[0].shape[0] == 3


def test_a_batch_made_only_of_padding_changes_nothing():
    metric = Accuracy(task="binary")
    metric.update(torch.tensor([1, 0]), torch.tensor([1, 0]))
    set_padding(torch.ones(3, dtype=torch.bool))
    metric(torch.tensor([0, 0, 0]), torch.tensor([1, 1, 1]))
    assert metric.compute().item() == 1.0


def test_set_padding_takes_a_1d_bool_mask_or_none():
    for bad in (torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.bool), [True, False]):
        with pytest.raises(TypeError, match="1-D bool tensor"):
            set_padding(bad)
