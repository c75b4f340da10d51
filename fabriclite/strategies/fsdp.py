"""FSDP2: each rank holds a slice of every parameter, gradient and optimizer state, and gathers a block's full
weights only while that block runs (``torch.distributed.fsdp.fully_shard``; parameters become DTensors).

Runs on CPU with gloo and on CUDA with NCCL, also on one process (a group of one). The choices made here:

- Units: by default each block that repeats in an ``nn.ModuleList``/``nn.Sequential`` (transformer blocks) is one
  ``fully_shard`` unit, then the root takes the rest; an ``auto_wrap_policy`` in any of FSDP1's forms picks the
  modules FSDP1 would wrap instead. After sharding, every rank takes its slice of rank 0's weights, as DDP
  broadcasts rank 0's.
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
- ``fsdp_overlap_step_with_backward`` (Lightning's path): the optimizers step inside the backward, from the
  post-accumulate-grad hooks FSDP2 runs once it has reduced a parameter's gradient.

The mesh is built in ``mesh.py``; the wrap policies that choose the units and the checkpointed modules in
``policies.py``; what FSDP shares with ``ModelParallelStrategy`` (its sibling, as in Lightning: the empty init, the
setup around sharding, skipping gradient sync) is in ``sharding.py``; the loss scaler that agrees across ranks is
the precision's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from datetime import timedelta
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from fabriclite import checkpoint
from fabriclite._blocks import repeated_blocks  # also importable from here, where it lived first
from fabriclite.checkpoint import CheckpointIO
from fabriclite.choices import STATE_DICT_TYPES
from fabriclite.plugins.environments import ClusterEnvironment
from fabriclite.rank_zero import rank_zero_warn
from fabriclite.strategies.mesh import SHARDING_STRATEGIES, sharding_choice, sharding_mesh
from fabriclite.strategies.parallel import ParallelStrategy
from fabriclite.strategies.policies import ModulePolicy, module_policy
from fabriclite.strategies.sharding import (
    ShardedSetup,
    compile_units,
    has_meta,
    materialize,
    meta_init,
    no_gradient_sync,
)
from fabriclite._versions import checkpoint_activations


# FSDP1's keyword arguments (FullyShardedDataParallel's, which Lightning's FSDPStrategy passes on) that FSDP2 has no
# setting for: accepted, with one warning saying why nothing changes.
FSDP1_IGNORED = {
    "limit_all_gathers": "FSDP2 bounds the all-gathers in flight itself",
    "use_orig_params": "FSDP2 always keeps the original parameters (as DTensors)",
    "forward_prefetch": "FSDP2 prefetches the next unit's all-gather itself",
    "backward_prefetch": "FSDP2 prefetches the next unit's all-gather itself",
    "sync_module_states": "fabriclite always gives every rank its slice of rank 0's weights in setup",
}
# ...and those with no FSDP2 meaning here: refused, saying what to use instead.
FSDP1_REFUSED = {
    "process_group": "the processes come from Fabric(devices=..., num_nodes=...); for hybrid sharding pass "
    "device_mesh=(replicate, shard) or a 2-D DeviceMesh",
    "device_id": "Fabric(devices=...) places each process on its device",
    "param_init_fn": "build the model under `with fabric.init_module(empty_init=True):`; each module's "
    "reset_parameters() then fills its shard in setup",
    "ignored_modules": "FSDPStrategy shards every parameter; to leave some whole, shard by hand in a "
    "ModelParallelStrategy(parallelize_fn) that calls fully_shard on the modules you choose",
    "ignored_states": "FSDPStrategy shards every parameter; to leave some whole, shard by hand in a "
    "ModelParallelStrategy(parallelize_fn) that calls fully_shard on the modules you choose",
}


class FSDPStrategy(ParallelStrategy):
    """Fully sharded data parallel with FSDP2 on gloo (CPU) or nccl (CUDA).

    - ``auto_wrap_policy``: the modules that become sharding units, in any form Lightning and torch take (layer
      classes, a ``module -> bool`` function, torch's FSDP1 policy functions and their ``functools.partial``s,
      ``ModuleWrapPolicy``/``CustomPolicy``; ``policies.py``), each meaning what it means to FSDP1; by default the
      blocks that repeat in an ``nn.ModuleList``/``nn.Sequential``.
    - ``activation_checkpointing_policy``: the modules whose activations are recomputed in backward, in the same
      forms (``activation_checkpointing``, Lightning's older name, is the same).
    - ``mixed_precision``: an FSDP2 ``MixedPrecisionPolicy`` (or FSDP1's ``MixedPrecision``, translated); by
      default from the Fabric precision: its ``param_dtype`` ("bf16-mixed": bf16, "16-mixed": fp16) for the
      gathered parameters, fp32 gradient reduction.
    - ``cpu_offload``: keep the parameter, gradient and optimizer shards in CPU memory (True, an FSDP2
      ``CPUOffloadPolicy`` or FSDP1's ``CPUOffload(offload_params=True)``).
    - ``state_dict_type``: "sharded" (a directory, every rank writes its shards) or "full" (one file from rank 0).
    - ``sharding_strategy``: Lightning's FSDP1 spelling (a string or ``torch.distributed.fsdp.ShardingStrategy``):
      "FULL_SHARD" frees the gathered parameters after forward, "SHARD_GRAD_OP" keeps them until backward
      (``reshard_after_forward=False``: more memory, one all-gather less); "HYBRID_SHARD" shards within groups of
      ranks and replicates across them (HSDP: the all-gathers stay inside a node), on ``device_mesh=(replicate,
      shard)`` or a 2-D ``DeviceMesh``, by default (num_nodes, devices per node); "NO_SHARD" replicates everything.
    - Other FSDP1 keyword arguments Lightning passes on to FSDP: those FSDP2 has no setting for
      (``FSDP1_IGNORED``: ``limit_all_gathers``, ``use_orig_params``, ...) are accepted with one warning; those
      with no meaning here (``FSDP1_REFUSED``) raise, saying what to use. docs/strategies.md has the table.

    Usage: ``Fabric(devices=2, strategy=FSDPStrategy(auto_wrap_policy={Block}), precision="bf16-mixed")``.
    """

    def __init__(
        self,
        auto_wrap_policy: ModulePolicy = None,
        activation_checkpointing_policy: ModulePolicy = None,
        mixed_precision: Any = None,
        cpu_offload: Any = False,
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
        activation_checkpointing: ModulePolicy = None,
        **fsdp1_kwargs: Any,
    ) -> None:
        super().__init__(
            process_group_backend, timeout, start_method, checkpoint_io, stall_timeout, cluster_environment
        )
        if activation_checkpointing is not None:
            if activation_checkpointing_policy is not None:
                raise ValueError(
                    "activation_checkpointing and activation_checkpointing_policy were both given; pass "
                    "activation_checkpointing_policy only (activation_checkpointing is Lightning's older name for it)."
                )
            activation_checkpointing_policy = activation_checkpointing
        ignored = _check_fsdp1_kwargs(fsdp1_kwargs)
        reshard_after_forward, self.mesh_kind = sharding_choice(sharding_strategy, reshard_after_forward, device_mesh)
        self._mesh_request = device_mesh  # the shape or mesh asked for; self.mesh is the mesh built
        if state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(f"state_dict_type={state_dict_type!r} is not supported. Valid choices: 'sharded', 'full'.")
        self.wrap_policy = module_policy(auto_wrap_policy, "auto_wrap_policy")
        self.checkpoint_policy = module_policy(activation_checkpointing_policy, "activation_checkpointing_policy")
        self.mixed_precision, ignored_precision = _mixed_precision_policy(mixed_precision)
        self.cpu_offload, self._offload_policy = _offload_policy(cpu_offload)
        self.reshard_after_forward = reshard_after_forward
        self.state_dict_type = state_dict_type
        ignored += ignored_precision
        if ignored:
            rank_zero_warn(
                f"FSDPStrategy runs FSDP2, which has no setting for {', '.join(name for name, _ in ignored)}, so "
                f"{'it is' if len(ignored) == 1 else 'they are'} ignored: "
                + "; ".join(f"{name}: {why}" for name, why in ignored)
                + f". Leave {'it' if len(ignored) == 1 else 'them'} out to silence this warning."
            )

    def _process_state(self) -> dict[str, Any]:
        return {**super()._process_state(), "mesh": None, "_sharding": ShardedSetup()}

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
        return self._sharding.setup_module(self, module, self._shard, self._materialize_device)

    def _shard(self, module: nn.Module) -> nn.Module:
        # Activation checkpointing, then one fully_shard per unit (innermost first), then the root.
        checkpointed = {}
        if self.checkpoint_policy is not None and _CHECKPOINTING.get():
            checkpointed = self.checkpoint_policy.select(module)
        units = (
            dict.fromkeys(repeated_blocks(module), {}) if self.wrap_policy is None else self.wrap_policy.select(module)
        )
        for block, overrides in checkpointed.items():
            checkpoint_activations(block, **_checkpoint_options(overrides, self.checkpoint_policy))
        options = {
            "mesh": self.mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self._mixed_precision_policy(),
            "offload_policy": self._offload_policy
            or (CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda") if self.cpu_offload else OffloadPolicy()),
        }
        unit_options = {unit: _unit_options(o, self.wrap_policy, self.mesh_kind) for unit, o in units.items() if o}
        ignored = sorted({key for overrides in units.values() for key in overrides if key in FSDP1_IGNORED})
        if ignored:
            rank_zero_warn(
                f"auto_wrap_policy returned {', '.join(ignored)} for some units; FSDP2 has no such setting, so "
                "they are ignored (docs/strategies.md, Lightning's FSDP1 arguments, says why)."
            )
        # Innermost first: a unit's parameters must not be claimed by an outer one. After an empty init, each unit
        # gets storage just before it is sharded, so one unit at a time is ever whole.
        for unit in [*units, module]:
            if has_meta(unit):
                self._sharding.uninitialized += materialize(unit, self._materialize_device)
            fully_shard(unit, **{**options, **unit_options.get(unit, {})})
        return module

    @property
    def _materialize_device(self) -> torch.device:
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def compile_module(self, module: nn.Module, kwargs: dict[str, Any]) -> nn.Module:
        """Compile each FSDP unit that ``setup_module`` made, then the root, in place."""
        return compile_units(module, kwargs)

    def _mixed_precision_policy(self) -> MixedPrecisionPolicy:
        if self.mixed_precision is not None:
            return self.mixed_precision
        param_dtype = getattr(self.precision, "param_dtype", None)
        if param_dtype is None:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Point an optimizer built on the unsharded model at the sharded parameters (same groups, same order,
        same hyperparameters). An optimizer built after ``setup_module`` is already right; one over the meta
        parameters of a model not set up yet is refused, as in Lightning Fabric."""
        return self._sharding.setup_optimizer(optimizer)

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


def _check_fsdp1_kwargs(kwargs: dict[str, Any]) -> list[tuple[str, str]]:
    """The FSDP1 arguments among ``kwargs`` that are ignored, with why; raise for one refused or unknown."""
    for name in kwargs:
        if name in FSDP1_REFUSED:
            raise ValueError(
                f"FSDPStrategy({name}=...) is an FSDP1 argument FSDP2 has no place for: {FSDP1_REFUSED[name]}."
            )
        if name not in FSDP1_IGNORED:
            raise TypeError(
                f"FSDPStrategy.__init__() got an unexpected keyword argument {name!r}. Besides its own, it takes "
                f"these FSDP1 arguments, which FSDP2 has no setting for: {', '.join(FSDP1_IGNORED)}."
            )
    return [(name, FSDP1_IGNORED[name]) for name in kwargs]


def _unit_options(overrides: dict[str, Any], policy: Any, mesh_kind: str) -> dict[str, Any]:
    """``fully_shard``'s keyword arguments for one unit, from those a ``CustomPolicy`` returned for it: FSDP2's own
    ``reshard_after_forward`` and ``mp_policy``, or FSDP1's ``sharding_strategy`` (one that keeps the strategy's
    mesh) and ``mixed_precision`` (None: this unit in full precision). ``FSDP1_IGNORED`` keys are left out."""
    options: dict[str, Any] = {}
    for key, value in overrides.items():
        if key == "reshard_after_forward":
            options[key] = value
        elif key in ("mp_policy", "mixed_precision"):
            options["mp_policy"] = MixedPrecisionPolicy() if value is None else _mixed_precision_policy(value)[0]
        elif key == "sharding_strategy":
            resharding, kind = SHARDING_STRATEGIES.get(getattr(value, "name", value), (None, None))
            if kind != mesh_kind:
                same = [name for name, (_, k) in SHARDING_STRATEGIES.items() if k == mesh_kind]
                raise ValueError(
                    f"{policy.what}={policy.policy!r} returned sharding_strategy={value!r} for a unit, but every unit "
                    f"shards over the strategy's one mesh: a unit may take {' or '.join(map(repr, same))} (whether "
                    "it frees its gathered weights after forward). Set the mesh on FSDPStrategy(sharding_strategy=...)."
                )
            options["reshard_after_forward"] = resharding
        elif key not in FSDP1_IGNORED:
            raise ValueError(
                f"{policy.what}={policy.policy!r} returned {key}={value!r} for a unit, which FSDP2 cannot set per "
                "unit. A CustomPolicy's function may return True, False, or a dict of: reshard_after_forward, "
                "mp_policy, sharding_strategy, mixed_precision (and FSDP1 settings FSDP2 ignores: "
                f"{', '.join(FSDP1_IGNORED)}). cpu_offload applies to the whole model: set it on FSDPStrategy."
            )
    return options


# False while ``fabriclite plan`` traces a script without the activation checkpointing it sets.
_CHECKPOINTING: ContextVar[bool] = ContextVar("activation_checkpointing", default=True)


@contextmanager
def without_activation_checkpointing() -> Iterator[None]:
    """FSDP strategies set up in this block checkpoint no activations, whatever their policy: ``fabriclite plan``
    shows the activations a script's ``activation_checkpointing_policy`` saves. Usage: ``with
    without_activation_checkpointing(): runpy.run_path(script)``."""
    token = _CHECKPOINTING.set(False)
    try:
        yield
    finally:
        _CHECKPOINTING.reset(token)


# The composable checkpoint's own options, which a CustomPolicy for activation_checkpointing_policy may return
# (FSDP1's checkpoint_wrapper passed them on to torch.utils.checkpoint the same way).
CHECKPOINT_OPTIONS = ("preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop", "use_reentrant")


def _checkpoint_options(overrides: dict[str, Any], policy: Any) -> dict[str, Any]:
    """The options of one module's activation checkpointing, from those a ``CustomPolicy`` returned for it."""
    options = dict(overrides)
    implementation = options.pop("checkpoint_impl", None)  # FSDP1's checkpoint_wrapper: only the non-reentrant one
    if getattr(implementation, "name", "NO_REENTRANT") != "NO_REENTRANT" or options.get("use_reentrant"):
        raise ValueError(
            f"{policy.what}={policy.policy!r} asked for reentrant checkpointing, which does not compose with FSDP2. "
            "Leave checkpoint_impl and use_reentrant out: fabriclite checkpoints without reentrancy."
        )
    unknown = [key for key in options if key not in CHECKPOINT_OPTIONS]
    if unknown:
        raise ValueError(
            f"{policy.what}={policy.policy!r} returned {', '.join(unknown)} for a module; a CustomPolicy's function "
            f"may return True, False, or a dict of: {', '.join(CHECKPOINT_OPTIONS)} (torch.utils.checkpoint's)."
        )
    return options


def _mixed_precision_policy(value: Any) -> tuple[MixedPrecisionPolicy | None, list[tuple[str, str]]]:
    """An FSDP2 ``MixedPrecisionPolicy`` for ``mixed_precision`` (FSDP1's ``MixedPrecision`` translated), and the
    FSDP1 settings FSDP2 has no place for."""
    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value, []
    from torch.distributed.fsdp import MixedPrecision

    if not isinstance(value, MixedPrecision):
        raise TypeError(
            f"mixed_precision={value!r} must be a torch.distributed.fsdp.MixedPrecisionPolicy (or FSDP1's "
            "MixedPrecision), or None to follow the Fabric precision."
        )
    ignored = []
    if value.buffer_dtype is not None:
        ignored.append(("mixed_precision.buffer_dtype", "FSDP2 leaves buffers in their own dtype"))
    if value.keep_low_precision_grads:
        ignored.append(("mixed_precision.keep_low_precision_grads", "FSDP2 keeps gradients in the parameters' dtype"))
    cast = value.cast_forward_inputs or value.cast_root_forward_inputs
    policy = MixedPrecisionPolicy(
        param_dtype=value.param_dtype, reduce_dtype=value.reduce_dtype, cast_forward_inputs=cast
    )
    return policy, ignored


def _offload_policy(value: Any) -> tuple[bool, CPUOffloadPolicy | None]:
    """Whether to offload to the CPU for ``cpu_offload`` (a bool, an FSDP2 ``CPUOffloadPolicy`` or FSDP1's
    ``CPUOffload``), and the user's own policy, if given."""
    if isinstance(value, bool) or value is None:
        return bool(value), None
    if isinstance(value, CPUOffloadPolicy):
        return True, value
    from torch.distributed.fsdp import CPUOffload

    if isinstance(value, CPUOffload):
        return bool(value.offload_params), None
    raise TypeError(
        f"cpu_offload={value!r} must be a bool, a torch.distributed.fsdp.CPUOffloadPolicy or FSDP1's CPUOffload."
    )


@contextmanager
def fsdp_overlap_step_with_backward(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer], fabric_module: nn.Module
) -> Iterator[None]:
    """Step each optimizer inside the backward, as soon as FSDP2 has reduced the gradients of all its parameters,
    then free those gradients (``zero_grad``): the gradients of the whole model never exist at once.

    FSDP2 runs a parameter's post-accumulate-grad hooks right after it reduce-scatters the parameter's gradient
    into its shard (torch >= 2.5), so the step overlaps the backward of the layers still to come. Give each
    parameter (or each layer) its own optimizer, as Lightning's recipe does, or nothing is freed early. An optimizer
    a backward gave no gradient to (an unused layer, or inside ``fabric.no_backward_sync``) steps when the block
    ends, so every optimizer steps once per backward; under ``no_backward_sync`` FSDP2 keeps the gradients to
    itself until the backward that syncs, whose hooks then step with the accumulated sum.

    Refused with a loss scaler (fp16): the scaler must see every gradient for an inf before any step may run. The
    gradients are gone once the block ends, so there is no ``clip_gradients`` either.

    Usage: ``with fsdp_overlap_step_with_backward(optimizers, model): fabric.backward(loss)`` (no ``step()`` after).
    """
    from torch.distributed.fsdp import FSDPModule

    optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    if not any(isinstance(m, FSDPModule) for m in fabric_module.modules()):
        raise TypeError(
            "fsdp_overlap_step_with_backward(optimizers, model) takes the model fabric.setup returned under "
            f"FSDPStrategy; got {type(fabric_module).__name__} without FSDP units. Without FSDP, step after backward."
        )
    precision = getattr(fabric_module, "_precision", None)
    if getattr(precision, "scaler", None) is not None:
        raise RuntimeError(
            f"fsdp_overlap_step_with_backward cannot step inside the backward with precision {precision.name!r}: its "
            "loss scaler must find an inf in any gradient before any optimizer steps. Use precision='bf16-mixed' "
            "(no scaler), or call fabric.backward(loss) and then optimizer.step() as usual."
        )
    params = {id(p) for p in fabric_module.parameters()}
    owner: dict[int, torch.optim.Optimizer] = {}  # id(parameter) -> the optimizer that steps it
    pending: dict[int, set[int]] = {}  # id(optimizer) -> its parameters whose gradient this backward has not given
    for optimizer in optimizers:
        mine = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        if not mine <= params or mine & owner.keys():
            raise ValueError(
                f"{type(optimizer).__name__} holds parameters that are not the sharded model's, or that another of "
                "the optimizers holds too. Set the optimizers up with the model (fabric.setup(model, *optimizers) "
                "or fabric.setup_optimizers after fabric.setup_module), each over parameters of its own."
            )
        owner.update(dict.fromkeys(mine, optimizer))
        pending[id(optimizer)] = mine
    lock = threading.Lock()  # on CUDA the autograd engine runs the hooks on threads of its own

    def step(optimizer: torch.optim.Optimizer) -> None:
        del pending[id(optimizer)]
        optimizer.step()
        optimizer.zero_grad()

    def ready(param: torch.Tensor) -> None:
        with lock:
            optimizer = owner[id(param)]
            left = pending.get(id(optimizer))
            if left is not None:
                left.discard(id(param))
                if not left:
                    step(optimizer)

    handles = [p.register_post_accumulate_grad_hook(ready) for p in fabric_module.parameters() if id(p) in owner]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    for optimizer in optimizers:
        if id(optimizer) in pending:
            step(optimizer)
