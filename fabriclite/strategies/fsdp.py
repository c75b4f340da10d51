"""FSDP2: each rank holds a slice of every parameter, gradient and optimizer state, and gathers a block's full
weights only while that block runs (``torch.distributed.fsdp.fully_shard``; parameters become DTensors).

Runs on CPU with gloo and on CUDA with NCCL, also on one process (a group of one). The choices made here:

- Units: by default each block that repeats in an ``nn.ModuleList``/``nn.Sequential`` (transformer blocks) is one
  ``fully_shard`` unit, then the root takes the rest. After sharding, every rank takes its slice of rank 0's
  weights, as DDP broadcasts rank 0's.
- Mixed precision: FSDP casts the parameters to the precision's ``param_dtype`` (bf16/fp16) before gathering them (half the traffic and the gathered
  memory), and the precision's autocast stays on around the forward: it finds those weights already in the low
  dtype, so nothing is cast twice, and it keeps covering what FSDP's cast does not (softmax, norms and losses stay
  fp32; ops on other fp32 tensors run in the low dtype). Gradients are reduced in fp32 into fp32 shards, and
  outputs come back in fp32.
- Optimizers built on the unsharded model are pointed at the shards (same groups, order and hyperparameters).
- Over gloo, FSDP2 sums the gradients and divides them itself (``average_gradients_on_gloo``): gloo's
  reduce-scatter summed where FSDP2 asked for an average on torch 2.8 (2x the gradients on 2 ranks).
- ``init_module(empty_init=True)``: every rank builds the model on the meta device (no memory). ``setup_module``
  then, unit by unit, gives the unit's tensors storage, fills them with its modules' ``reset_parameters()`` (the
  same numbers on every rank) and shards it at once, so a rank holds its shards plus one unit in full at most. The
  weights are a fresh init, not those of a model built normally with the same seed; what ``reset_parameters``
  does not fill (buffers computed in ``__init__``) stays uninitialised, with a warning, until a checkpoint is loaded.
  Without empty init, every rank takes its slice of rank 0's weights, as DDP broadcasts them.
- Checkpoints: ``state_dict_type`` picks the format in ``fabriclite.checkpoint``: "sharded", a folder every rank
  writes its shards into, or "full", one file from rank 0 in the form a one-process checkpoint has.

The mesh is built in ``mesh.py``; what FSDP shares with ``ModelParallelStrategy`` (choosing the units, the empty
init, skipping gradient sync) is in ``sharding.py``; the loss scaler that agrees across ranks is the precision's.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Callable, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fabriclite import checkpoint
from fabriclite._blocks import repeated_blocks  # also importable from here, where it lived first
from fabriclite.checkpoint import CheckpointIO
from fabriclite.plugins.environments import ClusterEnvironment
from fabriclite.strategies.mesh import sharding_choice, sharding_mesh
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.strategies.sharding import (
    ModulePolicy,
    has_meta,
    materialize,
    meta_init,
    module_policy,
    named_tensors,
    no_gradient_sync,
    refuse_meta_optimizer,
    warn_uninitialized,
)
from fabriclite.utilities.imports import average_gradients_on_gloo, checkpoint_activations

STATE_DICT_TYPES = ("sharded", "full")


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel with FSDP2 on gloo (CPU) or nccl (CUDA).

    - ``auto_wrap_policy``: the layer classes (or a ``module -> bool`` function) that become sharding units; by
      default the blocks that repeat in an ``nn.ModuleList``/``nn.Sequential``.
    - ``activation_checkpointing_policy``: layer classes whose activations are recomputed in backward.
    - ``mixed_precision``: an FSDP ``MixedPrecisionPolicy``; by default from the Fabric precision: its
      ``param_dtype`` ("bf16-mixed": bf16, "16-mixed": fp16) for the gathered parameters, fp32 gradient reduction.
    - ``cpu_offload``: keep the parameter, gradient and optimizer shards in CPU memory.
    - ``state_dict_type``: "sharded" (a directory, every rank writes its shards) or "full" (one file from rank 0).
    - ``sharding_strategy``: Lightning's FSDP1 spelling (a string or ``torch.distributed.fsdp.ShardingStrategy``):
      "FULL_SHARD" frees the gathered parameters after forward, "SHARD_GRAD_OP" keeps them until backward
      (``reshard_after_forward=False``: more memory, one all-gather less); "HYBRID_SHARD" shards within groups of
      ranks and replicates across them (HSDP: the all-gathers stay inside a node), on ``device_mesh=(replicate,
      shard)`` or a 2-D ``DeviceMesh``, by default (num_nodes, devices per node); "NO_SHARD" replicates everything.

    Usage: ``Fabric(devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}), precision="bf16-mixed")``.
    """

    def __init__(
        self,
        auto_wrap_policy: ModulePolicy = None,
        activation_checkpointing_policy: ModulePolicy = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        state_dict_type: str = "sharded",
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: str = "subprocess",
        checkpoint_io: CheckpointIO | None = None,
        stall_timeout: float | None = 60.0,
        cluster_environment: ClusterEnvironment | None = None,
        sharding_strategy: Any = None,
        device_mesh: tuple[int, int] | Any = None,
    ) -> None:
        super().__init__(
            process_group_backend, timeout, start_method, checkpoint_io, stall_timeout, cluster_environment
        )
        reshard_after_forward, self.mesh_kind = sharding_choice(sharding_strategy, reshard_after_forward, device_mesh)
        self._mesh_request = device_mesh  # the shape or mesh asked for; self.mesh is the mesh built
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not supported. Valid choices: 'sharded', 'full'.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision={mixed_precision!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy, or None "
                "to follow the Fabric precision."
            )
        self.wrap_policy = module_policy(auto_wrap_policy, "auto_wrap_policy")
        self.checkpoint_policy = module_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.mixed_precision = mixed_precision
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = reshard_after_forward
        self.state_dict_type = state_dict_type

    def _process_state(self) -> dict[str, Any]:
        return {
            **super()._process_state(),
            "mesh": None,
            # Parameters fully_shard replaced, so optimizers built on the unsharded model can be pointed at the
            # shards: id(old) -> (old, new), both weak: the full-size originals go with their optimizer, the shards
            # with the model.
            "_sharded_params": {},
            "_optimizers": weakref.WeakSet(),
        }

    @property
    def device_mesh(self) -> Any:
        """The device mesh the parameters are sharded over; it exists once the processes run."""
        if self.mesh is None:
            raise RuntimeError("The device mesh exists once the processes run: call fabric.launch() first.")
        return self.mesh

    def setup_environment(self) -> None:
        """Join the process group, build the device mesh (1-D, or (replicate, shard) for hybrid sharding), and make
        the loss scaler agree across ranks."""
        super().setup_environment()
        if self.mesh is not None:
            return
        self.mesh = sharding_mesh(self.mesh_kind, self._mesh_request, self)
        if self.precision is not None:
            self.precision.agree_across_ranks()

    # ------------------------------------------------------------------ building and sharding
    def module_init_context(self, empty_init: bool | None = None) -> ContextManager:
        """With ``empty_init``, every rank builds the model on the meta device (no memory); ``setup_module`` then
        gives each rank storage for its own shards only, filled by the modules' ``reset_parameters()``."""
        return meta_init() if empty_init else nullcontext()

    def module_to_device(self, module: nn.Module) -> None:
        """Nothing to do here: ``fully_shard`` moves each shard to the device (or keeps it on the CPU with offload),
        and the meta tensors of an empty init cannot be moved."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        """Shard ``module`` in place: activation checkpointing, then one ``fully_shard`` per unit, then the root;
        finally every rank takes its slice of rank 0's weights (as DDP broadcasts them)."""
        if type(module).__name__ == "OptimizedModule":  # compiled by the user: shard the model inside, keep the wrapper
            self.setup_module(module._orig_mod)
            return module
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            raise ValueError(
                f"{type(module).__name__} already contains fully_shard modules; pass fabric.setup the plain model."
            )
        metas = self.all_gather_object(has_meta(module))
        if any(metas) and not all(metas):
            raise ValueError(
                f"The model has parameters or buffers on the meta device on ranks {[r for r, m in enumerate(metas) if m]} "
                "only. Build it the same way on every rank: inside `with fabric.init_module(empty_init=True):` (the meta "
                "device everywhere, each rank's shard initialised in setup), or with real weights everywhere."
            )
        # Rank 0's full weights, taken before sharding replaces the parameters (aliases: fully_shard may move the
        # parameters' data to the device, these stay where the model was built).
        source = (
            {name: t.detach() for name, t in named_tensors(module).items()}
            if self.is_global_zero and self.world_size > 1 and not metas[0]
            else {}
        )
        old_params = [(name, weakref.ref(p)) for name, p in module.named_parameters()]
        self._uninitialized: list[str] = []
        module = self._shard(module)
        average_gradients_on_gloo(module)
        if has_meta(module):  # what _shard left on the meta device (ModelParallelStrategy's parallelize_fn)
            self._uninitialized += materialize(module, self._materialize_device)
        warn_uninitialized(self._uninitialized)
        if self.world_size > 1 and not metas[0]:
            self._copy_from_rank_zero(module, source)
        new_params = dict(module.named_parameters())
        for name, old in old_params:
            if old() is not None:
                self._sharded_params[id(old())] = (old, weakref.ref(new_params[name]))
        for optimizer in list(self._optimizers):  # set up before this module: point them at the shards now
            self._remap_optimizer(optimizer)
        return module

    def _shard(self, module: nn.Module) -> nn.Module:
        # Activation checkpointing, then one fully_shard per unit (innermost first), then the root.
        if self.checkpoint_policy is not None:
            for block in [m for m in module.modules() if m is not module and self.checkpoint_policy(m)]:
                checkpoint_activations(block)
        units = (
            repeated_blocks(module)
            if self.wrap_policy is None
            else [m for m in module.modules() if m is not module and self.wrap_policy(m)]
        )
        options = {
            "mesh": self.mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self._mixed_precision_policy(),
            "offload_policy": CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
            if self.cpu_offload
            else OffloadPolicy(),
        }
        # Innermost first: a unit's parameters must not be claimed by an outer one. After an empty init, each unit
        # gets storage just before it is sharded, so one unit at a time is ever whole.
        for unit in [*reversed(units), module]:
            if has_meta(unit):
                self._uninitialized += materialize(unit, self._materialize_device)
            fully_shard(unit, **options)
        return module

    @property
    def _materialize_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def compile_module(self, module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
        """Compile each FSDP unit that ``setup_module`` made, then the root, in place (``nn.Module.compile``): the
        modules FSDP hooked stay the same objects, and the units' graphs sit between FSDP's all-gathers."""
        inner = module._orig_mod if type(module).__name__ == "OptimizedModule" else module
        for unit in [m for m in inner.modules() if m is not inner and isinstance(m, FSDPModule)]:
            unit.compile(**kwargs)
        module.compile(**kwargs)
        return module

    def _mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if self.mixed_precision is not None:
            return self.mixed_precision
        param_dtype = getattr(self.precision, "param_dtype", None)
        if param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    @torch.no_grad()
    def _copy_from_rank_zero(self, module: nn.Module, source: dict[str, torch.Tensor]) -> None:
        # Rank 0 scatters each parameter's slices and broadcasts each buffer: one full tensor in flight at a time.
        # A DTensor on a 2-D mesh, or on a sub-mesh without global rank 0 (tensor parallel x FSDP: the FSDP-only
        # layers of the other tensor-parallel ranks), gets the whole tensor by broadcast and keeps its own slice.
        for name, tensor in named_tensors(module).items():
            if isinstance(tensor, DTensor):
                full = source[name] if self.is_global_zero else torch.empty(tensor.shape, dtype=tensor.dtype)
                mesh = tensor.device_mesh
                full = full.to(mesh.device_type)
                scatter = mesh.ndim == 1 and mesh.size() == self.world_size
                if not scatter:
                    dist.broadcast(full, src=0)
                shard = distribute_tensor(full, mesh, tensor.placements, src_data_rank=0 if scatter else None)
                tensor.to_local().copy_(shard.to_local())
            else:
                full = source[name].to(tensor.device) if self.is_global_zero else tensor
                dist.broadcast(full, src=0)
                tensor.copy_(full)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the unsharded model at the sharded parameters (same groups, same order,
        same hyperparameters). An optimizer built after ``setup_module`` is already right; one over the meta
        parameters of a model not set up yet is refused, as in Lightning Fabric."""
        self._remap_optimizer(optimizer)
        refuse_meta_optimizer(optimizer)
        self._optimizers.add(optimizer)
        return optimizer

    def _remap_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        def sharded(param: torch.Tensor) -> torch.Tensor:
            old, new = self._sharded_params.get(id(param), (None, None))
            return new() if old is not None and old() is param and new() is not None else param

        groups = [[sharded(p) for p in group["params"]] for group in optimizer.param_groups]
        changed = any(
            a is not b for group, new in zip(optimizer.param_groups, groups) for a, b in zip(group["params"], new)
        )
        if not changed:
            return
        if optimizer.state:
            raise RuntimeError(
                "This optimizer already holds state (it has stepped) for the unsharded parameters, which FSDP "
                "replaced. Call `model = fabric.setup_module(model)`, then build the optimizer on model.parameters(), "
                "then `optimizer = fabric.setup_optimizers(optimizer)`."
            )
        for group, params in zip(optimizer.param_groups, groups):
            group["params"] = params

    # ------------------------------------------------------------------ the training step
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> ContextManager:
        if not enabled:
            return nullcontext()
        if not isinstance(module, FSDPModule):
            raise TypeError(
                f"no_backward_sync under FSDP expects the model returned by fabric.setup, got {type(module).__name__}."
            )
        return no_gradient_sync(module)

    def clip_by_total_norm(
        self, module: nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        """Clip by the norm over every shard on every rank, which is the norm of the unsharded gradients."""
        parameters = [p for p in module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], norm_type, foreach=None)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"The total norm of order {norm_type} of the gradients is {norm.item()}, so they cannot be clipped. "
                "Pass error_if_nonfinite=False to clip anyway."
            )
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, path: Any, state: Mapping[str, Any], meta: dict[str, Any], filter: Mapping[str, Callable] | None = None
    ) -> None:
        """Write ``state`` plus fabriclite's ``meta``: a folder of shards ("sharded") or one file ("full"), both
        replacing ``path`` atomically, so a crash mid-save leaves the previous checkpoint loadable."""
        sharded = self.state_dict_type == "sharded"
        checkpoint.save(path, checkpoint.to_checkpoint(state, meta, filter), self, sharded=sharded)

    def __repr__(self) -> str:
        return f"FSDPStrategy(device={self.root_device}, state_dict_type={self.state_dict_type!r})"
