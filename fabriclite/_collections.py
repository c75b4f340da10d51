"""Walking nested containers of tensors: the one helper every other module uses to touch a batch; and
``AttributeDict``, the dict whose keys are attributes (Lightning's ``utilities.data`` path re-exports it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch


def apply_to_collection(
    data: Any, dtype: type | tuple[type, ...], function: Callable, *args: Any, **kwargs: Any
) -> Any:
    """Return ``data`` with ``function`` applied to every element of type ``dtype``, keeping the containers.

    Usage: ``apply_to_collection(batch, torch.Tensor, lambda t: t.to("cuda"))``.
    Handles dicts (and other mappings with a dict-like constructor), lists, tuples, namedtuples and dataclasses
    are returned as they are; anything else is passed through untouched.
    """
    return _walk(data, dtype, lambda _, value: function(value, *args, **kwargs), ())


def as_list(value: Any) -> list:
    """``None`` -> ``[]``, a list or tuple -> a list of its items, anything else -> ``[value]``."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def map_with_path(
    data: Any,
    dtype: type | tuple[type, ...],
    function: Callable[[tuple, Any], Any],
    other: Callable[[tuple, Any], Any] | None = None,
) -> Any:
    """Like ``apply_to_collection``, but ``function(path, element)`` also gets the tuple of keys and indices that
    lead to the element; ``other(path, value)``, if given, replaces every other value that is not a container
    (numbers, strings, ``None`` are kept as they are). Usage: ``map_with_path({"a": [t]}, torch.Tensor, f)`` calls
    ``f(("a", 0), t)``."""
    return _walk(data, dtype, function, (), other)


_ATOMS = frozenset({int, float, bool, str, bytes, type(None)})


def _walk(
    data: Any,
    dtype: type | tuple[type, ...],
    function: Callable[[tuple, Any], Any],
    path: tuple,
    other: Callable[[tuple, Any], Any] | None = None,
) -> Any:
    if isinstance(data, dtype):
        return function(path, data)
    if type(data) in _ATOMS:  # most leaves: no slower checks (a random state holds 625 numbers)
        return data
    if isinstance(data, Mapping):
        return type(data)({k: _walk(v, dtype, function, (*path, k), other) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(_walk(v, dtype, function, (*path, i), other) for i, v in enumerate(data)))
    if isinstance(data, (list, tuple)):
        return type(data)(_walk(v, dtype, function, (*path, i), other) for i, v in enumerate(data))
    return data if other is None else other(path, data)


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor (and module) in ``data`` to ``device``; non-blocking when it's a CUDA copy.

    Usage: ``batch = move_to_device(batch, torch.device("cuda", 0))``.
    """
    non_blocking = device.type == "cuda"
    if isinstance(data, torch.nn.Module):
        return data.to(device)
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking))


def convert_to_tensors(data: Any, device: torch.device) -> Any:
    """Turn numbers and NumPy arrays into tensors and move all tensors to ``device`` (what collectives expect).

    Usage: ``convert_to_tensors({"loss": 0.5}, torch.device("cpu"))``.
    """
    import numpy as np  # torch has imported it already

    data = apply_to_collection(data, (int, float, bool, np.ndarray, np.generic), lambda x: torch.tensor(x))
    return move_to_device(data, device)


def convert_tensors_to_scalars(data: Any) -> Any:
    """Turn every one-element tensor in ``data`` (nested dicts, lists, tuples) into a Python number, so loggers never
    hold graph or device memory; a tensor of more elements is an error naming where it sits.

    Usage: ``convert_tensors_to_scalars({"loss": loss, "acc": [acc]})``.
    """

    def to_item(path: tuple, value: torch.Tensor) -> Any:
        if value.numel() != 1:
            where = "".join(f"[{key!r}]" for key in path) or "the value"
            raise ValueError(
                f"The metric `{where}` does not contain a single element, thus it cannot be converted to a scalar: "
                f"log a number or a one-element tensor, got shape {tuple(value.shape)}."
            )
        return value.item()

    return map_with_path(data, torch.Tensor, to_item)


def move_data_to_device(batch: Any, device: torch.device | str | int) -> Any:
    """Move every tensor (and module) in ``batch`` to ``device``, keeping the containers.

    Usage: ``move_data_to_device({"x": x, "y": [y]}, torch.device("cuda", 0))``.
    """
    return move_to_device(batch, torch.device(device))


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr`` is ``hparams["lr"]``.

    Usage: ``hparams = AttributeDict(lr=1e-3, batch_size=32); hparams.lr = 3e-4``.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            name = type(self).__name__
            raise AttributeError(f"{name!r} object has no attribute {key!r}; its keys: {sorted(self)}.") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        if key not in self:  # a KeyError, as in Lightning: ``del`` on a dict
            raise KeyError(f"{type(self).__name__} has no key {key!r} to delete; its keys: {sorted(self)}.")
        del self[key]

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(key)) for key in self)
        return "\n".join(
            f"{key!s:>{width}}: {value!r}" for key, value in sorted(self.items(), key=lambda kv: str(kv[0]))
        )
