"""The collective of a world of one process (Lightning Fabric's ``SingleDeviceCollective``): every operation gives
back what one process would get, without ``torch.distributed``.

Usage: ``collective = SingleDeviceCollective(); total = collective.all_reduce(loss)``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fabriclite._types import CollectibleGroup
from fabriclite.plugins.collectives.collective import Collective


class SingleDeviceCollective(Collective):
    """Rank 0 of 1: reductions and broadcasts return their input, gathers a list of it, sends and barriers do nothing.

    Usage: ``SingleDeviceCollective().all_gather([], tensor) == [tensor]``.
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def broadcast(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def all_reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor, **__: Any) -> list[Tensor]:
        return [tensor]

    def gather(self, tensor: Tensor, *_: Any, **__: Any) -> list[Tensor]:
        return [tensor]

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        return scatter_list[0]

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        return input_list[0]

    def all_to_all(
        self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], *_: Any, **__: Any
    ) -> list[Tensor]:
        return input_tensor_list

    def send(self, *_: Any, **__: Any) -> None:
        pass

    def recv(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        return tensor

    def barrier(self, *_: Any, **__: Any) -> None:
        pass

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def is_initialized(cls) -> bool:
        return True

    @classmethod
    def init_group(cls, **_: Any) -> None:
        pass

    @classmethod
    def new_group(cls, **_: Any) -> CollectibleGroup:
        return object()  # type: ignore[return-value]  # a token: there is nobody to group with

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        pass

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        return op
