"""``TorchCollective``: the collective operations of ``torch.distributed`` over the one group the object owns
(Lightning Fabric's class of the same name). A process can hold several, one per group: Lightning's
reinforcement-learning example keeps the whole world in one, the player and the first trainer in another, and gives
the trainers' own group to ``DDPStrategy(process_group=...)``.

Usage::

    world = TorchCollective().setup(backend="gloo")   # joins the default group from MASTER_ADDR/PORT, RANK, ...
    world.create_group()                              # owns a group of every rank
    world.broadcast(tensor, src=0)
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fabriclite._types import CollectibleGroup, RedOpType, ReduceOp
from fabriclite.plugins.collectives.collective import Collective
from fabriclite._versions import process_groups


class TorchCollective(Collective):
    """The ``torch.distributed`` operations over this object's group; the default (whole-world) group until
    ``create_group`` makes another. Reduce operations are given as ``ReduceOp`` members or their names in any case
    (``"sum"``, ``"avg"``, ``"max"``, ``"band"``...).

    Usage: ``TorchCollective().create_group(ranks=[0, 1]).all_reduce(tensor, op="max")``.
    """

    # Whether a TorchCollective joined the default group (so the last teardown may destroy it); shared by all.
    manages_default_group = False
    addr_key = "MASTER_ADDR"
    port_key = "MASTER_PORT"

    def __init__(self) -> None:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build, so TorchCollective cannot run.")
        super().__init__()

    @property
    def group(self) -> CollectibleGroup:
        if self._group is None:
            self._group = dist.GroupMember.WORLD
        return super().group

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        dist.broadcast(tensor, src, group=self.group)
        return tensor

    def all_reduce(self, tensor: Tensor, op: str | ReduceOp | RedOpType = "sum") -> Tensor:
        dist.all_reduce(tensor, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def reduce(self, tensor: Tensor, dst: int, op: str | ReduceOp | RedOpType = "sum") -> Tensor:
        dist.reduce(tensor, dst, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        dist.all_gather(tensor_list, tensor, group=self.group)
        return tensor_list

    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        dist.gather(tensor, gather_list, dst, group=self.group)
        return gather_list

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        dist.scatter(tensor, scatter_list, src, group=self.group)
        return tensor

    def reduce_scatter(
        self, output: Tensor, input_list: list[Tensor], op: str | ReduceOp | RedOpType = "sum"
    ) -> Tensor:
        dist.reduce_scatter(output, input_list, op=self._convert_to_native_op(op), group=self.group)
        return output

    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        dist.all_to_all(output_tensor_list, input_tensor_list, group=self.group)
        return output_tensor_list

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        dist.send(tensor, dst, tag=tag, group=self.group)

    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        dist.recv(tensor, src, tag=tag, group=self.group)
        return tensor

    def all_gather_object(self, object_list: list[Any], obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order, into ``object_list`` (one slot per rank)."""
        dist.all_gather_object(object_list, obj, group=self.group)
        return object_list

    def broadcast_object_list(self, object_list: list[Any], src: int, device: torch.device | None = None) -> list[Any]:
        """``src``'s picklable objects into every rank's ``object_list`` (same length everywhere)."""
        dist.broadcast_object_list(object_list, src, group=self.group, device=device)
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list[Any], dst: int = 0) -> list[Any]:
        """Every rank's picklable ``obj`` into ``dst``'s ``object_gather_list``."""
        dist.gather_object(obj, object_gather_list, dst, group=self.group)
        return object_gather_list

    def scatter_object_list(
        self, scatter_object_output_list: list[Any], scatter_object_input_list: list[Any], src: int = 0
    ) -> list[Any]:
        """Object ``i`` of ``src``'s input list into rank ``i``'s one-slot output list."""
        dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list, src, group=self.group)
        return scatter_object_output_list

    def barrier(self, device_ids: list[int] | None = None) -> None:
        if self.group == dist.GroupMember.NON_GROUP_MEMBER:  # a rank outside the group has nobody to wait for
            return
        dist.barrier(group=self.group, device_ids=device_ids)

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks which did not arrive within ``timeout`` (gloo only)."""
        dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)

    def setup(
        self, main_address: str | None = None, main_port: str | int | None = None, **kwargs: Any
    ) -> TorchCollective:
        """Join the default group with ``dist.init_process_group(**kwargs)`` unless this process already has.
        ``main_address``/``main_port`` stand in for ``MASTER_ADDR``/``MASTER_PORT`` where those are unset, for the
        join only. Returns ``self``."""
        if self.is_initialized():
            return self
        lent = [
            key
            for key, value in ((self.addr_key, main_address), (self.port_key, main_port))
            if value is not None and key not in os.environ
        ]
        for key, value in ((self.addr_key, main_address), (self.port_key, main_port)):
            if key in lent:
                os.environ[key] = str(value)
        try:
            super().setup(**kwargs)
        finally:
            for key in lent:
                os.environ.pop(key, None)
        TorchCollective.manages_default_group = True
        return self

    def teardown(self) -> TorchCollective:
        """Destroy this object's group; the default group too when a TorchCollective joined it and it is the last
        group left. Returns ``self``."""
        member = self.group != dist.GroupMember.NON_GROUP_MEMBER
        super().teardown()
        world = dist.GroupMember.WORLD
        if TorchCollective.manages_default_group and world is None:  # someone else destroyed it already
            TorchCollective.manages_default_group = False
        elif TorchCollective.manages_default_group and member and len(process_groups()) == 1:
            # Only a member destroys it, so that ranks outside the group do not race the members for it.
            self.destroy_group(world)
            TorchCollective.manages_default_group = False
        return self

    @classmethod
    def is_available(cls) -> bool:
        return dist.is_available()

    @classmethod
    def is_initialized(cls) -> bool:
        return cls.is_available() and dist.is_initialized()

    @classmethod
    def init_group(cls, **kwargs: Any) -> None:
        dist.init_process_group(**kwargs)

    @classmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        return dist.new_group(**kwargs)

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        # Every rank of the default group may call this; on a rank outside `group` it is a token, not a live group.
        if group in process_groups():
            dist.destroy_process_group(group)

    @classmethod
    def _convert_to_native_op(cls, op: str | ReduceOp | RedOpType) -> ReduceOp | RedOpType:
        # ReduceOp.SUM and its siblings are RedOpType members; a premultiplied sum is a ReduceOp. Both pass through.
        if isinstance(op, (ReduceOp, RedOpType)):
            return op
        if not isinstance(op, str):
            raise ValueError(f"Unsupported op {op!r} of type {type(op).__name__}: pass a ReduceOp or its name.")
        native = getattr(ReduceOp, op.upper(), None)
        if not isinstance(native, RedOpType):
            valid = ", ".join(name.lower() for name in RedOpType.__members__)
            raise ValueError(f"op {op.upper()!r} is not a member of `ReduceOp`. Valid names (any case): {valid}.")
        return native
