"""The structural types of Lightning Fabric's ``lightning.fabric.utilities.types``, which code written for Lightning
imports (its trainer examples, the collectives): what counts as a path, a device, an optimizer, a process group, an
object with state. Protocols, so ``isinstance(torch.optim.SGD(...), Optimizable)`` holds without any registration.
Imports nothing of fabriclite; the public path is ``fabriclite.utilities.types``.

Usage: ``def train(optimizer: Optimizable, ckpt_path: _PATH) -> None: ...``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, TypeVar, Union, overload, runtime_checkable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup, ReduceOp  # noqa: F401  (re-exported at utilities.types)

UntypedStorage = torch.UntypedStorage
RedOpType = ReduceOp.RedOpType  # what ReduceOp.SUM and the others really are

_PATH = Union[str, Path]
_DEVICE = Union[torch.device, str, int]
_MAP_LOCATION_TYPE = Optional[
    Union[_DEVICE, Callable[[UntypedStorage, str], Optional[UntypedStorage]], dict[_DEVICE, _DEVICE]]
]
_PARAMETERS = Iterator[torch.nn.Parameter]

_DictKey = TypeVar("_DictKey")


@runtime_checkable
class _Stateful(Protocol[_DictKey]):
    """Anything with ``state_dict()`` and ``load_state_dict(state)``: ``isinstance(obj, _Stateful)``."""

    def state_dict(self) -> dict[_DictKey, Any]: ...

    def load_state_dict(self, state_dict: dict[_DictKey, Any]) -> None: ...


@runtime_checkable
class CollectibleGroup(Protocol):
    """A process group as the collectives use it: it knows its size and this process's rank in it."""

    def size(self) -> int: ...

    def rank(self) -> int: ...


@runtime_checkable
class Steppable(Protocol):
    """Anything with an optimizer's ``step(closure=None)``."""

    @overload
    def step(self, closure: None = ...) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = ...) -> float | None: ...


@runtime_checkable
class Optimizable(Steppable, Protocol):
    """An optimizer, structurally: ``step``, its ``param_groups``, ``defaults`` and ``state``, and its state dict."""

    param_groups: list[dict[Any, Any]]
    defaults: dict[Any, Any]
    state: defaultdict[Tensor, Any]

    def state_dict(self) -> dict[str, dict[Any, Any]]: ...

    def load_state_dict(self, state_dict: dict[str, dict[Any, Any]]) -> None: ...
