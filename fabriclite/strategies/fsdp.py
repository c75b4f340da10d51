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
- ``init_module(empty_init=True)``: rank 0 builds the model on the CPU, the others on the meta device; each rank's
  slice then comes from rank 0, so the weights equal a model built on the CPU with the same seed, whatever order its
  init code draws in, buffers computed in ``__init__`` included.
- Checkpoints: ``state_dict_type`` picks the format in ``fabriclite.checkpoint``: "sharded", a folder every rank
  writes its shards into, or "full", one file from rank 0 in the form a one-process checkpoint has.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, ContextManager, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fabriclite import checkpoint
from fabriclite.checkpoint import CheckpointIO
from fabriclite.plugins.environments import ClusterEnvironment
from fabriclite.strategies.parallel import ParallelStrategy

# A set of layer classes, or a function telling whether a module is one unit.
ModulePolicy = Union[set, frozenset, list, tuple, type, Callable[[nn.Module], bool], None]
STATE_DICT_TYPES = ("sharded", "full")


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


def _sharding(sharding_strategy: Any, reshard_after_forward: bool, device_mesh: Any) -> tuple[bool, str]:
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
    if device_mesh is not None and not _is_device_mesh(device_mesh):
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


def _is_device_mesh(obj: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


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
        reshard_after_forward, self.mesh_kind = _sharding(sharding_strategy, reshard_after_forward, device_mesh)
        self._mesh_request = device_mesh  # the shape or mesh asked for; self.mesh is the mesh built
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not supported. Valid choices: 'sharded', 'full'.")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise TypeError(
                f"mixed_precision={mixed_precision!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy, or None "
                "to follow the Fabric precision."
            )
        self.wrap_policy = _module_policy(auto_wrap_policy, "auto_wrap_policy")
        self.checkpoint_policy = _module_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
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
        from torch.distributed.device_mesh import init_device_mesh

        if self.mesh_kind == "flat":
            self.mesh = init_device_mesh(self.root_device.type, (self.world_size,))
        elif _is_device_mesh(self._mesh_request):
            self.mesh = self._mesh_request
            if self.mesh.ndim != 2 or self.mesh.size() != self.world_size:
                raise ValueError(
                    f"device_mesh={self.mesh} must be 2-D (replicate, shard) and span all {self.world_size} processes."
                )
        else:
            shape = self._mesh_request or (
                (self.world_size, 1) if self.mesh_kind == "replicate" else (self.num_nodes, self.local_processes)
            )
            if shape[0] * shape[1] != self.world_size:
                raise ValueError(
                    f"device_mesh={shape} holds {shape[0] * shape[1]} processes, but the world size is "
                    f"{self.world_size}: (replicate, shard) must multiply to it."
                )
            self.mesh = init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))
        if self.precision is not None and self.precision.scaler is not None:
            self.precision.scaler = _rank_agreeing_scaler(self.precision.scaler)

    # ------------------------------------------------------------------ building and sharding
    def module_init_context(self, empty_init: bool | None = None) -> ContextManager:
        """With ``empty_init``, rank 0 builds the model on the CPU and the other ranks on the meta device (no memory);
        ``setup_module`` then gives every rank its slice of rank 0's weights, which therefore equal a model built on
        the CPU with the same seed, whatever its init code does."""
        return _rank_zero_init(self) if empty_init else nullcontext()

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
        rank_zero_meta = self.broadcast(self.is_global_zero and _has_meta(module))
        if rank_zero_meta:
            raise ValueError(
                "The model on rank 0 has parameters or buffers on the meta device, so there are no weights to shard. "
                "Build it inside `with fabric.init_module(empty_init=True):` (rank 0 then builds it on the CPU, the "
                "other ranks on the meta device), or load real weights into it before fabric.setup."
            )
        # Rank 0's full weights, taken before sharding replaces the parameters (aliases: fully_shard may move the
        # parameters' data to the device, these stay where the model was built).
        source = (
            {name: t.detach() for name, t in _named_tensors(module).items()}
            if self.is_global_zero and self.world_size > 1
            else {}
        )
        old_params = [(name, weakref.ref(p)) for name, p in module.named_parameters()]
        module = self._shard(module)
        if _has_meta(module):
            module.to_empty(device="cpu" if self.cpu_offload else self.root_device)
        if self.world_size > 1:
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
            from torch.distributed._composable import checkpoint

            for block in [m for m in module.modules() if m is not module and self.checkpoint_policy(m)]:
                checkpoint(block)
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
        for unit in reversed(units):  # innermost first: a unit's parameters must not be claimed by an outer one
            fully_shard(unit, **options)
        fully_shard(module, **options)
        return module

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
        for name, tensor in _named_tensors(module).items():
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
        same hyperparameters). An optimizer built after ``setup_module`` is already right."""
        self._remap_optimizer(optimizer)
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
        return _no_gradient_sync(module)

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


# ---------------------------------------------------------------------- choosing the units
def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks that repeat: children of an ``nn.ModuleList``/``nn.Sequential`` whose class (with parameters)
    appears there more than once, outermost only (a block's own layers are not searched).

    Usage: ``repeated_blocks(vit)`` -> the transformer blocks.
    """
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        repeated: set[type] = set()
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(c) for c in parent.children() if next(c.parameters(), None) is not None)
            repeated = {cls for cls, n in counts.items() if n > 1}
        for child in parent.children():
            if type(child) in repeated:
                blocks.append(child)
            else:
                visit(child)

    visit(module)
    return blocks


