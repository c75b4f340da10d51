"""The device meshes the sharding strategies run on, built in one place once the processes run: FSDP's 1-D mesh
(or (replicate, shard) for hybrid sharding, (world, 1) for no sharding) and model parallelism's (data parallel,
tensor parallel) mesh. What each rank holds on them is ``sharding.py``'s and the strategies' business.

Usage: ``self.mesh = sharding_mesh(self.mesh_kind, self._mesh_request, self)`` in a strategy's ``setup_environment``.
"""

from __future__ import annotations

from typing import Any

from fabriclite._versions_fake import real_tensors

MESH_DIMS = ("data_parallel", "tensor_parallel")  # ModelParallelStrategy's mesh, as Lightning names its dimensions


# FSDP1's sharding strategies as FSDP2 expresses them: (reshard_after_forward, mesh). "flat": shard over every
# rank; "hybrid": a 2-D mesh (replicate, shard), sharded within a group and replicated across groups (HSDP);
# "replicate": (world, 1), whole parameters everywhere, gradients all-reduced, as DDP.
SHARDING_STRATEGIES = {
    "FULL_SHARD": (True, "flat"),
    "SHARD_GRAD_OP": (False, "flat"),
    "HYBRID_SHARD": (True, "hybrid"),
    "_HYBRID_SHARD_ZERO2": (False, "hybrid"),
    "NO_SHARD": (False, "replicate"),
}


def sharding_choice(sharding_strategy: Any, reshard_after_forward: bool, device_mesh: Any) -> tuple[bool, str]:
    """``(reshard_after_forward, mesh kind)`` for FSDPStrategy's arguments, each checked against the others."""
    if sharding_strategy is None:
        name = "HYBRID_SHARD" if device_mesh is not None else "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
    else:
        name = getattr(sharding_strategy, "name", sharding_strategy)  # ShardingStrategy.FULL_SHARD -> "FULL_SHARD"
    if name not in SHARDING_STRATEGIES:
        raise ValueError(
            f"sharding_strategy={sharding_strategy!r} is not supported. Valid: {', '.join(map(repr, SHARDING_STRATEGIES))}."
        )
    if sharding_strategy is not None and name in ("FULL_SHARD", "HYBRID_SHARD") and reshard_after_forward is False:
        raise ValueError(
            f"sharding_strategy={name!r} reshards after forward, but reshard_after_forward=False was also given; "
            "pass one of them ('SHARD_GRAD_OP' and '_HYBRID_SHARD_ZERO2' keep the parameters until backward)."
        )
    resharding, mesh = SHARDING_STRATEGIES[name]
    if device_mesh is not None and mesh != "hybrid":
        raise ValueError(
            f"device_mesh={device_mesh!r} is for hybrid sharding; with sharding_strategy={name!r} leave it out, or "
            "pass sharding_strategy='HYBRID_SHARD'."
        )
    if device_mesh is not None and not is_device_mesh(device_mesh):
        if not (
            isinstance(device_mesh, tuple)
            and len(device_mesh) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in device_mesh)
        ):
            raise ValueError(
                f"device_mesh={device_mesh!r} must be (replicate, shard): two ints >= 1 whose product is the world "
                "size, e.g. (2, 8) for 2 nodes of 8 GPUs; or a 2-D torch DeviceMesh."
            )
    return resharding, mesh


def is_device_mesh(obj: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def sharding_mesh(kind: str, request: Any, strategy: Any) -> Any:
    """The mesh FSDP shards over: ``kind`` from ``sharding_choice``, ``request`` the user's ``device_mesh`` (a
    (replicate, shard) shape, a 2-D ``DeviceMesh`` or None), sized by the running ``strategy``'s processes."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "flat":
        with real_tensors():  # a mesh holds rank numbers, also in a script `fabriclite plan` runs on fake tensors
            return init_device_mesh(strategy.root_device.type, (strategy.world_size,))
    if is_device_mesh(request):
        if request.ndim != 2 or request.size() != strategy.world_size:
            raise ValueError(
                f"device_mesh={request} must be 2-D (replicate, shard) and span all {strategy.world_size} processes."
            )
        return request
    shape = request or (
        (strategy.world_size, 1) if kind == "replicate" else (strategy.num_nodes, strategy.local_processes)
    )
    if shape[0] * shape[1] != strategy.world_size:
        raise ValueError(
            f"device_mesh={shape} holds {shape[0] * shape[1]} processes, but the world size is "
            f"{strategy.world_size}: (replicate, shard) must multiply to it."
        )
    with real_tensors():
        return init_device_mesh(strategy.root_device.type, shape, mesh_dim_names=("replicate", "shard"))


def model_parallel_mesh(data_parallel_size: int | str, tensor_parallel_size: int | str, strategy: Any) -> Any:
    """The (data parallel, tensor parallel) mesh; "auto" is the number of nodes x the devices per node (tensor
    parallelism inside a node, where the links are fast)."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = strategy.num_nodes if data_parallel_size == "auto" else data_parallel_size
    tp = strategy.local_processes if tensor_parallel_size == "auto" else tensor_parallel_size
    if dp * tp != strategy.world_size:
        raise ValueError(
            f"data_parallel_size * tensor_parallel_size = {dp} * {tp} = {dp * tp}, but the world size is "
            f"{strategy.world_size} (devices * num_nodes). Choose sizes whose product is {strategy.world_size}."
        )
    with real_tensors():
        return init_device_mesh(strategy.root_device.type, (dp, tp), mesh_dim_names=MESH_DIMS)
