"""MetricCollection: one update feeds every metric, compute returns a dict, names carry prefix and postfix."""

import pytest
import torch
from metric_tester import assert_close, multiclass_inputs

from fabriclite.metrics import AUROC, Accuracy, ConfusionMatrix, F1Score, MetricCollection, Precision


def metrics():
    return [Accuracy(task="multiclass", num_classes=4), F1Score(task="multiclass", num_classes=4, average="macro")]


def test_a_list_is_named_by_class_and_every_metric_sees_every_batch():
    preds, target = multiclass_inputs(90, 4, seed=1)
    collection = MetricCollection(metrics(), prefix="val_", postfix="_epoch")
    alone = metrics()
    for batch in zip(preds.split(40), target.split(40)):
        values = collection(*batch)
        assert set(values) == {"val_Accuracy_epoch", "val_F1Score_epoch"}
        for metric in alone:
            assert_close(values[f"val_{type(metric).__name__}_epoch"], metric(*batch))
    result = collection.compute()
    for metric in alone:
        assert_close(result[f"val_{type(metric).__name__}_epoch"], metric.compute())
    assert collection["val_Accuracy_epoch"] is collection["Accuracy"]


def test_a_dict_keeps_its_names_and_update_then_reset():
    preds, target = multiclass_inputs(50, 4, seed=2, kind="probs")
    collection = MetricCollection(
        {"acc": Accuracy(task="multiclass", num_classes=4), "auroc": AUROC(task="multiclass", num_classes=4)}
    )
    collection.update(preds, target)
    assert set(collection.compute()) == {"acc", "auroc"}
    collection.reset()
    assert all(m.update_count == 0 for m in collection.values())


def test_clone_gives_an_independent_collection_with_a_new_prefix():
    train = MetricCollection(metrics(), prefix="train_")
    val = train.clone(prefix="val_")
    val.update(*multiclass_inputs(20, 4, seed=3))
    assert train["Accuracy"].update_count == 0
    assert set(val.compute()) == {"val_Accuracy", "val_F1Score"}


def test_metrics_never_share_states():
    collection = MetricCollection({"p": Precision(task="binary"), "p2": Precision(task="binary")})
    collection.update(torch.tensor([1, 0]), torch.tensor([1, 1]))
    assert collection["p"].tp is not collection["p2"].tp


def test_nested_collections_and_extra_metrics_as_arguments():
    inner = MetricCollection([ConfusionMatrix(task="binary")], prefix="inner_")
    collection = MetricCollection(inner, Accuracy(task="binary"))
    assert collection.keys() == ["inner_ConfusionMatrix", "Accuracy"]


def test_two_metrics_of_one_class_in_a_list_need_names():
    with pytest.raises(ValueError, match="named 'Accuracy'"):
        MetricCollection([Accuracy(task="binary"), Accuracy(task="binary", threshold=0.2)])
    with pytest.raises(ValueError, match="holds Metric instances"):
        MetricCollection([torch.nn.Linear(1, 1)])
