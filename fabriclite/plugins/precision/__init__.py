"""Numeric precision as a small set of hooks: convert the module, run the forward in a context, cast inputs and
outputs, scale the loss on backward, step through the scaler. One class per family of settings.

The hooks are looked up once, in ``Fabric.setup``; the per-step path calls only the ones that do something.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from fabriclite import accelerators
from fabriclite._collections import apply_to_collection
from fabriclite.rank_zero import rank_zero_info, rank_zero_warn


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Make ``dtype`` the default floating dtype inside the block (for building modules in true half/double)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    if type(data) is torch.Tensor:  # the common case, one output tensor: no collection walk
        return _cast_tensor(data, dtype)
    return apply_to_collection(data, torch.Tensor, _cast_tensor, dtype)


def _cast_tensor(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Any tensor, subclasses too (a DTensor, a fake tensor): the collection walk hands those over as they are.
    if not tensor.is_floating_point() or tensor.dtype == dtype:
        return tensor
    return tensor.float() if dtype is torch.float32 else tensor.to(dtype)  # .float() parses no arguments


def _cast_inputs(data: Any, dtype: torch.dtype) -> Any:
    """``_cast_floating`` for the ``(args, kwargs)`` a forward receives; the usual call, tensors as the only
    arguments, casts them without walking the collection (about 10 microseconds a step)."""
    if type(data) is tuple and len(data) == 2 and type(data[0]) is tuple and data[1] == {}:
        args = data[0]
        if all(type(arg) is torch.Tensor for arg in args):
            return tuple(_cast_floating(arg, dtype) for arg in args), {}
    return _cast_floating(data, dtype)


MIN_SCALE = 2.0**-16
MAX_SKIPPED_STEPS = 50


class _FabricGradScaler(torch.amp.GradScaler):
    """GradScaler whose scale never drops below ``min_scale``, and that counts the steps it skipped in a row.

    A plain GradScaler halves the scale at every non-finite step: after about 170 in a row it is exactly 0.0, and
    the next finite step writes NaN into every weight (0 * inf). Here the scale stops at the floor, and
    ``skipped_in_a_row`` tells the precision when to stop the run with an explanation instead.
    """

    def __init__(self, device: str, min_scale: float) -> None:
        super().__init__(device)
        self.min_scale = min_scale
        self.skipped_in_a_row = 0

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # The same test GradScaler makes right after (it synchronizes there anyway): any inf/nan found skips.
        skipped = bool(sum(v.item() for v in optimizer_state["found_inf_per_device"].values()))
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        super().update(new_scale)
        if self._enabled and self._scale is not None:
            self._scale.clamp_(min=self.min_scale)  # on the device: no synchronization


class _HalfGradScaler(_FabricGradScaler):
    """GradScaler that also unscales fp16 gradients, which "16-true" has (all parameters are fp16).

    PyTorch refuses that by default because unscaled fp16 gradients may underflow; with true half precision
    there is no fp32 copy to unscale into, and scaling still keeps small gradients from flushing to zero.
    """

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def _unscaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` already ran since the last ``update`` (``fabric.clip_gradients``)."""
    from torch.amp.grad_scaler import OptState

    return scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.UNSCALED


def _agree_on_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """After ``scaler.unscale_(optimizer)``: make every rank's found-inf the max over all ranks, so an overflow in one
    rank's shard makes every rank skip the step and back off the scale together."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    if not found or not dist.is_initialized():
        return
    # One all-reduce per step, on a tensor every rank has (recent torch reduces DTensor found-infs itself too).
    any_inf = torch.stack([f.to(scaler._scale.device) for f in found.values()]).amax()
    dist.all_reduce(any_inf, op=dist.ReduceOp.MAX)
    for value in found.values():
        value.copy_(any_inf)


def _refuse_unless_fp16_unscaling(scaler: torch.amp.GradScaler, name: str) -> None:
    """Refuse a scaler for true fp16 weights (whose gradients are fp16) that would refuse to unscale them."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if isinstance(scaler, (ShardedGradScaler, _HalfGradScaler)) or not scaler.is_enabled():
        return
    raise ValueError(
        f"precision={name!r} with scaler={type(scaler).__name__}(...): the weights and so the gradients are fp16, "
        "which torch.amp.GradScaler refuses to unscale (it would fail at the first step with 'Attempting to unscale "
        "FP16 gradients'). Pass a torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, which unscales fp16 "
        "gradients (it needs the processes of a multi-process strategy), or leave scaler out for fabriclite's own."
    )


