"""The thin wrappers ``Fabric.setup`` returns: a module whose forward runs under the precision, and an optimizer
whose step goes through the loss scaler. Both look like what they wrap: same ``state_dict`` keys, attribute
access passes through, ``isinstance`` checks against the user's optimizer class hold.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fabriclite.plugins.precision import Precision


class _FabricModule(torch.nn.Module):
    """Runs the module's forward under the precision's context and casts.

    ``forward_module`` is what runs (possibly a DDP/compiled wrapper); ``module`` is the user's original module.
    """

    def __init__(
        self,
        forward_module: torch.nn.Module,
        precision: Precision,
        original_module: torch.nn.Module | None = None,
        watch: Any = None,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module if original_module is not None else forward_module
        self._precision = precision
        # Chosen once: 32-true calls the module directly, the hot path has no context and no casts.
        # Kept as plain attributes: reading a submodule goes through nn.Module.__getattr__, microseconds per step.
        self._forward_call = forward_module.__call__
        forward = self._forward_call if precision.passthrough else self._precision_forward
        self._fabric_forward = forward
        if watch is not None:  # a compiled model: count what the compiler does in the first calls, then stop
            self._fabric_forward = watch.wrap(forward, stop=lambda: setattr(self, "_fabric_forward", forward))

    @property
    def module(self) -> torch.nn.Module:
        """The user's original module."""
        return self._original_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._fabric_forward(*args, **kwargs)

    # The wrapper runs no hooks of its own (hook registration goes to the user's module, below), so calling it
    # skips nn.Module.__call__'s hook dispatch: a few microseconds per step on small models.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fabric_forward(*args, **kwargs)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.register_forward_pre_hook(*args, **kwargs)

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.register_full_backward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.register_full_backward_pre_hook(*args, **kwargs)

    def _precision_forward(self, *args: Any, **kwargs: Any) -> Any:
        precision = self._precision
        args, kwargs = precision.convert_input((args, kwargs))
        with precision.forward_context():
            output = self._forward_call(*args, **kwargs)
        return precision.convert_output(output)

    # Checkpoints hold the original module's keys, without any wrapper prefix.
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules of the wrapper itself
        except AttributeError:
            original = super().__getattr__("_original_module")
            return getattr(original, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # Attributes the user's module already has are set there, so `model.flag = True` reaches the model.
        original = self.__dict__.get("_modules", {}).get("_original_module")
        if (
            original is not None
            and not name.startswith("_")
            and hasattr(original, name)
            and not hasattr(type(self), name)
        ):
            setattr(original, name, value)
        else:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"_FabricModule({self._original_module!r})"


_OPTIMIZER_WRAPPER_ATTRS = frozenset({"_optimizer", "_precision"})


class _FabricOptimizer:
    """Routes ``step`` through the precision (the loss scaler); everything else is the user's optimizer.

    The instance's class is made a subclass of the user's optimizer class, so ``isinstance(opt, AdamW)`` holds.
    State is never copied: ``param_groups``, ``state`` and any other attribute are read from and written to the
    wrapped optimizer, so an LR scheduler built on either object drives the same groups, also after
    ``load_state_dict`` replaces them.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(
            self, "__class__", type("Fabric" + type(optimizer).__name__, (_FabricOptimizer, type(optimizer)), {})
        )

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The user's original optimizer."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self._optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self._optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        # `step` is looked up on every call: an LR scheduler may have wrapped the inner optimizer's since setup.
        if closure is None:
            return self._precision.optimizer_step(self._optimizer)
        return self._precision.optimizer_step(self._optimizer, closure=closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found on the wrapper: they live on the wrapped optimizer.
        return getattr(object.__getattribute__(self, "_optimizer"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OPTIMIZER_WRAPPER_ATTRS or name in _FabricOptimizer.__dict__:
            object.__setattr__(self, name, value)  # e.g. an LR scheduler wrapping `step` wraps ours
        else:
            setattr(self._optimizer, name, value)

    def __getstate__(self) -> dict[str, Any]:
        return self._optimizer.__getstate__()

    def __repr__(self) -> str:
        return f"Fabric{self._optimizer!r}"
