"""Which keyword arguments a function accepts, so that one call site can serve functions with different signatures:
the callbacks sharing a hook name, and a user's ``CheckpointIO.load_checkpoint`` written before ``verify=`` existed.

Usage: ``method(*args, **accepted_kwargs(method, kwargs))``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


def accepted_kwargs(method: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``method`` accepts by name (all of them when it takes ``**kwargs``, or when its
    signature cannot be read, as for some builtins)."""
    if not kwargs:
        return kwargs
    try:
        parameters = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return kwargs
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {name: value for name, value in kwargs.items() if name in names}
