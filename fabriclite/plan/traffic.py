"""What a rank sends through collectives in a step, and what its checkpoint weighs, counted on the tensors the
script hands to torch (fake ones in a plan, real ones in a real run alike).

Collectives: every collective op that reaches torch's dispatcher (``c10d``: what DDP, FSDP2 and
``torch.distributed`` call; ``_c10d_functional``: what DTensor and tensor parallelism call) is counted with the bytes
this rank hands to it (the tensor it all-reduces or broadcasts, its shard for an all-gather, its whole input for a
reduce-scatter) and the size of its group, in the step being counted (``Step`` numbers: the optimizer steps
finished before it). From those, the bytes a rank puts on the wire under a ring algorithm, as NCCL's and gloo's
ring and tree algorithms do for large messages: an all-reduce of S bytes sends 2(n-1)/n S, an all-gather of a
shard of S sends (n-1) S, a reduce-scatter of S sends (n-1)/n S.

Checkpoint: the bytes of the tensors ``fabric.save`` writes for the models and optimizers the script set up: with
a sharded checkpoint every rank writes its own shards (a tensor several ranks hold alike is written once: its
bytes are shared out between them), with a full one rank 0 writes every tensor whole.

Usage::

    counter = CollectiveCounter()
    with counter:
        ...                                 # the script; counter.on_step_end(optimizer) after each optimizer step
    counter.by_collective(step=1)           # [{"collective": "all_reduce", "group": 2, "calls": 3, ...}, ...]
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from fabriclite._versions_fake import group_size_of, op_name, tensors_in, torch_dispatch_mode

# Which argument of each collective holds what this rank hands to it (every other one receives).
_SENT_ARGUMENT = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "broadcast_": 0,
    "send": 0,
    "allgather_": 1,
    "_allgather_base_": 1,
    "allgather_coalesced_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "reduce_scatter_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_": 1,
    "alltoall_base_": 1,
}
_NOT_SENDING = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "recv_", "recv_any_source_"}
# Bytes on the wire under a ring, per byte handed in, for a group of n.
_RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1 if n > 1 else 0,
    "send": lambda n: 1,
}


def collective_name(op_name: str) -> str:
    """``"allreduce_"``, ``"all_reduce_coalesced"``, ``"_allgather_base_"`` -> ``"all_reduce"``, ``"all_gather"``."""
    bare = op_name.strip("_").replace("_coalesced", "").replace("_into_tensor", "").replace("_base", "")
    bare = bare.replace("_tensor", "").replace("_single", "").rstrip("_")
    return {"allreduce": "all_reduce", "allgather": "all_gather", "alltoall": "all_to_all"}.get(bare, bare)


class CollectiveCounter(torch_dispatch_mode()):
    """Counts each collective's calls and the bytes this rank hands to it, per step."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0  # optimizer steps finished
        # (step, collective, group size) -> [calls, bytes handed in]
        self.counts: dict[tuple[int, str, int], list[int]] = defaultdict(lambda: [0, 0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional") and op_name(func) not in _NOT_SENDING:
            self._count(func, args)
        return func(*args, **kwargs)

    def _count(self, func: Any, args: tuple) -> None:
        name = op_name(func)
        index = _SENT_ARGUMENT.get(name, 0)
        sent = sum(t.numel() * t.element_size() for t in tensors_in(args[index])) if index < len(args) else 0
        record = self.counts[(self.step, collective_name(name), group_size_of(func, args))]
        record[0] += 1
        record[1] += sent

    # FakeWorld's hooks: only the end of a step matters here.
    def on_first_forward(self, module: Any) -> None:
        pass

    def on_step_start(self, optimizer: torch.optim.Optimizer, modules: list[Any]) -> None:
        pass

    def on_step_end(self, optimizer: torch.optim.Optimizer) -> None:
        self.step += 1

    def by_collective(self, step: int) -> list[dict[str, Any]]:
        """The collectives of ``step`` (0: up to the end of the first optimizer step), largest first."""
        rows = []
        for (at, name, group), (calls, handed) in self.counts.items():
            if at != step:
                continue
            ring = _RING.get(name)
            sent = None if ring is None else math.ceil(handed * ring(group)) if group > 0 else None
            rows.append({"collective": name, "group": group, "calls": calls, "bytes_in": handed, "bytes_sent": sent})
        return sorted(rows, key=lambda row: -row["bytes_in"])


def checkpoint_bytes(
    modules: list[Any], optimizers: list[Any], strategy: Any, world_size: int, rank: int = 0
) -> dict[str, Any]:
    """The tensor bytes ``fabric.save({"model": ..., "optimizer": ...})`` writes: in all, and by this process,
    global ``rank`` (a full checkpoint is rank 0's to write)."""
    sharded = getattr(strategy, "state_dict_type", "full") == "sharded"
    tensors: list[torch.Tensor] = []
    for wrapped in modules:
        module = wrapped._original_module
        tensors += [t for t in module.state_dict().values() if isinstance(t, torch.Tensor)]
    for wrapped in optimizers:
        tensors += tensors_in(list(wrapped.optimizer.state.values()))
    total = mine = 0
    for tensor in tensors:
        whole = tensor.numel() * tensor.element_size()  # a DTensor's numel is the whole tensor's
        local, copies = _local_and_copies(tensor, world_size)
        total += whole
        mine += local / copies if sharded else (whole if rank == 0 else 0)
    return {"sharded": sharded, "total": total, "rank": int(mine)}


def _local_and_copies(tensor: torch.Tensor, world_size: int) -> tuple[int, int]:
    """Bytes this rank holds of ``tensor`` and how many ranks hold the same bytes."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(tensor, DTensor):
        return tensor.numel() * tensor.element_size(), world_size  # every rank holds it alike
    local = tensor.to_local()
    copies = math.prod(
        size for size, placement in zip(tensor.device_mesh.shape, tensor.placements) if isinstance(placement, Replicate)
    )
    # A mesh smaller than the world (tensor parallel x FSDP) is one of world / mesh alike: those copy it too.
    copies *= world_size // tensor.device_mesh.size()
    return local.numel() * local.element_size(), copies
