"""The interface of a collective (Lightning Fabric's ``Collective``): an object that owns one process group and runs
the ``torch.distributed`` operations over it, so code can hand "the players' group" or "the trainers' group" around
as one object instead of passing ``group=`` to every call. ``TorchCollective`` fills it in with torch.distributed,
``SingleDeviceCollective`` with the answers of a world of one.

Usage::

    world = TorchCollective().setup(backend="gloo")     # joins the default group if nobody has yet
    pair = TorchCollective().create_group(ranks=[0, 1])  # a collective owning a new group
    pair.broadcast(weights, src=1)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor

from fabriclite._types import CollectibleGroup

__all__ = ["CollectibleGroup", "Collective"]


class Collective(ABC):
    """One process group and the collective operations over it; subclasses say how they run.

    Usage: ``collective.create_group(ranks=[1, 2]).all_reduce(tensor, op="sum")``.
    """

    def __init__(self) -> None:
        self._group: CollectibleGroup | None = None

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """How many processes the group has."""

    @property
    def group(self) -> CollectibleGroup:
        """The group this collective owns; a ``RuntimeError`` before ``create_group``."""
        if self._group is None:
            raise RuntimeError(
                f"`{type(self).__name__}` does not own a group yet: call `collective.create_group(...)` first "
                "(after `setup()`, which joins the default group)."
            )
        return self._group

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Tensor: ...

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: Any) -> Tensor: ...

    @abstractmethod
    def reduce(self, tensor: Tensor, dst: int, op: Any) -> Tensor: ...

    @abstractmethod
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]: ...

    @abstractmethod
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]: ...

    @abstractmethod
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor: ...

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any) -> Tensor: ...

    @abstractmethod
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]: ...

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None: ...

    @abstractmethod
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor: ...

    @abstractmethod
    def barrier(self, device_ids: list[int] | None = None) -> None: ...

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def is_initialized(cls) -> bool: ...

    @classmethod
    @abstractmethod
    def init_group(cls, **kwargs: Any) -> None: ...

    @classmethod
    @abstractmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup: ...

    @classmethod
    @abstractmethod
    def destroy_group(cls, group: CollectibleGroup) -> None: ...

    @classmethod
    @abstractmethod
    def _convert_to_native_op(cls, op: Any) -> Any: ...

    def setup(self, **kwargs: Any) -> Collective:
        """Join the default group (``init_group(**kwargs)``) unless this process already has; returns ``self``."""
        if not self.is_initialized():
            self.init_group(**kwargs)
        return self

    def create_group(self, **kwargs: Any) -> Collective:
        """Make a new group (``new_group(**kwargs)``, e.g. ``ranks=[0, 1]``) and own it; returns ``self``. Every
        process of the default group must call it, also those left out of the new group."""
        if self._group is not None:
            raise RuntimeError(f"`{type(self).__name__}` already owns a group; make another collective for a second.")
        self._group = self.new_group(**kwargs)
        return self

    def teardown(self) -> Collective:
        """Destroy the group this collective owns; returns ``self``."""
        if self._group is None:
            raise RuntimeError(f"`{type(self).__name__}` owns no group to destroy.")
        self.destroy_group(self._group)
        self._group = None
        return self