class Precision:
    """Full fp32 ("32-true"): every hook does nothing. The base of the others.

    Usage: ``Precision().forward_context()``.
    """

    name = "32-true"
    # True when forward needs no context and no casts, so the wrapped module can call the module directly.
    passthrough = True
    scaler: torch.amp.GradScaler | None = None
    # The dtype parameters are cast to for the forward while fp32 copies are kept (mixed precision), else None.
    # Sharding strategies cast their gathered parameters to it.
    param_dtype: torch.dtype | None = None
    # Whether the loss scaler's found-inf must be the max over all ranks (set by ``agree_across_ranks``).
    ranks_agree = False

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module with its weights in this precision's dtype (true precisions); unchanged otherwise."""
        return module

    def forward_context(self) -> ContextManager:
        """The context the forward runs in (``torch.autocast`` for mixed precision)."""
        return nullcontext()

    def module_init_context(self) -> ContextManager:
        """The context modules are built in (the default dtype of a true precision)."""
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        """The forward's inputs, floating tensors cast to the weights' dtype where that differs."""
        return data

    def convert_output(self, data: Any) -> Any:
        """The forward's outputs as the caller gets them (floating tensors back in fp32 or the default dtype)."""
        return data

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``tensor.backward()``, scaled first when the precision has a loss scaler."""
        tensor.backward(*args, **kwargs)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step()``, through the loss scaler (which skips a step with inf/NaN gradients) if any."""
        return optimizer.step(**kwargs)

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale, if there is one (before clipping or inspecting them)."""

    def place(self, device: torch.device) -> None:
        """Learn the device the Fabric runs on (needed by the precisions that build a loss scaler)."""

    def replaced_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters ``convert_module`` replaced by new ones, by name, as the user's optimizer still holds them:
        a sharding strategy points that optimizer at the new ones' shards. Usage: ``precision.replaced_parameters()``."""
        return {}

    def note_not_compiled(self) -> None:
        """``fabric.setup`` calls this when the model is not compiled: a precision that needs compile for speed
        (fp8) warns."""

    def agree_across_ranks(self) -> None:
        """Make every rank skip or take each step together. Under sharding each rank finds inf/NaN in its own
        gradient shards only, so the loss scaler (if any; the same object, the user's if given) decides on the max
        over all ranks. Sharding strategies call this once the processes run. Usage: ``precision.agree_across_ranks()``."""
        self.ranks_agree = True

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the precision: the loss scaler's state, if there is one."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class _ScaledPrecision(Precision):
    """Shared by the precisions that may carry a ``GradScaler`` (fp16 needs one, bf16 does not): ``DTYPES`` maps
    the subclass's names to their dtypes; fp16 gets a ``SCALER`` whose scale stops at ``min_scale``."""

    DTYPES: dict[str, torch.dtype] = {}
    SCALER: type[_FabricGradScaler] = _FabricGradScaler

    def __init__(
        self,
        name: str,
        device: torch.device | str | None = None,
        min_scale: float = MIN_SCALE,
        max_skipped_steps: int | None = MAX_SKIPPED_STEPS,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self._set_limits(min_scale, max_skipped_steps)
        if name not in self.DTYPES:
            raise ValueError(
                f"{type(self).__name__}(precision={name!r}) is not supported. Valid: {', '.join(map(repr, self.DTYPES))}."
            )
        self.name = name
        self.dtype = self.DTYPES[name]
        if scaler is not None and self.dtype != torch.float16:
            raise ValueError(f"A loss scaler is for fp16; precision={name!r} does not use one. Leave scaler out.")
        if scaler is not None and issubclass(self.SCALER, _HalfGradScaler):
            _refuse_unless_fp16_unscaling(scaler, name)
        self.min_scale = min_scale
        self.scaler = scaler
        self.device_type: str | None = None
        if device is not None:
            self.place(torch.device(device))

    def place(self, device: torch.device) -> None:
        """Run on ``device``: a plugin built without one (as Lightning's are) learns it from the Fabric."""
        if self.device_type is not None:
            return
        self.device_type = device.type
        if self.scaler is None and self.dtype == torch.float16:
            self.scaler = self.SCALER(device.type, self.min_scale)

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    max_skipped_steps: int | None = MAX_SKIPPED_STEPS

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        if self.ranks_agree and not _unscaled(self.scaler, optimizer):
            self.unscale_gradients(optimizer)  # so the step below decides on what every rank found
        # The scaler skips the step when it finds inf/nan gradients, then backs off (to its floor) or grows the scale.
        result = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        skipped = getattr(self.scaler, "skipped_in_a_row", 0)  # a scaler of the user's may not count
        if self.max_skipped_steps is not None and skipped >= self.max_skipped_steps:
            raise FloatingPointError(
                f"The loss or the gradients have been inf or NaN for {skipped} optimizer steps in a row; the fp16 loss "
                f"scaler skipped each one and lowered the scale to {self.scaler.get_scale():.3g}. Usual causes: a "
                "learning rate too high, activations that overflow fp16 (try precision='bf16-mixed'), inf or NaN in "
                "the inputs or the loss itself, or no gradient clipping. To allow longer runs of skipped steps, pass "
                f"max_skipped_steps (now {self.max_skipped_steps}; None never stops) to the precision plugin."
            )
        return result

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        if self.ranks_agree:
            _agree_on_found_inf(self.scaler, optimizer)

    def agree_across_ranks(self) -> None:
        """As ``Precision.agree_across_ranks``: this precision's scaler decides on the max over all ranks."""
        super().agree_across_ranks()
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # FSDP's ShardedGradScaler all-reduces its found-inf itself, in unscale_.
        self.ranks_agree = not isinstance(self.scaler, ShardedGradScaler)

    def state_dict(self) -> dict[str, Any]:
        if self.scaler is None:
            return {}
        return {"scaler": self.scaler.state_dict(), "skipped_in_a_row": getattr(self.scaler, "skipped_in_a_row", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
            if hasattr(self.scaler, "skipped_in_a_row"):
                self.scaler.skipped_in_a_row = state.get("skipped_in_a_row", 0)

    def _set_limits(self, min_scale: float, max_skipped_steps: int | None) -> None:
        if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)) or not min_scale > 0:
            raise ValueError(f"min_scale={min_scale!r} must be a number > 0 (the default is 2**-16).")
        if max_skipped_steps is not None and (
            isinstance(max_skipped_steps, bool) or not isinstance(max_skipped_steps, int) or max_skipped_steps < 1
        ):
            raise ValueError(f"max_skipped_steps={max_skipped_steps!r} must be an int >= 1, or None to never stop.")
        self.max_skipped_steps = max_skipped_steps


class MixedPrecision(_ScaledPrecision):
    """ "bf16-mixed" and "16-mixed": fp32 weights, floating inputs cast to the autocast dtype (as Lightning does,
    so a float64 batch from NumPy trains), forward under ``torch.autocast``, floating outputs back in fp32.

    With fp16 the loss is scaled; the scale never drops below ``min_scale``, and ``max_skipped_steps`` non-finite
    steps in a row raise ``FloatingPointError`` explaining the usual causes (None: never).
    Usage: ``MixedPrecision("bf16-mixed", torch.device("cpu"))``.
    """

    passthrough = False
    DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}

    @property
    def param_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.dtype

    def forward_context(self) -> ContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_inputs(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        # A loss computed outside the forward is then fp32, as Lightning does.
        return _cast_floating(data, torch.float32)


class TruePrecision(_ScaledPrecision):
    """ "64-true", "bf16-true" and "16-true": the weights themselves in that dtype; inputs cast to it.

    "16-true" also scales the loss (Lightning Fabric does not), because fp16 gradients underflow without it;
    ``min_scale`` and ``max_skipped_steps`` work as in ``MixedPrecision``.
    Usage: ``TruePrecision("bf16-true", torch.device("cpu"))``.
    """

    passthrough = False
    DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}
    SCALER = _HalfGradScaler

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        # Floating parameters and buffers only: ``module.to(dtype)`` would also turn complex buffers (RoPE tables,
        # spectral layers) real, dropping their imaginary part with only a warning.
        dtype = self.dtype
        return module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)

    def forward_context(self) -> ContextManager:
        return default_dtype(self.dtype)

    def module_init_context(self) -> ContextManager:
        return default_dtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_inputs(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())


