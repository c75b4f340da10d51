"""The ``Fabric`` facade: the one object a training script talks to. It turns arguments into an accelerator,
a strategy and a precision (``choices``), and delegates; the per-step calls (forward, ``backward``,
``optimizer.step``) go straight to the precision's hooks chosen at setup. docs/architecture.md walks through the
layers beneath it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, ContextManager

import torch
from torch.utils.data import DataLoader

from fabriclite import checkpoint, choices
from fabriclite.processes import failures, preemption, signals
from fabriclite._legacy import LegacyAPI
from fabriclite._collections import apply_to_collection, as_list, convert_tensors_to_scalars, convert_to_tensors
from fabriclite._collections import move_to_device
from fabriclite._versions import warm_compile_workers
from fabriclite.accelerators import Accelerator, select_accelerator
from fabriclite.callbacks import call_hook
from fabriclite.collectives import check_reduce_op
from fabriclite.compile import CompileWatch, compile_kwargs
from fabriclite.data import wrap_loader
from fabriclite.kernels import kernels_usable
from fabriclite.processes.launcher import check_launch_function, do_nothing
from fabriclite.plugins import select_precision, split_plugins
from fabriclite.plugins.precision import Precision
from fabriclite.seed import seed_everything as _seed_everything
from fabriclite.strategies import Strategy, parse_strategy, select_strategy
from fabriclite.wrappers import _FabricModule, _FabricOptimizer, wrap_model


def _rebuild_fabric(cls: type[Fabric], init_kwargs: dict[str, Any]) -> Fabric:
    return cls(**init_kwargs)


class Fabric(LegacyAPI):
    """Mixed precision, device placement, checkpoints, distributed training and compilation for a raw PyTorch loop.

    The API is Lightning Fabric's: a script written for ``lightning.fabric`` runs by changing its import.
    Usage::

        fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
        fabric.launch()
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(loader)
        fabric.backward(loss)
    """

    def __init__(
        self,
        *,
        accelerator: str = "auto",
        strategy: str | Strategy = "auto",
        devices: int | str | list[int] = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        plugins: Any = None,
        callbacks: Any = None,
        loggers: Any = None,
        kernels: bool = False,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        # What a process started by `launch()` (ddp_spawn) needs to build this Fabric again; see __reduce__.
        self._init_kwargs = {name: value for name, value in locals().items() if name != "self"}
        # Settings given to `fabriclite run` fill in the arguments left at their defaults; a differing one raises.
        accelerator, strategy, devices, num_nodes, precision = choices.apply_cli_settings(
            accelerator, strategy, devices, num_nodes, precision
        )
        accelerator_name = choices.parse_accelerator(accelerator)
        strategy_choice = parse_strategy(strategy)
        parsed_devices = choices.parse_devices(devices)
        nodes = choices.parse_num_nodes(num_nodes)
        precision_name = choices.parse_precision(precision)
        user_precision, checkpoint_io, environment = split_plugins(as_list(plugins))

        self._accelerator: Accelerator = select_accelerator(accelerator_name, parsed_devices)
        self._strategy: Strategy = select_strategy(strategy_choice, self._accelerator, nodes)
        if checkpoint_io is not None:
            self._strategy.checkpoint_io = checkpoint_io
        if environment is not None and hasattr(self._strategy, "cluster_environment"):  # one process reads nothing
            self._strategy.cluster_environment = environment
        self._strategy.configure(self._accelerator, nodes)
        self._precision: Precision = user_precision or select_precision(precision_name, self._strategy.root_device)
        self._precision.place(self._strategy.root_device)
        self._strategy.precision = self._precision
        # The kernels compute in fp32: a float64 model keeps torch's layers.
        self._kernels = bool(kernels) and kernels_usable(self.device) and self._precision.name != "64-true"
        self._compile = compile_kwargs(compile)
        self._compile_watches: list[CompileWatch] = []
        signals.install(self._strategy.global_rank, environment)  # from now on notices are noted, not fatal
        self._checkpointer = checkpoint.Checkpointer()  # asynchronous saves: staged at the call, written after
        failures.record(self._checkpointer.last_sequence)  # an exception that ends this rank tells its supervisor
        self._callbacks = as_list(callbacks)
        self._loggers = as_list(loggers)
        # With a loss scaler, backward scales the loss and only a wrapped optimizer unscales it: refuse until then.
        self._backward_ready = self._precision.scaler is None
        # The processes exist already (one process, or started by torchrun, SLURM, `fabriclite run` or our own
        # launcher): join them now, so launch() is optional. Otherwise launch() starts them.
        self._launched = not self._strategy.launcher.starts_processes
        if self._launched:
            self._join()
        self._prepare_run()

    def __reduce__(self) -> tuple:
        # A Fabric pickles as its arguments: what ddp_spawn sends to each new process, where it is built again.
        return (_rebuild_fabric, (type(self), self._init_kwargs))

    def __copy__(self) -> Fabric:
        return self  # one per process: a copied model (say, an EMA of a LightningModule) shares it

    def __deepcopy__(self, memo: dict) -> Fabric:
        return self

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._strategy.root_device

    # Where this process sits in the run, as the strategy knows it.
    global_rank = property(lambda self: self._strategy.global_rank, doc="This process's rank among all (an int).")
    local_rank = property(lambda self: self._strategy.local_rank, doc="This process's rank on its machine (an int).")
    node_rank = property(lambda self: self._strategy.node_rank, doc="The rank of this process's machine (an int).")
    world_size = property(lambda self: self._strategy.world_size, doc="How many processes the run has (an int).")
    is_global_zero = property(lambda self: self._strategy.is_global_zero, doc="Whether this is global rank 0.")
    strategy = property(lambda self: self._strategy, doc="The ``Strategy`` chosen at construction.")
    accelerator = property(lambda self: self._accelerator, doc="The ``Accelerator`` chosen at construction.")

    @property
    def device_mesh(self) -> Any:
        """The device mesh of FSDP and ``ModelParallelStrategy`` (``fabric.device_mesh["tensor_parallel"]``)."""
        if not hasattr(type(self._strategy), "device_mesh"):
            raise AttributeError(f"{type(self._strategy).__name__} has no device mesh; FSDP and model parallel do.")
        return self._strategy.device_mesh

    @property
    def preempted(self) -> bool:
        """Whether a notice (SIGTERM, SIGUSR1, a SLURMEnvironment's requeue signal) reached any rank; a collective:
        read it on every rank, once per step. Usage: ``if fabric.preempted: fabric.save(path, state); sys.exit(75)``."""
        return preemption.agreed(self._strategy)

    loggers = property(lambda self: self._loggers, doc="The loggers passed to ``Fabric(loggers=...)`` (a list).")

    logger = property(lambda self: (self._loggers or [None])[0], doc="The first of ``Fabric(loggers=...)``, or None.")

    # ------------------------------------------------------------------ launching and setup
    def launch(self, function: Callable[..., Any] = do_nothing, *args: Any, **kwargs: Any) -> Any:
        """Start the processes the strategy needs (none for one device) and run ``function(fabric, *args)``.

        Usage: ``fabric.launch()`` at the top of a script, or ``fabric.launch(train, config)``.
        """
        check_launch_function(function, self._strategy.launcher)
        return self._strategy.launcher.launch(self._run_launched, function, *args, **kwargs)

    def _run_launched(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._join()  # in every process the launcher is responsible for, once it exists
        return function(self, *args, **kwargs)

    def _join(self) -> None:
        self._strategy.setup_environment()
        self._strategy.announce()
        if self._compile is not None and self.device.type == "cuda":  # a CPU compiles its C++ in threads
            warm_compile_workers(self._compile.get("backend"))
        self._launched = True

    def setup(
        self,
        module: torch.nn.Module,
        *optimizers: torch.optim.Optimizer,
        scheduler: Any = None,
        move_to_device: bool = True,
        compile: bool | dict[str, Any] | None = None,
    ) -> Any:
        """Wrap a model and its optimizers; returns the model alone, or ``(model, *optimizers[, scheduler])``.

        ``compile`` overrides ``Fabric(compile=...)`` for this model. Usage: ``model, optimizer = fabric.setup(model, optimizer)``.
        """
        wrapped_module = self._wrap_module(module, move_to_device, compile)
        wrapped = [self._setup_optimizer(optimizer) for optimizer in optimizers]
        self._after_setup(wrapped_module, wrapped)
        if scheduler is not None:
            return (wrapped_module, *wrapped, scheduler)
        return (wrapped_module, *wrapped) if wrapped else wrapped_module

    def setup_module(
        self,
        module: torch.nn.Module,
        move_to_device: bool = True,
        compile: bool | dict[str, Any] | None = None,
    ) -> _FabricModule:
        """Wrap a model: kernels, precision conversion, placement on the device, the strategy's wrapper, compile.
        Usage: ``model = fabric.setup_module(model, compile=True)``."""
        wrapped = self._wrap_module(module, move_to_device, compile)
        self._after_setup(wrapped, None)
        return wrapped

    def _wrap_module(self, module: torch.nn.Module, move_to_device: bool, compile: Any) -> _FabricModule:
        self._check_launched("setup")
        kwargs = self._compile if compile is None else compile_kwargs(compile, "setup(compile=...)")
        device = self.device if move_to_device else None
        wrapped = wrap_model(module, self._strategy, self._precision, self._kernels, kwargs, device)
        if wrapped._watch is not None:
            self._compile_watches.append(wrapped._watch)
        return wrapped

    def _after_setup(self, module: _FabricModule, optimizers: list[_FabricOptimizer] | None) -> None:
        original = module.module
        if hasattr(original, "_fabric"):  # a LightningModule (duck typed): self.log, self.logger go through us
            original._fabric = self
            if optimizers is not None:
                original._fabric_optimizers = optimizers
            if not any(callback is original for callback in self._callbacks):
                self._callbacks.append(original)
        self.call("on_after_setup", fabric=self, module=module)

    def compile_report(self) -> list[dict[str, Any]]:
        """What torch.compile did for each model set up with ``compile=...``, that model's alone: graphs after its
        first step, recompiles since, graph breaks and their reasons.

        Usage: ``fabric.print(fabric.compile_report())`` after the first training step.
        """
        return [watch.report() for watch in self._compile_watches]

    def setup_optimizers(self, *optimizers: torch.optim.Optimizer) -> Any:
        """Wrap optimizers so ``step`` goes through the loss scaler; returns one or a tuple.
        Usage: ``optimizer = fabric.setup_optimizers(optimizer)``."""
        if not optimizers:
            raise ValueError("`setup_optimizers` requires at least one optimizer as input.")
        wrapped = tuple(self._setup_optimizer(optimizer) for optimizer in optimizers)
        return wrapped[0] if len(wrapped) == 1 else wrapped

    def _setup_optimizer(self, optimizer: torch.optim.Optimizer) -> _FabricOptimizer:
        if isinstance(optimizer, _FabricOptimizer):
            raise ValueError("An optimizer should be passed only once to the setup methods: it is wrapped.")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"fabric.setup expects torch.optim.Optimizer objects after the model, got {type(optimizer).__name__}."
            )
        optimizer = self._strategy.setup_optimizer(optimizer)
        self._backward_ready = True
        return _FabricOptimizer(optimizer, self._precision, self._strategy, self._callbacks)

    def setup_dataloaders(
        self, *dataloaders: DataLoader, use_distributed_sampler: bool = True, move_to_device: bool = True
    ) -> Any:
        """Wrap loaders: batches moved to the device, position kept for checkpoints; one in, one out, else a list.

        Usage: ``train_loader, val_loader = fabric.setup_dataloaders(train_loader, val_loader)``.
        """
        self._check_launched("setup_dataloaders")
        if not dataloaders:
            raise ValueError("`setup_dataloaders` requires at least one dataloader as input.")
        device = self.device if move_to_device else None
        wrapped = [wrap_loader(loader, self._strategy, use_distributed_sampler, device) for loader in dataloaders]
        return wrapped[0] if len(wrapped) == 1 else wrapped

    # ------------------------------------------------------------------ the training step
    def backward(self, tensor: torch.Tensor, *args: Any, model: _FabricModule | None = None, **kwargs: Any) -> None:
        """Replace ``loss.backward()``: scales the loss when the precision uses a loss scaler; the first call lets the
        strategy check that the loss can train (DDP: it comes from a set-up model). Usage: ``fabric.backward(loss)``."""
        if not self._backward_ready:
            raise RuntimeError(
                f"precision={self._precision.name!r} scales the loss, and only an optimizer returned by fabric.setup "
                "unscales the gradients again. Call `model, optimizer = fabric.setup(model, optimizer)` before backward."
            )
        if self._strategy.loss_unchecked:  # the first backward only: the check walks the autograd graph
            self._strategy.check_loss(tensor)
        self._precision.backward(tensor, *args, **kwargs)

    def clip_gradients(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        clip_val: float | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor | None:
        """Clip gradients by value (``clip_val``) or by total norm (``max_norm``, returns that norm), after unscaling.

        With a loss scaler, a non-finite norm does not raise: the scaler skips that step and lowers the scale, which
        is what it is for (Lightning Fabric raises there).
        Usage: ``fabric.clip_gradients(model, optimizer, max_norm=1.0)``.
        """
        if (clip_val is None) == (max_norm is None):
            raise ValueError(
                f"Pass exactly one of clip_val or max_norm, got clip_val={clip_val!r}, max_norm={max_norm!r}."
            )
        inner = optimizer.optimizer if isinstance(optimizer, _FabricOptimizer) else optimizer
        if clip_val is not None:
            return self._strategy.clip_gradients_value(module, inner, clip_val)
        return self._strategy.clip_gradients_norm(module, inner, max_norm, norm_type, error_if_nonfinite)

    def autocast(self) -> ContextManager:
        """The precision's forward context, for code outside the model's forward that should run in it.

        Usage: ``with fabric.autocast(): loss = criterion(model(x), y)``.
        """
        return self._precision.forward_context()

    def no_backward_sync(self, module: _FabricModule, enabled: bool = True) -> ContextManager:
        """Skip the gradient all-reduce in this block (gradient accumulation); a no-op on one device.

        Usage: ``with fabric.no_backward_sync(model, enabled=not last_micro_batch): fabric.backward(loss)``.
        """
        if not isinstance(module, _FabricModule):
            raise TypeError(
                f"fabric.no_backward_sync expects the model returned by fabric.setup, got {type(module).__name__}."
            )
        return self._strategy.no_backward_sync(module._forward_module, enabled)

    def to_device(self, obj: Any) -> Any:
        """Move a module, a tensor or a collection of tensors to this process's device.

        Usage: ``batch = fabric.to_device(batch)``.
        """
        return move_to_device(obj, self.device)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        if self.is_global_zero:
            print(*args, **kwargs)

    # ------------------------------------------------------------------ collectives
    def _check_launched(self, what: str) -> None:
        if not self._launched:
            raise RuntimeError(f"fabric.{what} was called before fabric.launch(); call fabric.launch() first.")

    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""
        self._check_launched("barrier")
        self._strategy.barrier(name=name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from rank ``src`` to every process (a DTensor in it as its full value; every rank
        must then pass its DTensor)."""
        self._check_launched("broadcast")
        return self._strategy.broadcast(obj, src=src)

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Gather tensors (or numbers, or collections of them) from every process; a DTensor (an FSDP parameter, say)
        takes part with its full value, so the result is what DDP's plain tensors would give."""
        self._check_launched("all_gather")
        data = convert_to_tensors(data, self.device)
        return apply_to_collection(data, torch.Tensor, self._strategy.all_gather, group=group, sync_grads=sync_grads)

    def all_reduce(self, data: Any, group: Any = None, reduce_op: str = "mean") -> Any:
        """Reduce tensors (or numbers, or collections of them) over every process with "mean", "sum", "max" or "min";
        a DTensor takes part with its full value and the result is a plain tensor."""
        self._check_launched("all_reduce")
        reduce_op = check_reduce_op(reduce_op)
        data = convert_to_tensors(data, self.device)
        return apply_to_collection(data, torch.Tensor, self._strategy.all_reduce, group=group, reduce_op=reduce_op)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Run the block on rank 0 first (e.g. to download or prepare data), then on the others."""
        with self._strategy.rank_zero_first(local=local):
            yield

    # ------------------------------------------------------------------ building
    @contextmanager
    def init_module(self, empty_init: bool | None = None) -> Iterator[None]:
        """Build a model directly on the device and in the precision's dtype; ``empty_init=True`` skips weight init.

        Usage: ``with fabric.init_module(): model = GPT(config)``.
        """
        with (
            self._strategy.module_init_context(empty_init),
            torch.device(self.device),
            self._precision.module_init_context(),
        ):
            yield

    @contextmanager
    def init_tensor(self) -> Iterator[None]:
        """Create tensors directly on the device and in the precision's dtype."""
        with torch.device(self.device), self._precision.module_init_context():
            yield

    # ------------------------------------------------------------------ checkpoints
    def save(
        self,
        path: str | os.PathLike,
        state: Mapping[str, Any],
        filter: Mapping[str, Callable] | None = None,
        *,
        keep_last: int | None = None,
        asynchronous: bool = False,
    ) -> None:
        """Write ``state`` atomically (modules, optimizers, schedulers, loaders, plain values, plus the random streams
        and the loss scaler, so ``load`` resumes bit-exactly). ``filter`` maps a key of ``state`` to ``fn(name, value)
        -> bool`` choosing entries of its state_dict; ``keep_last=K`` removes this run's checkpoints named like ``path``
        beyond the K newest; ``asynchronous=True`` copies the state at the call and writes it in the background.
        Usage: ``fabric.save(f"ckpts/step-{step}.ckpt", {"model": model, "step": step}, keep_last=3)``."""
        checkpoint.check_state(state, filter)
        self._check_launched("save")
        checkpoint.save_state(
            self._strategy, self._precision, path, state, self._checkpointer, filter, keep_last, asynchronous
        )

    def load_latest(self, folder: str | os.PathLike, state: dict[str, Any], strict: bool = True, **options: Any) -> Any:
        """``load`` the newest complete checkpoint in ``folder`` into ``state`` and return its path, or return None
        (a fresh start). Usage: ``if fabric.load_latest("ckpts", state) is None: fabric.print("fresh start")``."""
        keys = state if strict else ()  # a checkpoint lacking a key of state (a model-only best.ckpt) is passed over
        path = checkpoint.latest(self._strategy, folder, self._checkpointer, keys, options.get("weights_only", True))
        if path is not None:
            self.load(path, state, strict, **options)
            self._checkpointer.resume(path)  # later saves go on with the run that wrote it
        return path

    def load(
        self,
        path: str | os.PathLike,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        weights_only: bool = True,
        verify: bool = True,
    ) -> dict[str, Any]:
        """Restore ``state`` in place from a checkpoint and return what it did not consume.

        Objects with ``load_state_dict`` are loaded in place; plain values are written back into ``state``. The
        random streams and the loss scaler saved with it are restored too. Without ``state``, returns the whole
        checkpoint and restores nothing. The checksums are verified before anything is loaded (``verify=False``
        skips that); any problem raises ``CheckpointError``. Usage: ``remainder = fabric.load("last.ckpt", state)``.
        """
        if state is not None and not isinstance(state, dict):
            raise TypeError(f"fabric.load expects state to be a dict (filled in place), got {type(state).__name__}.")
        remainder, meta = self._strategy.load_checkpoint(
            path, state, strict=strict, weights_only=weights_only, verify=verify
        )
        if state is not None and meta is not None:
            checkpoint.restore_meta(meta, self._precision, self.global_rank, path)
        self._strategy.barrier("load")
        return remainder

    def load_raw(
        self,
        path: str | os.PathLike,
        obj: torch.nn.Module | torch.optim.Optimizer,
        strict: bool = True,
        *,
        weights_only: bool = True,
        verify: bool = True,
    ) -> None:
        """Load a plain state dict (e.g. saved with ``torch.save(model.state_dict())``) into a module or optimizer,
        after checking the CRC-32s ``torch.save`` stores in the file (``verify=False`` skips that). Into a model
        sharded by FSDP or ModelParallelStrategy, each rank takes its slice (rank 0 reads the file).

        Usage: ``fabric.load_raw("weights.pt", model)``.
        """
        checkpoint.load_raw(path, obj, strict=strict, weights_only=weights_only, verify=verify, strategy=self._strategy)

    # ------------------------------------------------------------------ logging, callbacks, progress
    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one value (a number or one-element tensor) to every logger, from rank 0."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log several values to every logger, from rank 0. Usage: ``fabric.log_dict({"loss": loss}, step=i)``."""
        if not self._loggers or not self.is_global_zero:
            return
        metrics = convert_tensors_to_scalars(metrics)
        for logger in self._loggers:
            logger.log_metrics(metrics=metrics, step=step)  # by keyword, as Lightning

    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call ``hook_name`` on every callback that has it, with ``args`` and the ``kwargs`` its signature accepts.

        Usage: ``fabric.call("on_train_epoch_end", results=results)``.
        """
        call_hook(self._callbacks, hook_name, *args, **kwargs)

    def progress(self, iterable: Iterable, desc: str | None = None, **kwargs: Any) -> Iterable:
        """A progress bar on rank 0 (quiet off a terminal); ``bar.set_metrics(loss=...)`` shows values.

        Usage: ``for batch in (bar := fabric.progress(loader, desc="train")): ...``.
        """
        from fabriclite.progress import progress

        if not self.is_global_zero:
            kwargs["enable"] = False
        return progress(iterable, desc=desc, **kwargs)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed every global generator, and loader workers unless ``workers=False`` (as Lightning); see ``seed.py``."""
        return _seed_everything(seed=seed, workers=True if workers is None else workers, verbose=verbose)

    def __repr__(self) -> str:
        return f"Fabric(accelerator={self._accelerator!r}, strategy={self._strategy!r}, precision={self._precision!r})"


__all__ = ["Fabric"]
