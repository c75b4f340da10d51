"""``MetricCollection``: several metrics fed by one call, their values returned as one dict.

Each metric keeps its own states: unlike torchmetrics' compute groups, nothing is shared between metrics that
happen to count the same things, so no metric's value depends on which others sit beside it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from fabriclite.metrics.metric import Metric


class MetricCollection(nn.ModuleDict):
    """Metrics updated, computed and reset together; ``compute()`` returns ``{prefix + name + postfix: value}``.

    Usage: ``metrics = MetricCollection([Accuracy(task="binary"), F1Score(task="binary")], prefix="val_")``.

    Args:
        metrics: a dict ``{name: metric}``, or a list (or several arguments) of metrics named by their class.
            A nested ``MetricCollection`` contributes its metrics under its own prefixed names.
        prefix, postfix: added to every name in the returned dicts.
        compute_groups: accepted for torchmetrics compatibility and ignored: states are never shared.
    """

    def __init__(
        self,
        metrics: Metric | MetricCollection | Iterable[Metric | MetricCollection] | Mapping[str, Metric],
        *additional_metrics: Metric,
        prefix: str | None = None,
        postfix: str | None = None,
        compute_groups: Any = True,
    ) -> None:
        super().__init__()
        for affix, value in (("prefix", prefix), ("postfix", postfix)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{affix} must be a string or None, got {type(value).__name__}")
        self.prefix = prefix or ""
        self.postfix = postfix or ""
        self.add_metrics(metrics, *additional_metrics)

    def add_metrics(
        self,
        metrics: Metric | MetricCollection | Iterable[Metric | MetricCollection] | Mapping[str, Metric],
        *additional_metrics: Metric,
    ) -> None:
        """Add metrics (same forms as the constructor).

        Usage: ``collection.add_metrics({"auroc": AUROC(task="binary")})``.
        """
        if isinstance(metrics, Mapping):
            if additional_metrics:
                raise ValueError("Give metrics either as one dict or as metrics, not both")
            named = list(metrics.items())
        else:
            items = [metrics] if isinstance(metrics, (Metric, MetricCollection)) else list(metrics)
            named = [(None, m) for m in [*items, *additional_metrics]]
        for name, metric in named:
            if isinstance(metric, MetricCollection):
                for inner_name, inner in metric.items(keep_base=False):
                    self._add(inner_name if name is None else f"{name}_{inner_name}", inner)
            elif isinstance(metric, Metric):
                self._add(type(metric).__name__ if name is None else name, metric)
            else:
                raise ValueError(f"MetricCollection holds Metric instances, got {type(metric).__name__} for {name!r}")

    def _add(self, name: str, metric: Metric) -> None:
        if name in self._modules:
            raise ValueError(f"Two metrics are named {name!r}; give them distinct names with a dict")
        self[name] = metric

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Accumulate the batch in every metric and return each one's value on this batch."""
        return self._named({name: metric(*args, **kwargs) for name, metric in self._modules.items()})

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Feed the batch to every metric."""
        for metric in self._modules.values():
            metric.update(*args, **kwargs)

    def compute(self) -> dict[str, Any]:
        """Every metric's value (synced across processes, in the same order on every rank)."""
        return self._named({name: metric.compute() for name, metric in self._modules.items()})

    def reset(self) -> None:
        """Reset every metric."""
        for metric in self._modules.values():
            metric.reset()

    def clone(self, prefix: str | None = None, postfix: str | None = None) -> MetricCollection:
        """A deep copy, optionally with a new prefix or postfix.

        Usage: ``val_metrics = train_metrics.clone(prefix="val_")``.
        """
        twin = copy.deepcopy(self)
        if prefix is not None:
            twin.prefix = prefix
        if postfix is not None:
            twin.postfix = postfix
        return twin

    def persistent(self, mode: bool = True) -> None:
        """Make every metric's states persistent (saved in ``state_dict``) or not."""
        for metric in self._modules.values():
            metric.persistent(mode)

    def keys(self, keep_base: bool = False) -> list[str]:  # type: ignore[override]
        """The metric names, with prefix and postfix unless ``keep_base``."""
        return [name if keep_base else self._full_name(name) for name in self._modules]

    def items(self, keep_base: bool = False) -> list[tuple[str, Metric]]:  # type: ignore[override]
        """``(name, metric)`` pairs, names with prefix and postfix unless ``keep_base``."""
        return [(name if keep_base else self._full_name(name), m) for name, m in self._modules.items()]

    def __getitem__(self, key: str) -> Metric:
        if key not in self._modules and key.startswith(self.prefix) and key.endswith(self.postfix):
            key = key[len(self.prefix) : len(key) - len(self.postfix)]  # a full name, as compute() returns it
        return self._modules[key]

    def _full_name(self, name: str) -> str:
        return f"{self.prefix}{name}{self.postfix}"

    def _named(self, values: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in values.items():
            if isinstance(value, dict):  # a metric returning several values contributes each under its own key
                out.update({self._full_name(key): v for key, v in value.items()})
            else:
                out[self._full_name(name)] = value
        return out
