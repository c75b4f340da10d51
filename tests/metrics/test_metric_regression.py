"""Regression metrics equal scikit-learn per batch and over uneven batches; aggregators follow torchmetrics'
NaN strategies."""

import math
import warnings
from functools import partial

import numpy as np
import pytest
import torch
from metric_tester import assert_close, check_metric, regression_inputs, uneven_sizes
from sklearn import metrics as skm

from fabriclite.metrics import MaxMetric, MeanAbsoluteError, MeanMetric, MeanSquaredError, MinMetric, R2Score, SumMetric
from fabriclite.metrics import functional as F

N = 200


@pytest.mark.parametrize("squared", [True, False])
def test_mean_squared_error_equals_sklearn(squared):
    def reference(preds, target):
        mse = skm.mean_squared_error(target, preds)
        return mse if squared else math.sqrt(mse)

    metric, functional = MeanSquaredError(squared=squared), partial(F.mean_squared_error, squared=squared)
    check_metric(metric, regression_inputs(N, seed=1), reference, uneven_sizes(N, 2), functional, atol=1e-5)


def test_mean_absolute_error_equals_sklearn():
    reference = lambda p, t: skm.mean_absolute_error(t, p)  # noqa: E731
    check_metric(
        MeanAbsoluteError(),
        regression_inputs(N, seed=3),
        reference,
        uneven_sizes(N, 4),
        F.mean_absolute_error,
        atol=1e-5,
    )


def test_errors_with_several_outputs_are_per_output():
    inputs = regression_inputs(N, seed=5, outputs=3)
    reference = lambda p, t: skm.mean_squared_error(t, p, multioutput="raw_values")  # noqa: E731
    check_metric(
        MeanSquaredError(num_outputs=3),
        inputs,
        reference,
        uneven_sizes(N, 6),
        partial(F.mean_squared_error, num_outputs=3),
        atol=1e-5,
    )


def test_r2_equals_sklearn_over_uneven_batches():
    sizes = [s + 2 for s in uneven_sizes(N - 12, 7)]  # R2 needs two samples in every batch
    reference = lambda p, t: skm.r2_score(t, p)  # noqa: E731
    check_metric(R2Score(), regression_inputs(N, seed=8), reference, sizes, F.r2_score, atol=1e-5)


@pytest.mark.parametrize("multioutput", ["raw_values", "uniform_average", "variance_weighted"])
def test_multioutput_r2_equals_sklearn(multioutput):
    inputs = regression_inputs(N, seed=9, outputs=3)
    sizes = [s + 2 for s in uneven_sizes(N - 12, 10)]
    reference = lambda p, t: skm.r2_score(t, p, multioutput=multioutput)  # noqa: E731
    metric = R2Score(num_outputs=3, multioutput=multioutput)
    check_metric(metric, inputs, reference, sizes, partial(F.r2_score, multioutput=multioutput), atol=1e-5)


def test_adjusted_r2_follows_the_textbook_formula():
    preds, target = regression_inputs(N, seed=11)
    r2 = skm.r2_score(target, preds)
    assert_close(F.r2_score(preds, target, adjusted=5), 1 - (1 - r2) * (N - 1) / (N - 5 - 1), atol=1e-5)


def test_r2_keeps_its_digits_when_the_target_mean_dwarfs_its_spread():
    # sum(y^2) - sum(y)^2 / n would cancel every float32 digit here
    preds, target = regression_inputs(N, seed=12)
    preds, target = preds + 1e4, target + 1e4
    metric = R2Score()
    for batch in zip(preds.split(30), target.split(30)):
        metric.update(*batch)
    assert_close(metric.compute(), skm.r2_score(target.double(), preds.double()), atol=1e-3)


def test_r2_of_a_constant_target_is_one_when_exact_and_zero_otherwise():
    target = torch.full((10,), 3.3)
    assert F.r2_score(target.clone(), target).item() == 1.0
    assert F.r2_score(target + 0.5, target).item() == 0.0


def test_r2_needs_two_samples():
    with pytest.raises(ValueError, match="at least two samples"):
        F.r2_score(torch.tensor([1.0]), torch.tensor([2.0]))


# ------------------------------------------------------------------------------------------------- aggregation


def test_aggregators_fold_values_over_uneven_batches():
    values = torch.from_numpy(np.random.default_rng(13).normal(size=N).astype(np.float32))
    weights = torch.from_numpy(np.random.default_rng(14).random(N).astype(np.float32))
    metrics = {"mean": MeanMetric(), "sum": SumMetric(), "max": MaxMetric(), "min": MinMetric()}
    for start, stop in zip([0, 1, 50, 120], [1, 50, 120, N]):
        for name, metric in metrics.items():
            if name == "mean":
                metric.update(values[start:stop], weights[start:stop])
            else:
                metric.update(values[start:stop])
    v, w = values.double().numpy(), weights.double().numpy()
    assert_close(metrics["mean"].compute(), np.average(v, weights=w), atol=1e-5)
    assert_close(metrics["sum"].compute(), v.sum(), atol=1e-4)
    assert_close(metrics["max"].compute(), v.max())
    assert_close(metrics["min"].compute(), v.min())


def test_mean_metric_takes_numbers_and_a_scalar_weight():
    metric = MeanMetric()
    metric.update(2.0, weight=3)
    metric.update(torch.tensor([4.0, 6.0]))
    assert_close(metric.compute(), (2 * 3 + 4 + 6) / 5)


@pytest.mark.parametrize("cls", [MeanMetric, SumMetric, MaxMetric, MinMetric])
def test_nan_strategies(cls):
    values = torch.tensor([1.0, float("nan"), 3.0])
    with pytest.raises(RuntimeError, match="NaN"):
        cls(nan_strategy="error").update(values)
    with pytest.warns(UserWarning, match="NaN"):
        warned = cls()  # "warn" is the default, as in torchmetrics
        warned.update(values)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ignored = cls(nan_strategy="ignore")
        ignored.update(values)
    expected = {MeanMetric: 2.0, SumMetric: 4.0, MaxMetric: 3.0, MinMetric: 1.0}[cls]
    assert warned.compute().item() == ignored.compute().item() == expected
    replaced = cls(nan_strategy=5.0)
    replaced.update(values)
    assert replaced.compute().item() == {MeanMetric: 3.0, SumMetric: 9.0, MaxMetric: 5.0, MinMetric: 1.0}[cls]
    with pytest.raises(ValueError, match="nan_strategy"):
        cls(nan_strategy="drop")
