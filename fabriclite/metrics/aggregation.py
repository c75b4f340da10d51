"""Aggregators of a stream of values: MeanMetric, SumMetric, MaxMetric, MinMetric, as in torchmetrics.

``nan_strategy`` says what a NaN in the input does: ``"error"`` raises, ``"warn"`` (the default) warns and drops it,
``"ignore"`` drops it silently, ``"disable"`` lets it through, and a float replaces it (for MeanMetric the value's
weight then counts as 1).
"""

from __future__ import annotations

import warnings
from typing import Any, Union

import torch
from torch import Tensor

from fabriclite.metrics.metric import Metric

NanStrategy = Union[str, float]
_STRATEGIES = ("error", "warn", "ignore", "disable")


class _Aggregator(Metric):
    """One state folded over every input by its reduction; NaNs handled by ``nan_strategy``."""

    is_differentiable = None
    higher_is_better = None

    def __init__(
        self, state_name: str, default: float, reduce_fx: str, nan_strategy: NanStrategy = "warn", **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        if not (nan_strategy in _STRATEGIES or (isinstance(nan_strategy, float) and nan_strategy == nan_strategy)):
            raise ValueError(
                f"nan_strategy must be one of {_STRATEGIES} or a float to replace NaNs with, got {nan_strategy!r}"
            )
        self.nan_strategy = nan_strategy
        self.state_name = state_name  # torchmetrics' names, for code that reads the state
        self.add_state(state_name, torch.tensor(default, dtype=torch.get_default_dtype()), dist_reduce_fx=reduce_fx)

    @property
    def _value(self) -> Tensor:
        return getattr(self, self.state_name)

    def _as_tensor(self, value: float | Tensor, name: str = "value") -> Tensor:
        if isinstance(value, Tensor):
            if value.is_complex():
                raise TypeError(f"{name} must be real-valued, got {value.dtype}")
            return value.to(self._value.dtype)
        if isinstance(value, (int, float)):
            return torch.tensor(value, dtype=self._value.dtype, device=self.device)
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")

    def _handle_nans(self, value: Tensor, weight: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Flattened ``value`` (and ``weight``) after the NaN strategy."""
        value = value.reshape(-1)
        weight = weight.reshape(-1) if weight is not None else None
        if self.nan_strategy == "disable":
            return value, weight
        nans = torch.isnan(value) if weight is None else torch.isnan(value) | torch.isnan(weight)
        if not bool(nans.any()):
            return value, weight
        if self.nan_strategy == "error":
            raise RuntimeError(
                f"{type(self).__name__} got NaN values; pass nan_strategy='ignore' (or a float) to accept them"
            )
        if isinstance(self.nan_strategy, float):
            value = value.masked_fill(nans, self.nan_strategy)
            return value, None if weight is None else weight.masked_fill(nans, 1.0)
        if self.nan_strategy == "warn":
            warnings.warn(f"{type(self).__name__} got NaN values; they are dropped", UserWarning, stacklevel=4)
        return value[~nans], None if weight is None else weight[~nans]

    def compute(self) -> Tensor:
        """The aggregate of everything seen (all processes)."""
        return self._value.clone()


class SumMetric(_Aggregator):
    """The sum of every value seen.

    Usage: ``total = SumMetric(); total.update(batch_losses); total.compute()``.
    """

    def __init__(self, nan_strategy: NanStrategy = "warn", **kwargs: Any) -> None:
        super().__init__("sum_value", 0.0, "sum", nan_strategy, **kwargs)

    def update(self, value: float | Tensor) -> None:
        """Add ``value`` (every element of a tensor)."""
        value, _ = self._handle_nans(self._as_tensor(value))
        self.sum_value = self.sum_value + value.sum()


class MaxMetric(_Aggregator):
    """The largest value seen (``-inf`` before any).

    Usage: ``best = MaxMetric(); best.update(val_acc); best.compute()``.
    """

    higher_is_better = True

    def __init__(self, nan_strategy: NanStrategy = "warn", **kwargs: Any) -> None:
        super().__init__("max_value", -float("inf"), "max", nan_strategy, **kwargs)

    def update(self, value: float | Tensor) -> None:
        """Fold in ``value`` (every element of a tensor)."""
        value, _ = self._handle_nans(self._as_tensor(value))
        if value.numel():
            self.max_value = torch.maximum(self.max_value, value.max())


class MinMetric(_Aggregator):
    """The smallest value seen (``inf`` before any).

    Usage: ``lowest = MinMetric(); lowest.update(val_loss); lowest.compute()``.
    """

    higher_is_better = False

    def __init__(self, nan_strategy: NanStrategy = "warn", **kwargs: Any) -> None:
        super().__init__("min_value", float("inf"), "min", nan_strategy, **kwargs)

    def update(self, value: float | Tensor) -> None:
        """Fold in ``value`` (every element of a tensor)."""
        value, _ = self._handle_nans(self._as_tensor(value))
        if value.numel():
            self.min_value = torch.minimum(self.min_value, value.min())


class MeanMetric(_Aggregator):
    """The (weighted) mean of every value seen.

    Usage: ``mean_loss = MeanMetric().to(fabric.device); mean_loss.update(loss, weight=batch_size)``.
    """

    def __init__(self, nan_strategy: NanStrategy = "warn", **kwargs: Any) -> None:
        super().__init__("mean_value", 0.0, "sum", nan_strategy, **kwargs)
        self.add_state("weight", torch.tensor(0.0, dtype=torch.get_default_dtype()), dist_reduce_fx="sum")

    def update(self, value: float | Tensor, weight: float | Tensor = 1.0) -> None:
        """Add ``value`` (every element of a tensor) with ``weight``, broadcast to ``value``'s shape."""
        value = self._as_tensor(value)
        weight = self._as_tensor(weight, "weight")
        try:
            weight = torch.broadcast_to(weight, value.shape)
        except RuntimeError:
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} cannot be broadcast to value's shape {tuple(value.shape)}"
            ) from None
        value, weight = self._handle_nans(value, weight)
        self.mean_value = self.mean_value + (value * weight).sum()
        self.weight = self.weight + weight.sum()

    def compute(self) -> Tensor:
        """The weighted mean of everything seen (all processes); NaN before any value."""
        return self.mean_value / self.weight