def select_precision(name: str, device: torch.device) -> Precision:
    """Build the precision object for a canonical precision name on ``device``.

    Usage: ``select_precision("bf16-mixed", torch.device("cpu"))``.
    """
    if name == "32-true":
        return Precision()
    if "bf16" in name and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision={name!r} needs bfloat16, which {torch.cuda.get_device_name(device)} does not support. "
            "Use precision='16-mixed' (fp16 with loss scaling) instead."
        )
    if name == "16-mixed" and device.type == "cpu":
        # As Lightning Fabric does (its phrase, which code filtering the warning matches): CPUs emulate fp16
        # autocast. A plugin, MixedPrecision("16-mixed", "cpu"), still gets fp16.
        rank_zero_warn(
            "You passed `Fabric(accelerator='cpu', precision='16-mixed')` but AMP with fp16 is not supported on CPU. "
            "Using `precision='bf16-mixed'` instead: CPUs emulate fp16 autocast (a step measured about 70x slower). "
            "Pass precision='bf16-mixed' to silence this, or plugins=[MixedPrecision('16-mixed', 'cpu')] to keep fp16.",
            stacklevel=6,  # the Fabric(...) line, through fabriclite.plugins.select_precision
        )
        name = "bf16-mixed"
    if "bf16" in name and device.type == "cpu" and not accelerators.cpu_has_native_bf16():
        rank_zero_warn(
            f"precision={name!r} is emulated on this CPU, which has no native bfloat16 (AVX-512 BF16, AMX or Arm's "
            "BF16): a step takes about 3x as long as in fp32 (the README's demo on an AVX2 CPU: 43 s against 13.6 s, "
            "and no better accuracy). Pass precision='32-true' on this machine.",
            stacklevel=6,  # the Fabric(...) line, through fabriclite.plugins.select_precision
        )
    if name.endswith("-mixed"):
        # Lightning Fabric's words, for log readers and tests that look for them.
        amp = "16-bit" if name == "16-mixed" else "bfloat16"
        rank_zero_info(f"Using {amp} Automatic Mixed Precision (AMP)", stacklevel=6)
        return MixedPrecision(name, device)
    return TruePrecision(name, device)


