"""Calling the callbacks given to ``Fabric(callbacks=...)``: each one that has the hook gets the positional
arguments and, of the keyword arguments, those its signature accepts, so callbacks with different signatures can
share a hook name (``on_after_setup(fabric, module)`` and ``on_after_setup(module)``).

Usage: ``call_hook(callbacks, "on_train_epoch_end", results=results)``; ``fabric.call`` is this.
"""

from __future__ import annotations

import warnings
from typing import Any

from fabriclite._signatures import accepted_kwargs


def call_hook(callbacks: list[Any], hook_name: str, *args: Any, **kwargs: Any) -> None:
    """Call ``hook_name`` on every callback that has it; warn once per call about one that is not callable."""
    for callback in callbacks:
        method = getattr(callback, hook_name, None)
        if method is None:
            continue
        if not callable(method):
            warnings.warn(
                f"Skipping the callback `{type(callback).__name__}.{hook_name}` because it is not callable "
                f"(it is a {type(method).__name__}).",
                UserWarning,
                stacklevel=3,
            )
            continue
        method(*args, **accepted_kwargs(method, kwargs))
