"""Lightning Fabric's older API, kept so scripts written against it run unchanged: subclassing ``Fabric`` with a
``run`` method, and ``sharded_model()``. New code uses ``launch(fn)`` and ``init_module()``.
"""

from __future__ import annotations

import functools
from typing import Any, ContextManager

from fabriclite.rank_zero import rank_zero_deprecation


def _run_subclass(fabric: Any, *args: Any, **kwargs: Any) -> Any:
    # In each launched process: the subclass's own run (the instance attribute is the launching wrapper).
    return type(fabric).run(fabric, *args, **kwargs)


class LegacyAPI:
    """Mixed into ``Fabric``: ``run`` and ``sharded_model`` as Lightning Fabric 2.x has them."""

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override this in a subclass and put the training in it: calling ``run(...)`` then launches the processes
        (as ``launch``) and runs it in each. The base class's does nothing.

        Usage: ``class Trainer(Fabric): def run(self, epochs): ...``, then ``Trainer(devices=2).run(epochs=3)``.
        """

    def _prepare_run(self) -> None:
        if type(self).run is not LegacyAPI.run:
            self.run = functools.partial(self.launch, _run_subclass)  # type: ignore[attr-defined]

    def sharded_model(self) -> ContextManager:
        """Deprecated in Lightning for ``init_module()``: the block builds the model as the strategy builds it by
        default (on the CPU, weights initialised; ``init_module`` also places it and can skip the init).

        Usage: ``with fabric.sharded_model(): model = GPT(config)``.
        """
        rank_zero_deprecation("`Fabric.sharded_model()` is deprecated in favor of `Fabric.init_module()`.")
        self._check_launched("sharded_model")  # type: ignore[attr-defined]
        return self._strategy.module_init_context(None)  # type: ignore[attr-defined]