class HalfPrecision(TruePrecision):
    """Lightning's name for "bf16-true" and "16-true" (the default): weights and inputs in that dtype.

    Usage: ``Fabric(plugins=[HalfPrecision("bf16-true")])``.
    """

    DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}

    def __init__(self, precision: str = "16-true", device: torch.device | str | None = None, **limits: Any) -> None:
        super().__init__(precision, device, **limits)


class DoublePrecision(TruePrecision):
    """Lightning's name for "64-true": weights and inputs in float64.

    Usage: ``Fabric(plugins=[DoublePrecision()])``.
    """

    DTYPES = {"64-true": torch.float64}

    def __init__(self) -> None:
        super().__init__("64-true")


def FSDPPrecision(  # noqa: N802 - Lightning's class name; under FSDP2 every precision works as it is
    precision: str, scaler: torch.amp.GradScaler | None = None, device: torch.device | str | None = None
) -> Precision:
    """Lightning's FSDP precision plugin: returns the precision ``precision`` names, which ``FSDPStrategy`` casts
    its gathered parameters to ("bf16-mixed": bf16 all-gathers, fp32 gradient reduction). A ``scaler`` given is the
    one used (its scale and state dict move with the steps): any ``GradScaler`` for "16-mixed"; for "16-true",
    whose gradients are fp16, a ``ShardedGradScaler`` (a plain ``GradScaler`` is refused: it cannot unscale them).

    Usage: ``Fabric(strategy="fsdp", plugins=[FSDPPrecision("bf16-mixed")])``.
    """
    if precision == "32-true":
        if scaler is not None:
            raise ValueError("A loss scaler is for fp16; precision='32-true' does not use one. Leave scaler out.")
        return Precision()
    kind = MixedPrecision if precision.endswith("-mixed") else TruePrecision
    if precision not in kind.DTYPES:
        valid = ["32-true", *MixedPrecision.DTYPES, *TruePrecision.DTYPES]
        raise ValueError(
            f"FSDPPrecision(precision={precision!r}) is not supported. Valid: {', '.join(map(repr, valid))}."
        )
    return kind(precision, device, scaler=scaler)
