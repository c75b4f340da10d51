"""Model parallelism on a 2-D device mesh, Lightning Fabric's ``ModelParallelStrategy``: the user's
``parallelize_fn(model, mesh)`` applies tensor parallelism (``parallelize_module``) on the mesh's "tensor_parallel"
dimension and FSDP2 (``fully_shard``) on its "data_parallel" dimension, in that order, as torchtitan does.

A sibling of ``FSDPStrategy``, as in Lightning (neither is the other, so ``isinstance`` tells them apart); what
they share is in ``sharding.py``, held or called here: the setup around sharding (materialising an empty init's
slices, every rank taking rank 0's weights, optimizers pointed at the new parameters), compiling the units, sharded
DCP checkpoints. What is its own: the mesh, the data (ranks of one tensor-parallel group read the same batch, so
metrics sync over the data-parallel ranks only), who parallelizes the model, clipping over DTensors of two meshes.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack, nullcontext
from datetime import timedelta
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fabriclite import checkpoint, collectives
from fabriclite.plugins.environments import ClusterEnvironment
from fabriclite.strategies.mesh import MESH_DIMS, model_parallel_mesh
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.strategies.sharding import ShardedSetup, compile_units, meta_init, no_gradient_sync


class ModelParallelStrategy(ParallelStrategy):
    """Tensor parallel x FSDP2 with your ``parallelize_fn(model, device_mesh) -> model``.

    - ``data_parallel_size`` x ``tensor_parallel_size`` must be the world size; "auto" is the number of nodes x
      the devices per node (tensor parallelism inside a node, where the links are fast).
    - ``save_distributed_checkpoint``: True writes a folder of shards (every rank), False one full file (rank 0).

    Usage::

        def parallelize(model, mesh):
            parallelize_module(model, mesh["tensor_parallel"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(model, mesh=mesh["data_parallel"])
            return model

        fabric = Fabric(devices=4, strategy=ModelParallelStrategy(parallelize, data_parallel_size=2))
    """

    def __init__(
        self,
        parallelize_fn: Callable[[nn.Module, Any], nn.Module],
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: str = "subprocess",
        stall_timeout: float | None = 60.0,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        if not callable(parallelize_fn):
            raise TypeError(f"parallelize_fn={parallelize_fn!r} must be a function (model, device_mesh) -> model.")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise ValueError(f"{name}={size!r} must be an int >= 1 or 'auto'.")
        super().__init__(
            process_group_backend,
            timeout,
            start_method,
            stall_timeout=stall_timeout,
            cluster_environment=cluster_environment,
        )
        self.parallelize_fn = parallelize_fn
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = tensor_parallel_size
        self.state_dict_type = "sharded" if save_distributed_checkpoint else "full"

    def _process_state(self) -> dict[str, Any]:
        return {**super()._process_state(), "mesh": None, "_sharding": ShardedSetup()}

    @property
    def device_mesh(self) -> Any:
        """The (data parallel, tensor parallel) mesh; it exists once the processes run."""
        if self.mesh is None:
            raise RuntimeError("The device mesh exists once the processes run: call fabric.launch() first.")
        return self.mesh

    def setup_environment(self) -> None:
        """Join the process group and build the 2-D mesh."""
        super().setup_environment()
        if self.mesh is not None:
            return
        self.mesh = model_parallel_mesh(self.data_parallel_size, self.tensor_parallel_size, self)
        collectives.set_metric_group(self.mesh["data_parallel"].get_group())
        if self.precision is not None:
            self.precision.agree_across_ranks()

    def teardown(self) -> None:
        collectives.set_metric_group(None)
        super().teardown()

    def data_parallel_shard(self) -> tuple[int, int]:
        """Ranks of one tensor-parallel group read the same batch: the data is split over the data-parallel ranks."""
        dp_mesh = self.device_mesh["data_parallel"]
        return dp_mesh.size(), dp_mesh.get_local_rank()

    # ------------------------------------------------------------------ building and sharding
    def module_init_context(self, empty_init: bool | None = None) -> ContextManager:
        """With ``empty_init``, every rank builds the model on the meta device (no memory); ``setup_module`` then
        gives each rank storage for the slices ``parallelize_fn`` made, filled by ``reset_parameters()``."""
        return meta_init() if empty_init else nullcontext()

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to do here: ``parallelize_fn`` places the slices, and meta tensors cannot be moved."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Parallelize ``module`` with ``parallelize_fn``, then give what is still on the meta device its storage
        and every rank its slice of rank 0's weights."""
        return self._sharding.setup_module(self, module, self._shard, self.root_device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the model before ``setup_module`` at the new parameters."""
        return self._sharding.setup_optimizer(optimizer)

    def compile_module(self, module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
        """Compile each FSDP unit ``parallelize_fn`` made, then the root, in place."""
        return compile_units(module, kwargs)

    def _shard(self, module: nn.Module) -> nn.Module:
        # After an empty init the model is on the meta device on every rank; setup_module materialises the shards
        # parallelize_fn made (reset_parameters on each rank's DTensor slices).
        try:
            result = self.parallelize_fn(module, self.device_mesh)
        except KeyError as err:
            if any(name in str(err) for name in ("mesh_dim", "dim_name", "Invalid")):
                raise ValueError(
                    f"parallelize_fn asked the device mesh for a dimension it does not have ({err}). Its dimensions "
                    f"are named {MESH_DIMS}: use mesh['tensor_parallel'] and mesh['data_parallel']."
                ) from err
            raise
        if not isinstance(result, nn.Module):
            raise TypeError(
                f"parallelize_fn must return the parallelized model (an nn.Module), but it returned "
                f"{type(result).__name__}. End it with `return model`."
            )
        if self.world_size > 1 and not any(isinstance(p, DTensor) for p in result.parameters()):
            raise ValueError(
                "After parallelize_fn every parameter is still a plain tensor, so each process would train its own "
                "copy. Apply parallelize_module(model, mesh['tensor_parallel'], plan) and/or "
                "fully_shard(model, mesh=mesh['data_parallel']) inside it."
            )
        return result

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        """Skip the data-parallel gradient reduction of every FSDP unit ``parallelize_fn`` made (none: nothing to
        skip, tensor parallelism alone reduces no gradients)."""
        stack = ExitStack()
        if enabled:
            for unit in [m for m in module.modules() if isinstance(m, FSDPModule)]:
                stack.enter_context(no_gradient_sync(unit))
        return stack

    def clip_by_total_norm(
        self, module: nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """The norm over every gradient of the whole model: DTensor gradients on different meshes (tensor parallel
        and FSDP, or FSDP alone) each contribute their full norm."""
        parameters = [p for p in module.parameters() if p.grad is not None]
        norms = [torch.linalg.vector_norm(p.grad, norm_type) for p in parameters]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        norm = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is {norm.item()}, so they cannot be clipped. "
                "Pass error_if_nonfinite=False to clip anyway."
            )
        by_mesh: dict[Any, list[torch.Tensor]] = {}  # torch scales the gradients of one mesh at a time
        for p in parameters:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def save_checkpoint(
        self, path: Any, state: Mapping[str, Any], meta: dict[str, Any], filter: Mapping[str, Callable] | None = None
    ) -> None:
        """Write ``state`` plus fabriclite's ``meta``: a folder of shards (``save_distributed_checkpoint=True``) or
        one file from rank 0, both replacing ``path`` atomically."""
        sharded = self.state_dict_type == "sharded"
        checkpoint.save(path, checkpoint.to_checkpoint(state, meta, filter), self, sharded=sharded)

    def __repr__(self) -> str:
        sizes = f"data_parallel_size={self.data_parallel_size!r}, tensor_parallel_size={self.tensor_parallel_size!r}"
        return f"ModelParallelStrategy({sizes})"
