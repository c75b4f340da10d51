"""Regression metrics: MeanSquaredError, MeanAbsoluteError, R2Score, and their functional forms. Names, arguments
and defaults follow torchmetrics; values equal scikit-learn's.

States are sums in the default float dtype (float32, as torchmetrics), except R2's spread of the target, which is
kept as (count, mean, sum of squared deviations) and merged with Chan's formula: the textbook
``sum(y^2) - sum(y)^2 / n`` loses every digit in float32 when the target's mean is large against its spread.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import Tensor

from fabriclite.metrics.metric import Metric

MultiOutput = Literal["raw_values", "uniform_average", "variance_weighted"]
_MULTIOUTPUT = ("raw_values", "uniform_average", "variance_weighted")


def _check_num_outputs(num_outputs: Any) -> int:
    if isinstance(num_outputs, bool) or not isinstance(num_outputs, int) or num_outputs < 1:
        raise ValueError(f"num_outputs must be a positive int, got {num_outputs!r}")
    return num_outputs


def _format(
    preds: Tensor, target: Tensor, num_outputs: int, flatten: bool, validate_args: bool
) -> tuple[Tensor, Tensor]:
    """``(M, num_outputs)`` float views of the inputs; with ``flatten`` a single output takes every element."""
    if validate_args:
        for name, value in (("preds", preds), ("target", target)):
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
            if value.is_complex() or value.dtype == torch.bool:
                raise TypeError(f"{name} must be a real-valued tensor, got {value.dtype}")
            # a NaN makes the sum NaN: one cheap reduction first, the exact check only when it fires
            if value.is_floating_point() and bool(torch.isnan(value.sum())) and bool(torch.isnan(value).any()):
                raise ValueError(f"{name} contains NaN")
        if preds.device != target.device:
            raise ValueError(
                f"preds is on {preds.device} but target is on {target.device}; put both on the same device"
            )
        if preds.shape != target.shape:
            raise ValueError(
                f"preds and target must have the same shape, got {tuple(preds.shape)} and {tuple(target.shape)}"
            )
        if num_outputs > 1 and (preds.ndim != 2 or preds.shape[1] != num_outputs):
            raise ValueError(
                f"num_outputs={num_outputs} expects inputs of shape (N, {num_outputs}), got {tuple(preds.shape)}"
            )
        if num_outputs == 1 and not flatten and preds.ndim > 1 and preds.shape[1:].numel() != 1:
            raise ValueError(
                f"Inputs of shape {tuple(preds.shape)} hold several outputs; pass num_outputs={preds.shape[1]} "
                "for inputs of shape (N, num_outputs)"
            )
    dtype = torch.promote_types(torch.promote_types(preds.dtype, target.dtype), torch.get_default_dtype())
    return preds.reshape(-1, num_outputs).to(dtype), target.reshape(-1, num_outputs).to(dtype)


# ------------------------------------------------------------------------------------------------ MSE and MAE


def _error_update(preds: Tensor, target: Tensor, squared: bool) -> Tensor:
    diff = preds - target
    return (diff * diff if squared else diff.abs()).sum(0)


def _mean_error_compute(total_error: Tensor, count: Tensor, take_root: bool) -> Tensor:
    mean = total_error / count
    mean = mean.sqrt() if take_root else mean
    return mean.squeeze(0) if mean.numel() == 1 else mean


def mean_squared_error(
    preds: Tensor, target: Tensor, squared: bool = True, num_outputs: int = 1, validate_args: bool = True
) -> Tensor:
    """Mean squared error (``squared=False``: its root).

    Usage: ``mean_squared_error(preds, target)``.
    """
    num_outputs = _check_num_outputs(num_outputs)
    preds, target = _format(preds, target, num_outputs, True, validate_args)
    return _mean_error_compute(_error_update(preds, target, True), torch.tensor(preds.shape[0]), not squared)


def mean_absolute_error(preds: Tensor, target: Tensor, num_outputs: int = 1, validate_args: bool = True) -> Tensor:
    """Mean absolute error.

    Usage: ``mean_absolute_error(preds, target)``.
    """
    num_outputs = _check_num_outputs(num_outputs)
    preds, target = _format(preds, target, num_outputs, True, validate_args)
    return _mean_error_compute(_error_update(preds, target, False), torch.tensor(preds.shape[0]), False)


class MeanSquaredError(Metric):
    """Mean squared error, as ``torchmetrics.MeanSquaredError`` (``squared=False``: root mean squared error).

    Usage: ``mse = MeanSquaredError().to(fabric.device); mse(preds, target)``.
    """

    is_differentiable = True
    higher_is_better = False

    def __init__(self, squared: bool = True, num_outputs: int = 1, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.squared, self.validate_args = squared, validate_args
        self.num_outputs = _check_num_outputs(num_outputs)
        self.add_state("sum_squared_error", torch.zeros(self.num_outputs), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch."""
        preds, target = _format(preds, target, self.num_outputs, True, self.validate_args)
        self.sum_squared_error = self.sum_squared_error + _error_update(preds, target, True).to(
            self.sum_squared_error.dtype
        )
        self.total = self.total + preds.shape[0]

    def compute(self) -> Tensor:
        """The (root) mean squared error of everything seen (all processes)."""
        return _mean_error_compute(self.sum_squared_error, self.total, not self.squared)


