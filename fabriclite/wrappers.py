"""The thin wrappers ``Fabric.setup`` returns, and how a model becomes one (``wrap_model``): a module whose forward
runs under the precision, and an optimizer whose step goes through the loss scaler. Both look like what they wrap: same ``state_dict`` keys, attribute
access passes through, ``isinstance`` checks against the user's optimizer class hold.

Under a multi-process strategy, the model's other methods are guarded: the LightningModule step methods (and any
method marked with ``mark_forward_method``) run through the strategy's forward, so DDP averages their gradients
and FSDP gathers the weights they use; any other method that runs the model raises, naming
``mark_forward_method``, instead of letting the replicas drift apart in silence.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Callable

import torch

from fabriclite._collections import apply_to_collection
from fabriclite.callbacks import call_hook
from fabriclite.compile import compile_model
from fabriclite.plugins.precision import Precision
from fabriclite.rank_zero import PossibleUserWarning, rank_zero_warn
from fabriclite.strategies.strategy import Strategy

# The LightningModule methods that run the model, routed through forward as Lightning Fabric does.
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def wrap_model(
    module: torch.nn.Module,
    strategy: Strategy,
    precision: Precision,
    kernels: bool,
    compile_kwargs: dict[str, Any] | None,
    device: torch.device | None,
) -> _FabricModule:
    """The model ``fabric.setup`` returns, made in this order: Triton kernels swapped in, the precision's
    conversion, the move to ``device`` (None: left where it is), the strategy's wrapper (DDP, FSDP), then
    ``torch.compile``: each repeated block in place, or the whole model around that wrapper, as PyTorch recommends
    (DDP's graph splitting needs it; FSDP per unit), see ``fabriclite.compile``.

    A model the user compiled before setup keeps its compiled forward; the rest works on the model inside.
    Usage: ``model = wrap_model(net, strategy, precision, kernels=False, compile_kwargs=None, device=device)``.
    """
    if isinstance(module, _FabricModule):
        raise ValueError(
            "A model should be passed only once to the setup methods: pass the model you built, not its wrapper."
        )
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fabric.setup expects a torch.nn.Module, got {type(module).__name__}.")
    user_compiled = type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), torch.nn.Module
    )
    original = module._orig_mod if user_compiled else module
    if kernels:  # before DDP/FSDP wrap anything, so they shard the fused modules
        from fabriclite.kernels.swap import SWAPPABLE, ops_to_swap, swap_modules

        compiled = compile_kwargs is not None or user_compiled
        ops = ops_to_swap(strategy.root_device, compiled)
        swapped = swap_modules(original, ops) if ops else 0
        has_norms = any(type(m) in SWAPPABLE.values() for m in original.modules())
        if not swapped and (has_norms or not ops):
            reason = (
                "under compile=True, where inductor fuses torch's norms better than an opaque custom op"
                if compiled
                else f"on {strategy.root_device}, where no kernel has a measured win for this model's norms "
                "(kernels.swap.MEASURED_WINS, by GPU class, op and width)"
            )
            warnings.warn(
                f"Fabric(kernels=True) leaves the model's norms to torch {reason}; see docs/compile.md.",
                UserWarning,
                stacklevel=4,  # the fabric.setup line
            )
    precision.convert_module(original)
    if device is not None:
        _warn_if_on_several_devices(original)
        strategy.module_to_device(original)
    forward_module = strategy.setup_module(module)
    watch = None
    if compile_kwargs is not None and not user_compiled:
        forward_module, watch = compile_model(forward_module, original, strategy, compile_kwargs)
    elif not user_compiled:
        precision.note_not_compiled()
    guard = strategy.syncs_in_forward
    return _FabricModule(forward_module, precision, original, watch=watch, guard_methods=guard, device=device)


def _warn_if_on_several_devices(module: torch.nn.Module) -> None:
    # Once, in setup: a model split over devices on purpose (pipelining by hand) must not be gathered silently.
    named = list(module.named_parameters())
    if not named:
        return
    first_name, first = named[0]
    elsewhere = [(name, p.device) for name, p in named if p.device != first.device]
    if elsewhere:
        name, device = elsewhere[0]
        rank_zero_warn(
            f"The model passed to fabric.setup has {len(elsewhere)} parameters on different devices (for example "
            f"{name!r} on {device} and {first_name!r} on {first.device}); setup moves them all to one device. If the "
            "split is on purpose, pass setup(..., move_to_device=False).",
            category=PossibleUserWarning,
            stacklevel=7,  # the fabric.setup line
        )


class _FabricModule(torch.nn.Module):
    """Runs the module's forward under the precision's context and casts.

    ``forward_module`` is what runs (possibly a DDP/compiled wrapper); ``module`` is the user's original module.
    ``guard_methods``: the strategy's forward does work of its own (gradient sync, weight gathering), so other
    methods that run the model must go through it. ``device``: where the model was put.
    """

    def __init__(
        self,
        forward_module: torch.nn.Module,
        precision: Precision,
        original_module: torch.nn.Module | None = None,
        watch: Any = None,
        guard_methods: bool = False,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        self._original_module = original_module if original_module is not None else forward_module
        self._precision = precision
        self._guard_methods = guard_methods
        self._forward_methods = set(STEP_METHODS)
        self._device = device
        self._watch = watch
        # Chosen once: 32-true calls the module directly, the hot path has no context and no casts.
        # Kept as plain attributes: reading a submodule goes through nn.Module.__getattr__, microseconds per step.
        self._forward_call = forward_module.__call__
        forward = self._forward_call if precision.passthrough else self._precision_forward
        self._fabric_forward = forward
        if watch is not None:  # a compiled model: count what the compiler does in the first calls, then stop
            self._fabric_forward = watch.wrap(forward, stop=lambda: setattr(self, "_fabric_forward", forward))
        self._initialized = True

    @property
    def module(self) -> torch.nn.Module:
        """The user's original module."""
        return self._original_module

    @property
    def device(self) -> torch.device:
        """The device the model was put on in setup (where its parameters are, without ``move_to_device``)."""
        if self._device is not None:
            return self._device
        return next(self._original_module.parameters(), torch.empty(0)).device

    def mark_forward_method(self, method: str | Callable) -> None:
        """Let the model's method ``method`` (a name or the bound method) run through the strategy's forward, like
        the LightningModule step methods do: under DDP its gradients are averaged, under FSDP its weights gathered.

        Usage: ``model.mark_forward_method("generate")`` after ``model = fabric.setup(model)``.
        """
        if not isinstance(method, str) and not inspect.ismethod(method):
            raise TypeError(
                f"Expected a method or a string, but got: {type(method).__name__} ({method!r}). Pass the method's "
                "name or the bound method (model.module.generate), not a plain function."
            )
        name = method if isinstance(method, str) else method.__name__
        if name == "forward":
            raise ValueError(
                "You cannot mark the forward method itself as a forward method: it already runs through the strategy."
            )
        if not inspect.ismethod(getattr(self._original_module, name, None)):
            owner = type(self._original_module).__name__
            raise AttributeError(
                f"mark_forward_method({name!r}): `{owner}.{name}` does not exist or is not a method; {owner} has no "
                f"method {name!r}."
            )
        self._forward_methods.add(name)

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
            pass
        original = super().__getattr__("_original_module")
        if not self.__dict__.get("_guard_methods"):
            return getattr(original, name)
        if name in self.__dict__["_forward_methods"]:
            return self._through_forward(name)
        attribute = getattr(original, name)
        return self._refusing_to_run_the_model(attribute, name) if inspect.ismethod(attribute) else attribute

    def _through_forward(self, name: str) -> Callable[..., Any]:
        """``original.<name>``, called from inside the strategy's forward: for one call, the original module's
        ``forward`` is replaced by a function that puts it back and runs the method."""
        original = self._original_module

        @functools.wraps(getattr(original, name))
        def call(*args: Any, **kwargs: Any) -> Any:
            def method_as_forward(*args: Any, **kwargs: Any) -> Any:
                put_back()  # the method may call the real forward itself
                return getattr(original, name)(*args, **kwargs)

            put_back = _replace_forward(original, method_as_forward)
            try:
                return self._fabric_forward(*args, **kwargs)
            finally:
                put_back()

        return call

    def _refusing_to_run_the_model(self, method: Callable[..., Any], name: str) -> Callable[..., Any]:
        """``method``, stopped with a clear error as soon as it runs the model's forward or any of its layers:
        outside the strategy's forward, DDP would not average the gradients and FSDP would not gather the weights."""
        original = self._original_module

        def refuse(*_: Any, **__: Any) -> None:
            raise RuntimeError(
                f"{type(original).__name__}.{name}() runs the model outside the strategy's forward, so its gradients "
                f"would not be synchronised across processes. Call `model.mark_forward_method({name!r})` after "
                f"fabric.setup to route it through the forward, or call it on `model.module` if that is what you want."
            )

        @functools.wraps(method)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            handles = [module.register_forward_pre_hook(refuse, prepend=True) for module in original.modules()]
            put_back = _replace_forward(original, refuse)  # also a direct `self.forward(x)` inside the method
            try:
                return method(*args, **kwargs)
            finally:
                put_back()
                for handle in handles:
                    handle.remove()

        return guarded

    def __setattr__(self, name: str, value: Any) -> None:
        # After setup, attributes reach the user's module: new ones, and those it has (`model.flag = True`); the
        # wrapper keeps its own (and sets both where both have one, e.g. `training`).
        if not self.__dict__.get("_initialized"):
            super().__setattr__(name, value)
            return
        original = self._original_module
        on_wrapper = name in self.__dict__ or hasattr(type(self), name) or name in self._modules
        if hasattr(original, name) or not on_wrapper:
            setattr(original, name, value)
        if on_wrapper:
            super().__setattr__(name, value)

    def __repr__(self) -> str:
        return f"_FabricModule({self._original_module!r})"


def _replace_forward(module: torch.nn.Module, function: Callable[..., Any]) -> Callable[[], None]:
    """Make ``module.forward`` be ``function`` (an instance attribute over the class's method); return a function
    that puts back what was there before, once, however often it is called."""
    saved = module.__dict__.get("forward")
    module.forward = function
    done = []

    def put_back() -> None:
        if not done:
            done.append(True)
            if saved is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = saved

    return put_back


_OPTIMIZER_WRAPPER_ATTRS = frozenset({"_optimizer", "_precision", "_strategy", "_callbacks"})


class _FabricOptimizer:
    """Routes ``step`` through the precision (the loss scaler); everything else is the user's optimizer.

    The instance's class is made a subclass of the user's optimizer class, so ``isinstance(opt, AdamW)`` holds.
    State is never copied: ``param_groups``, ``state`` and any other attribute are read from and written to the
    wrapped optimizer, so an LR scheduler built on either object drives the same groups, also after
    ``load_state_dict`` replaces them.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        precision: Precision,
        strategy: Any = None,
        callbacks: list[Any] | None = None,
    ) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_strategy", strategy)
        # The Fabric's own list: callbacks added after setup (a LightningModule) are called too.
        object.__setattr__(self, "_callbacks", callbacks if callbacks is not None else [])
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
            output = self._precision.optimizer_step(self._optimizer)
        else:
            output = self._precision.optimizer_step(self._optimizer, closure=closure)
        if self._callbacks:
            call_hook(self._callbacks, "on_after_optimizer_step", strategy=self._strategy, optimizer=self._optimizer)
        return output

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


def is_wrapped(obj: object) -> bool:
    """Whether ``obj`` came out of ``fabric.setup`` / ``setup_module`` / ``setup_optimizers`` /
    ``setup_dataloaders`` (also under ``torch.compile``).

    Usage: ``if not is_wrapped(model): model = fabric.setup_module(model)``.
    """
    from fabriclite.data import _FabricDataLoader

    if type(obj).__name__ == "OptimizedModule":  # torch.compile's wrapper, named so as not to import dynamo
        obj = getattr(obj, "_orig_mod", obj)
    return isinstance(obj, (_FabricModule, _FabricOptimizer, _FabricDataLoader))


def _unwrap_objects(collection: Any) -> Any:
    """``collection`` with each object ``fabric.setup*`` returned replaced by what it wraps, as Lightning Fabric's
    ``wrappers._unwrap_objects``: a model by the module the strategy runs (its DDP or FSDP module; the user's module
    on one device), an optimizer by the user's, a loader by the user's; ``torch.compile``'s wrapper is taken off.

    Usage: ``module = _unwrap_objects(model)``.
    """
    from fabriclite.data import _FabricDataLoader

    def unwrap(obj: Any) -> Any:
        inner = getattr(obj, "_orig_mod", obj) if type(obj).__name__ == "OptimizedModule" else obj
        if isinstance(inner, _FabricModule):
            forward = inner._forward_module
            return getattr(forward, "_orig_mod", forward) if type(forward).__name__ == "OptimizedModule" else forward
        if isinstance(inner, _FabricOptimizer):
            return inner.optimizer
        if isinstance(inner, _FabricDataLoader):
            return inner._loader
        return obj

    return apply_to_collection(collection, (torch.nn.Module, _FabricOptimizer, _FabricDataLoader), unwrap)