def _module_policy(policy: ModulePolicy, what: str) -> Callable[[nn.Module], bool] | None:
    if policy is None:
        return None
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = tuple(policy)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError(f"{what}={policy!r} must hold nn.Module subclasses, e.g. {{TransformerBlock}}.")
        return functools.partial(_instance_of, classes)  # picklable, for ddp_spawn's new processes
    if callable(policy):
        return policy
    raise TypeError(f"{what}={policy!r} must be a set of nn.Module classes or a function (module) -> bool.")


def _instance_of(classes: tuple[type, ...], module: nn.Module) -> bool:
    return isinstance(module, classes)


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in _named_tensors(module).values())


# ---------------------------------------------------------------------- empty init
class _ForceDevice(torch.overrides.TorchFunctionMode):
    """Creates every tensor on ``device``, overriding Fabric's ``torch.device`` context entered inside this one."""

    def __init__(self, device: str) -> None:
        super().__init__()
        from torch.utils._device import _device_constructors

        self.device = torch.device(device)
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.constructors:
            kwargs["device"] = self.device
        return func(*args, **kwargs)


@contextmanager
def _rank_zero_init(strategy: FSDPStrategy) -> Iterator[None]:
    if strategy.world_size > 1 and not dist.is_initialized():
        raise RuntimeError(
            "fabric.init_module(empty_init=True) under FSDP needs the processes running: call fabric.launch() first."
        )
    rng_before = torch.get_rng_state()
    with _ForceDevice("cpu" if strategy.is_global_zero else "meta"):
        yield
    if strategy.world_size > 1:
        # Only rank 0 drew its init from the random stream. Ranks that started from the same state continue from
        # where rank 0 ended, exactly as after an ordinary init on every rank.
        zero_before, zero_after = strategy.broadcast((rng_before, torch.get_rng_state()))
        if torch.equal(rng_before, zero_before):
            torch.set_rng_state(zero_after)


# ---------------------------------------------------------------------- the step: gradient sync and loss scaling
@contextmanager
def _no_gradient_sync(module: FSDPModule) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _rank_agreeing_scaler(scaler: torch.amp.GradScaler) -> torch.amp.GradScaler:
    """The same scaler (same state) whose ``unscale_`` takes the max of found-inf over all ranks, so an overflow in
    one rank's shard makes every rank skip the step and back off the scale together."""
    if isinstance(scaler, _RankAgreeing):
        return scaler
    cls = type(f"RankAgreeing{type(scaler).__name__}", (_RankAgreeing, type(scaler)), {})
    agreeing = cls.__new__(cls)
    agreeing.__dict__.update(scaler.__dict__)
    return agreeing


class _RankAgreeing:
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        super().unscale_(optimizer)  # type: ignore[misc]
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]  # type: ignore[attr-defined]
        if not found or not dist.is_initialized():
            return
        # One all-reduce per step, on a tensor every rank has (recent torch reduces DTensor found-infs itself too).
        any_inf = torch.stack([f.to(self._scale.device) for f in found.values()]).amax()  # type: ignore[attr-defined]
        dist.all_reduce(any_inf, op=dist.ReduceOp.MAX)
        for value in found.values():
            value.copy_(any_inf)