class MeanAbsoluteError(Metric):
    """Mean absolute error, as ``torchmetrics.MeanAbsoluteError``.

    Usage: ``mae = MeanAbsoluteError().to(fabric.device); mae(preds, target)``.
    """

    is_differentiable = True
    higher_is_better = False

    def __init__(self, num_outputs: int = 1, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_args = validate_args
        self.num_outputs = _check_num_outputs(num_outputs)
        self.add_state("sum_abs_error", torch.zeros(self.num_outputs), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch."""
        preds, target = _format(preds, target, self.num_outputs, True, self.validate_args)
        self.sum_abs_error = self.sum_abs_error + _error_update(preds, target, False).to(self.sum_abs_error.dtype)
        self.total = self.total + preds.shape[0]

    def compute(self) -> Tensor:
        """The mean absolute error of everything seen (all processes)."""
        return _mean_error_compute(self.sum_abs_error, self.total, False)


# ------------------------------------------------------------------------------------------------------ R2


def _moments(target: Tensor) -> Tensor:
    """``[count, mean, sum of squared deviations]`` per output, shape (3, outputs)."""
    count = target.shape[0]
    mean = target.mean(0) if count else target.new_zeros(target.shape[1])
    spread = ((target - mean) ** 2).sum(0)
    return torch.stack([torch.full_like(mean, count), mean, spread])


def _combine_moments(stacked: Tensor) -> Tensor:
    """Merge moments of shape (k, 3, outputs) into one (3, outputs) (Chan et al.): exact, order-free, stable."""
    counts, means, spreads = stacked[:, 0], stacked[:, 1], stacked[:, 2]
    count = counts.sum(0)
    mean = torch.where(count > 0, (counts * means).sum(0) / count.clamp(min=1), torch.zeros_like(count))
    spread = spreads.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return torch.stack([count, mean, spread])


def _r2_compute(moments: Tensor, rss: Tensor, adjusted: int, multioutput: str) -> Tensor:
    count, mean, tss = moments
    n = int(count[0].item())
    if n < 2:
        raise ValueError(f"R2 needs at least two samples, got {n}")
    # A constant target (tss 0 up to rounding) scores 1 when predicted exactly and 0 otherwise, as scikit-learn.
    constant = tss <= n * (4 * torch.finfo(tss.dtype).eps * mean.abs()) ** 2
    scores = torch.where(constant, (rss == 0).to(tss.dtype), 1 - rss / torch.where(constant, torch.ones_like(tss), tss))
    if multioutput == "raw_values":
        r2 = scores
    elif multioutput == "uniform_average":
        r2 = scores.mean()
    else:
        r2 = (scores * tss).sum() / tss.sum()
    if adjusted:
        if n - adjusted - 1 <= 0:
            warnings.warn(
                f"Adjusted R2 needs more samples ({n}) than regressors + 1 ({adjusted + 1}); returning the plain R2",
                UserWarning,
                stacklevel=3,
            )
        else:
            r2 = 1 - (1 - r2) * (n - 1) / (n - adjusted - 1)
    return r2.squeeze(0) if r2.ndim and r2.numel() == 1 else r2


def _check_r2_args(adjusted: Any, multioutput: Any) -> None:
    if isinstance(adjusted, bool) or not isinstance(adjusted, int) or adjusted < 0:
        raise ValueError(f"adjusted must be a non-negative int (the number of regressors), got {adjusted!r}")
    if multioutput not in _MULTIOUTPUT:
        raise ValueError(f"multioutput must be one of {_MULTIOUTPUT}, got {multioutput!r}")


def r2_score(
    preds: Tensor,
    target: Tensor,
    adjusted: int = 0,
    multioutput: MultiOutput = "uniform_average",
    num_outputs: int | None = None,
    validate_args: bool = True,
) -> Tensor:
    """Coefficient of determination R2 (scikit-learn's ``r2_score``).

    Usage: ``r2_score(preds, target)``; inputs of shape (N,) or (N, outputs).
    """
    _check_r2_args(adjusted, multioutput)
    num_outputs = _check_num_outputs(num_outputs or (preds.shape[1] if preds.ndim == 2 else 1))
    preds, target = _format(preds, target, num_outputs, False, validate_args)
    return _r2_compute(_moments(target), _error_update(preds, target, True), adjusted, multioutput)


class R2Score(Metric):
    """Coefficient of determination R2, as ``torchmetrics.R2Score``.

    Usage: ``r2 = R2Score().to(fabric.device); r2(preds, target)``; ``R2Score(num_outputs=3)`` for (N, 3) inputs.
    ``num_outputs`` is fixed up front (torchmetrics infers it) so that every rank holds states of the same shape.
    """

    is_differentiable = True
    higher_is_better = True

    def __init__(
        self,
        adjusted: int = 0,
        multioutput: MultiOutput = "uniform_average",
        num_outputs: int = 1,
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_r2_args(adjusted, multioutput)
        self.adjusted, self.multioutput, self.validate_args = adjusted, multioutput, validate_args
        self.num_outputs = _check_num_outputs(num_outputs)
        self.add_state("moments", torch.zeros(3, self.num_outputs), dist_reduce_fx=_combine_moments)
        self.add_state("rss", torch.zeros(self.num_outputs), dist_reduce_fx="sum")

    def update(self, preds: Tensor, target: Tensor) -> None:
        """Add a batch."""
        preds, target = _format(preds, target, self.num_outputs, False, self.validate_args)
        dtype = self.rss.dtype
        self.moments = _combine_moments(torch.stack([self.moments, _moments(target).to(dtype)]))
        self.rss = self.rss + _error_update(preds, target, True).to(dtype)

    def compute(self) -> Tensor:
        """The R2 of everything seen (all processes)."""
        return _r2_compute(self.moments, self.rss, self.adjusted, self.multioutput)
