"""What a strategy is: how the work is spread over processes and devices. The base does it for one process on one
device; the distributed strategies (``parallel``, ``ddp``, ``fsdp``) fill in the same hooks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager

import torch

from fabriclite import checkpoint
from fabriclite.accelerators import Accelerator
from fabriclite.checkpoint import CheckpointIO, TorchCheckpointIO
from fabriclite.processes.launcher import InProcessLauncher
from fabriclite.plugins.precision import Precision
from fabriclite.rank_zero import rank_zero_info


class Strategy:
    """What a strategy does: start processes (its ``launcher``), place and wrap the module for its kind of
    parallelism, run collectives, and write and read checkpoints.

    ``Fabric`` calls ``configure`` once, then ``setup_environment`` in every process once the processes run.
    Usage: subclass and fill in the hooks; ``Fabric(strategy=MyStrategy())`` uses it.
    """

    # Whether the module setup_module returns does work across processes in its forward (DDP's gradient sync,
    # FSDP's weight gathering), so the model's other methods must run through it (see wrappers._FabricModule).
    syncs_in_forward = False

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        if checkpoint_io is not None and not isinstance(checkpoint_io, CheckpointIO):
            raise TypeError(
                f"{type(self).__name__}(checkpoint_io={checkpoint_io!r}) expects a CheckpointIO (such as "
                "TorchCheckpointIO()) or None."
            )
        self.accelerator: Accelerator | None = None
        self.precision: Precision | None = None
        self.checkpoint_io: CheckpointIO = checkpoint_io or TorchCheckpointIO()
        self.root_device = torch.device("cpu")
        self._device: torch.device | None = None  # the one device the user named, if any (SingleDeviceStrategy)
        self.__dict__.update(self._process_state())

    def _process_state(self) -> dict[str, Any]:
        """What this strategy holds about the process it runs in (its launcher, wrapped modules, meshes), freshly
        made; subclasses add theirs. It never travels to another process (``ddp_spawn`` pickles the strategy): a
        strategy arriving in a new process runs in processes that exist already."""
        return {"launcher": InProcessLauncher()}

    def __getstate__(self) -> dict[str, Any]:
        process_state = self._process_state()
        return {name: value for name, value in self.__dict__.items() if name not in process_state}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__.update(self._process_state())

    def configure(self, accelerator: Accelerator, num_nodes: int = 1) -> None:
        """Called by Fabric in the process the user started: the hardware is known, nothing runs yet."""
        if self._device is not None and self._device.type != accelerator.device(0).type:
            raise ValueError(
                f"{type(self).__name__}(device={str(self._device)!r}) is a {self._device.type} device, but the "
                f"accelerator is {accelerator.name!r}: pass Fabric(accelerator={self._device.type!r}) with it."
            )
        self.accelerator = accelerator
        self.root_device = self._device or accelerator.device(self.local_rank)

    def setup_environment(self) -> None:
        """Called in each process once it runs (after launch): make the device current, join process groups.
        Calling it again does nothing more."""
        assert self.accelerator is not None, "Strategy.configure comes first"
        self.root_device = self._device or self.accelerator.device(self.local_rank)
        self.accelerator.setup_device(self.root_device)

    def announce(self) -> None:
        """Say on rank 0, once the processes run, what runs: the strategy, how many processes on which device, the
        precision (``logging.getLogger("fabriclite").setLevel(logging.WARNING)`` silences it, and Lightning's info
        lines with it). Once per process: ``launch()`` after a Fabric that joined at construction says nothing more."""
        if self.__dict__.setdefault("_announced", False):
            return
        self._announced = True
        processes = f"{self.world_size} process{'es' if self.world_size > 1 else ''}"
        nodes = getattr(self, "num_nodes", 1)
        where = f"{processes} on {nodes} nodes" if nodes > 1 else processes
        precision = getattr(self.precision, "name", "32-true")
        rank_zero_info(f"fabriclite: {type(self).__name__}, {where}, {self.root_device.type}, precision {precision}")

    # Process layout.
    @property
    def world_size(self) -> int:
        """How many processes run the job."""
        return 1

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes."""
        return 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (which device it uses)."""
        return 0

    @property
    def node_rank(self) -> int:
        """The rank of this process's machine."""
        return 0

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0, the process that writes files and prints."""
        return self.global_rank == 0

    # Modules and optimizers.
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap the module for this strategy's parallelism (DDP, FSDP); the single device returns it as is."""
        return module

    def compile_module(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
        """Apply ``torch.compile`` to the module ``setup_module`` returned."""
        return torch.compile(module, **kwargs)

    def module_to_device(self, module: torch.nn.Module) -> None:
        """Move the module to this process's device (sharding strategies place the shards themselves)."""
        module.to(self.root_device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Adapt an optimizer to the strategy (FSDP points it at the sharded parameters); others return it."""
        return optimizer

    # Whether the next fabric.backward calls check_loss; a strategy with something to check sets it, check_loss clears it.
    loss_unchecked = False

    def check_loss(self, loss: torch.Tensor) -> None:
        """Called by the first ``fabric.backward`` while ``loss_unchecked``: raise or warn when ``loss`` cannot train
        as this strategy expects (DDP: it comes from parameters of no set-up model). Nothing to check on one device."""

    def module_init_context(self, empty_init: bool | None = None) -> ContextManager:
        """Where modules are built: on the root device; with ``empty_init`` the weight init functions are skipped
        (the weights will be overwritten by a checkpoint anyway)."""
        return _SkipInit() if empty_init else nullcontext()

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager:
        """A context in which backward does not reduce gradients across processes (gradient accumulation)."""
        return nullcontext()

    def process_dataloader(self, dataloader: Any, use_distributed_sampler: bool) -> Any:
        """The loader this process reads: its shard of the data under several processes, else the loader."""
        return dataloader

    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Unscale the gradients (with a loss scaler), then clip them to a total norm; return that norm. With a
        scaler a non-finite norm does not raise: the scaler skips that step and lowers the scale, its job."""
        self.precision.unscale_gradients(optimizer)
        error_if_nonfinite = error_if_nonfinite and self.precision.scaler is None
        return self.clip_by_total_norm(module, max_norm, norm_type, error_if_nonfinite)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        """Unscale the gradients (with a loss scaler), then clamp each to ``[-clip_val, clip_val]``."""
        self.precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_value_(module.parameters(), clip_val)

    def clip_by_total_norm(
        self, module: torch.nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # Collectives: one process has nothing to exchange.
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process arrives here."""
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` has it, on every rank (any picklable object)."""
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's ``tensor``, stacked along a new first dimension."""
        return tensor

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: str = "mean") -> torch.Tensor:
        """``tensor`` reduced over every rank with ``reduce_op`` ("mean", "sum", "max", "min")."""
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return [obj]

    def teardown(self) -> None:
        """Release what the strategy holds for this process (process groups, watchdog threads)."""
        pass

    # Checkpoints: the formats live in fabriclite.checkpoint; a strategy says which one it writes.
    def save_checkpoint(
        self, path: Any, state: Mapping[str, Any], meta: dict[str, Any], filter: Mapping[str, Callable] | None = None
    ) -> None:
        """Write ``state`` (objects turned into state dicts) plus fabriclite's ``meta`` atomically to one file."""
        checkpoint.save(path, checkpoint.to_checkpoint(state, meta, filter), self, sharded=False)

    def load_checkpoint(
        self,
        path: Any,
        state: dict[str, Any] | None,
        strict: bool = True,
        weights_only: bool = True,
        verify: bool = True,
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load a checkpoint file or sharded folder into ``state`` in place; return (what ``state`` did not consume,
        fabriclite's meta)."""
        return checkpoint.load(path, state, strict, weights_only, self.checkpoint_io, verify)

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        rank = self.local_rank if local else self.global_rank
        if rank != 0:
            self.barrier("rank_zero_first")
        yield
        if rank == 0:
            self.barrier("rank_zero_first")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.root_device})"


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Makes the in-place init functions of ``torch.nn.init`` return their tensor untouched."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


class SingleDeviceStrategy(Strategy):
    """One process on one device: ``device`` (as in Lightning: ``"cuda:1"``, ``torch.device("cuda", 1)``), or the
    accelerator's first device when None.

    Usage: ``Fabric(strategy="single_device")``, the default for one device, or
    ``Fabric(accelerator="cuda", strategy=SingleDeviceStrategy(device="cuda:1"))``.
    """

    def __init__(
        self, device: torch.device | str | int | None = None, *, checkpoint_io: CheckpointIO | None = None
    ) -> None:
        super().__init__(checkpoint_io)
        if isinstance(device, bool) or not isinstance(device, (str, int, torch.device, type(None))):
            raise TypeError(
                f"SingleDeviceStrategy(device={device!r}) expects a device: a string such as 'cuda:1', a "
                "torch.device, an index, or None for the accelerator's first device; pass checkpoint_io by keyword."
            )
        try:
            self._device = None if device is None else torch.device(device)
        except RuntimeError as error:
            raise ValueError(f"SingleDeviceStrategy(device={device!r}) is not a device: {error}") from None
        if self._device is not None:
            self.root_device = self._device
