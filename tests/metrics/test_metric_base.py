"""The Metric base: one update per forward, caching, reset, merging, state_dict, pickling, cloning, devices."""

import copy
import pickle
import warnings

import pytest
import torch
from metric_tester import assert_close, multiclass_inputs

from fabriclite.metrics import AUROC, Accuracy, MeanSquaredError, Metric, R2Score


class Counting(Metric):
    """A metric with one state of each reduction, counting how often update and compute run."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("average", torch.tensor(0.0), dist_reduce_fx="mean")
        self.add_state("low", torch.tensor(float("inf")), dist_reduce_fx="min")
        self.add_state("high", torch.tensor(-float("inf")), dist_reduce_fx="max")
        self.add_state("seen", [], dist_reduce_fx="cat", persistent=True)
        self.updates = 0
        self.computes = 0

    def update(self, x):
        self.updates += 1
        self.total = self.total + x.sum()
        self.average = x.mean()
        self.low = torch.minimum(self.low, x.min())
        self.high = torch.maximum(self.high, x.max())
        self.seen.append(x)

    def compute(self):
        self.computes += 1
        return self.total


def test_forward_updates_once_and_returns_the_batch_value_while_accumulating():
    metric = Counting()
    assert metric(torch.tensor([1.0, 2.0])).item() == 3.0
    assert metric(torch.tensor([5.0])).item() == 5.0
    assert metric.updates == 2 and metric.update_count == 2
    assert metric.compute().item() == 8.0
    assert metric.low.item() == 1.0 and metric.high.item() == 5.0
    assert torch.cat(metric.seen).tolist() == [1.0, 2.0, 5.0]
    assert metric.average.item() == pytest.approx((1.5 + 5.0) / 2)  # mean states: weighted by update count


def test_forward_equals_update_for_a_real_metric():
    preds, target = multiclass_inputs(100, 4, seed=1)
    by_forward, by_update = Accuracy(task="multiclass", num_classes=4), Accuracy(task="multiclass", num_classes=4)
    for batch in zip(preds.split(30), target.split(30)):
        by_forward(*batch)
        by_update.update(*batch)
    assert by_forward.compute() == by_update.compute()


def test_a_bad_batch_in_forward_keeps_what_was_accumulated():
    metric = Accuracy(task="multiclass", num_classes=3)
    metric(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError):
        metric(torch.tensor([0, 7]), torch.tensor([0, 1]))
    assert metric.update_count == 1
    assert_close(metric.compute(), 2 / 3)


def test_compute_is_cached_until_the_next_update():
    metric = Counting()
    metric.update(torch.tensor([1.0]))
    metric.compute()
    metric.compute()
    assert metric.computes == 1
    metric.update(torch.tensor([1.0]))
    assert metric.compute().item() == 2.0 and metric.computes == 2


def test_reset_restores_the_defaults_and_compute_before_update_warns():
    metric = Counting()
    metric.update(torch.tensor([4.0]))
    metric.reset()
    assert metric.total.item() == 0.0 and metric.seen == [] and metric.update_count == 0
    with pytest.warns(UserWarning, match="before any update"):
        metric.compute()


def test_a_subclass_calling_super_update_counts_one_update():
    class Twice(Counting):
        def update(self, x):
            super().update(x)

    metric = Twice()
    metric(torch.tensor([1.0]))
    assert metric.update_count == 1 and metric.updates == 1


def test_merge_state_folds_another_metric_or_a_dict_by_each_reduction():
    a, b = Counting(), Counting()
    a.update(torch.tensor([1.0, 2.0]))
    b.update(torch.tensor([7.0]))
    a.merge_state(b)
    assert (a.total.item(), a.low.item(), a.high.item(), a.update_count) == (10.0, 1.0, 7.0, 2)
    assert torch.cat(a.seen).tolist() == [7.0, 1.0, 2.0]
    a.merge_state(
        {
            "total": torch.tensor(1.0),
            "average": torch.tensor(0.0),
            "low": torch.tensor(-1.0),
            "high": torch.tensor(0.0),
            "seen": [],
        }
    )
    assert a.total.item() == 11.0 and a.low.item() == -1.0
    with pytest.raises(ValueError, match="Cannot merge"):
        a.merge_state(Accuracy(task="binary"))
    with pytest.raises(ValueError, match="lacks the states"):
        a.merge_state({"total": torch.tensor(1.0)})


def test_state_dict_holds_only_persistent_states_and_loads_back():
    metric = Counting()
    metric.update(torch.tensor([3.0]))
    assert list(metric.state_dict()) == ["seen"]
    assert Accuracy(task="binary").state_dict() == {}
    metric.persistent(True)
    restored = Counting()
    restored.persistent(True)
    restored.load_state_dict(metric.state_dict())
    assert restored.total.item() == 3.0 and torch.cat(restored.seen).tolist() == [3.0]


def test_a_metric_inside_a_model_stays_out_of_its_state_dict_and_keeps_its_dtype():
    model = torch.nn.Module()
    model.layer = torch.nn.Linear(2, 2)
    model.metric = MeanSquaredError()
    assert set(model.state_dict()) == {"layer.weight", "layer.bias"}
    model.half()
    assert model.layer.weight.dtype == torch.float16
    assert model.metric.sum_squared_error.dtype == torch.float32  # sums keep their precision


@pytest.mark.parametrize("copier", [lambda m: pickle.loads(pickle.dumps(m)), lambda m: m.clone(), copy.deepcopy])
def test_a_pickled_or_cloned_metric_keeps_its_states_and_goes_on_independently(copier):
    preds, target = multiclass_inputs(60, 4, seed=2, kind="probs")
    metric = AUROC(task="multiclass", num_classes=4)
    metric.update(preds[:30], target[:30])
    twin = copier(metric)
    assert_close(twin.compute(), metric.compute())
    twin.update(preds[30:], target[30:])
    metric.update(preds[30:], target[30:])
    assert_close(twin.compute(), metric.compute())
    twin.reset()
    assert len(metric.preds) == 2


def test_to_moves_every_state_and_the_thresholds_but_not_their_dtype():
    metric = AUROC(task="binary", thresholds=10)
    exact = AUROC(task="binary")
    exact.update(torch.rand(4), torch.tensor([0, 1, 0, 1]))
    for m in (metric, exact):
        m.to("meta")
        assert m.device == torch.device("meta")
    assert metric.hist.device.type == "meta" and metric.thresholds.device.type == "meta"
    assert metric.hist.dtype == torch.long
    assert exact.preds[0].device.type == "meta"
    exact.reset()
    assert exact.preds == [] and exact._defaults["preds"] == []


def test_an_input_on_another_device_than_the_metric_names_the_argument():
    metric = Accuracy(task="binary").to("meta")
    with pytest.raises(ValueError, match=r"argument 'preds' is on cpu but the metric's states are on meta.*\.to\("):
        metric.update(torch.tensor([1]), torch.tensor([1]))
    with pytest.raises(ValueError, match="argument 'target'"):
        metric.update(preds=torch.tensor([1], device="meta"), target=torch.tensor([1]))


def test_sync_is_a_no_op_with_one_process_and_unsync_needs_a_sync():
    metric = Counting()
    metric.update(torch.tensor([2.0]))
    metric.sync()
    with metric.sync_context():
        assert metric.total.item() == 2.0
    with pytest.raises(RuntimeError, match="not synced"):
        metric.unsync()


def test_unknown_keyword_arguments_are_named():
    with pytest.raises(TypeError, match="dist_sync_on_step"):
        Accuracy(task="binary", dist_sync_on_step=True)


def test_a_differentiable_metric_returns_a_batch_value_with_grad_but_keeps_states_without():
    preds = torch.randn(8, requires_grad=True)
    metric = MeanSquaredError()
    value = metric(preds, torch.zeros(8))
    value.backward()
    assert preds.grad is not None
    assert not metric.sum_squared_error.requires_grad
    r2 = R2Score()
    r2.update(preds, torch.randn(8))
    assert not r2.compute().requires_grad


def test_add_state_rejects_what_it_cannot_sync():
    metric = Counting()
    with pytest.raises(ValueError, match="default"):
        metric.add_state("bad", 3)
    with pytest.raises(ValueError, match="dist_reduce_fx"):
        metric.add_state("bad", torch.tensor(0), dist_reduce_fx="median")
    with pytest.raises(ValueError, match="list state"):
        metric.add_state("bad", [], dist_reduce_fx="sum")


def test_compute_before_update_of_a_curve_metric_warns_rather_than_crashing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AUROC(task="binary").compute()
    assert any("before any update" in str(w.message) for w in caught)
