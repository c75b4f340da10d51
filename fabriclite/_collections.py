"""Walking nested containers of tensors: the one helper every other module uses to touch a batch."""

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
    if isinstance(data, dtype):
        return function(data, *args, **kwargs)
    if isinstance(data, Mapping):
        return type(data)({k: apply_to_collection(v, dtype, function, *args, **kwargs) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(apply_to_collection(v, dtype, function, *args, **kwargs) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_collection(v, dtype, function, *args, **kwargs) for v in data)
    return data


def move_to_device(data: Any, device: torch.device) -> Any:
    """Move every tensor (and module) in ``data`` to ``device``; non-blocking when it's a CUDA copy.

    Usage: ``batch = move_to_device(batch, torch.device("cuda", 0))``.
    """
    non_blocking = device.type == "cuda"
    if isinstance(data, torch.nn.Module):
        return data.to(device)
    return apply_to_collection(data, torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking))


def convert_to_tensors(data: Any, device: torch.device) -> Any:
    """Turn numbers into tensors and move all tensors to ``device`` (what collectives expect).

    Usage: ``convert_to_tensors({"loss": 0.5}, torch.device("cpu"))``.
    """
    data = apply_to_collection(data, (int, float, bool), lambda x: torch.tensor(x))
    return move_to_device(data, device)


def to_python_scalars(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Turn one-element tensors into Python numbers, so loggers never hold graph or device memory."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"Logged value {key!r} must be a number or a one-element tensor, got shape {tuple(value.shape)}"
                )
            value = value.item()
        out[key] = value
    return out
