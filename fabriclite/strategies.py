"""How the work is spread over processes and devices. This module holds the base and the single-device strategy;
the distributed strategies live beside it and are imported only when asked for.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager

import torch

from fabriclite.accelerators import Accelerator
from fabriclite.checkpoint import (
    META_KEY,
    atomic_save,
    checkpoint_into_state,
    read_checkpoint,
    state_to_checkpoint,
)
from fabriclite.precision import Precision


class Strategy:
    """What a strategy does: place the module, wrap it for its kind of parallelism, run collectives, checkpoint.

    Usage: subclass and fill in the hooks; ``Fabric(strategy=MyStrategy())`` uses it.
    """

    launcher: Any = None  # set by strategies that start processes; collectives need launch() first then

    def __init__(self) -> None:
        self.accelerator: Accelerator | None = None
        self.precision: Precision | None = None
        self.root_device = torch.device("cpu")

    # Process layout.
    @property
    def world_size(self) -> int:
        return 1

    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    def setup_environment(self) -> None:
        """Called in each process once it runs (after launch): pick the device, join process groups."""
        assert self.accelerator is not None
        self.root_device = self.accelerator.device(self.local_rank)
        self.accelerator.setup_device(self.root_device)

    # Modules and optimizers.
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Wrap the module for this strategy's parallelism (DDP, FSDP); the single device returns it as is."""
        return module

    def compile_module(self, module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.nn.Module:
        """Apply ``torch.compile`` to the (already wrapped) module; strategies with units compile those first."""
        return torch.compile(module, **kwargs)

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def module_init_context(self, empty_init: bool | None = None) -> ContextManager:
        """Where modules are built: on the root device; with ``empty_init`` the weight init functions are skipped
        (the weights will be overwritten by a checkpoint anyway)."""
        return _SkipInit() if empty_init else nullcontext()

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager:
        return nullcontext()

    def process_dataloader(self, dataloader: Any, use_distributed_sampler: bool) -> Any:
        return dataloader

    def clip_gradients_norm(
        self, module: torch.nn.Module, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(
            module.parameters(), max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    # Collectives: one process has nothing to exchange.
    def barrier(self, name: str | None = None) -> None:
        pass

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return tensor

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: str = "mean") -> torch.Tensor:
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        return [obj]

    def teardown(self) -> None:
        pass

    # Checkpoints: one file, written by rank 0; strategies with sharded state override these two.
    def save_checkpoint(
        self, path: Any, state: Mapping[str, Any], meta: dict[str, Any], filter: Mapping[str, Callable] | None = None
    ) -> None:
        """Write ``state`` (objects turned into state dicts) plus fabriclite's ``meta`` atomically to ``path``."""
        checkpoint = state_to_checkpoint(state, filter)
        checkpoint[META_KEY] = meta
        if self.is_global_zero:
            atomic_save(checkpoint, path)
        self.barrier("save")

    def load_checkpoint(
        self, path: Any, state: dict[str, Any] | None, strict: bool = True, weights_only: bool = True
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Load ``path`` into ``state`` in place; return (what ``state`` did not consume, fabriclite's meta)."""
        if os.path.isdir(path):  # a sharded checkpoint written under FSDP: read whole into this process's tensors
            from fabriclite.fsdp import load_sharded_checkpoint

            return load_sharded_checkpoint(path, state, strict, weights_only)
        checkpoint, meta = read_checkpoint(path, weights_only=weights_only)
        if state is None:
            return checkpoint, meta
        return checkpoint_into_state(checkpoint, state, strict, path), meta

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
    """One process on one device. Usage: ``Fabric(strategy="single_device")`` or the default for one device."""


def select_strategy(strategy: Any, accelerator: Accelerator, num_nodes: int) -> Strategy:
    """Build the strategy object for a parsed strategy name (or take the user's object).

    Usage: ``select_strategy("auto", CPUAccelerator([0]), num_nodes=1)``.
    """
    processes = len(accelerator.device_indices) * num_nodes
    if isinstance(strategy, Strategy):
        return strategy
    if strategy in ("auto", "single_device") and processes == 1:
        return SingleDeviceStrategy()
    if strategy == "single_device":
        raise ValueError(
            f"strategy='single_device' runs one process, but devices * num_nodes = {processes}. "
            "Use devices=1, or a distributed strategy."
        )
    if strategy in ("auto", "ddp", "ddp_spawn"):
        from fabriclite.ddp import DDPStrategy

        return DDPStrategy(start_method="spawn" if strategy == "ddp_spawn" else "subprocess")
    if strategy == "fsdp":  # also on one process: a group of one, so checkpoints and DTensors look the same
        try:
            from fabriclite.fsdp import FSDPStrategy
        except ImportError as err:  # FSDP2's public fully_shard arrived in torch 2.6
            raise RuntimeError(
                f"strategy='fsdp' uses FSDP2 (torch.distributed.fsdp.fully_shard), which needs torch >= 2.6; this is "
                f"torch {torch.__version__} ({err}). Upgrade torch, or use strategy='ddp'."
            ) from err
        return FSDPStrategy()
    raise NotImplementedError(
        f"strategy={strategy!r} is not available yet in this version of fabriclite. "
        "Use strategy='ddp' for several processes, or 'auto'/'single_device' for one."
    )
