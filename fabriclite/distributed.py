"""What every multi-process strategy shares: the process group, the collectives, and sharding the data.

Imported only when a strategy with more than one process is chosen, so single-process scripts never load
``torch.distributed``'s heavier parts.
"""

from __future__ import annotations

import atexit
import copy
import gc
import os
import sys
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from fabriclite.environment import ProcessEnvironment, detect_environment
from fabriclite.launcher import SpawnLauncher, SubprocessLauncher
from fabriclite.strategies import Strategy

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class FabricDistributedSampler(DistributedSampler):
    """``DistributedSampler`` that can say which of this rank's samples are padding (repeated to even out ranks),
    so metrics can drop them. Over a user's own sampler, it shards that sampler's indices, drawn anew each epoch.

    Usage: made by ``fabric.setup_dataloaders``; ``sampler.padding_mask(start, count)``.
    """

    def __init__(self, dataset: Any, source: Sampler | None = None, **kwargs: Any) -> None:
        self.source = source
        super().__init__(dataset if source is None else range(len(source)), **kwargs)
        self.real_size = len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        if self.source is None:
            return super().__iter__()
        # Every rank must draw the same order from the user's sampler, whatever its global random state: draw it
        # from a generator seeded by (seed, epoch), leaving the global stream untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            drawn = list(self.source)
        return (drawn[i] for i in super().__iter__())

    def padding_mask(self, start: int, count: int) -> torch.Tensor:
        """True for this rank's samples ``start .. start+count-1`` that are repeats of other samples."""
        positions = self.rank + self.num_replicas * torch.arange(start, start + count)
        return positions >= self.real_size


class ParallelStrategy(Strategy):
    """A strategy running one process per device, joined in a ``torch.distributed`` process group.

    ``timeout`` bounds how long a collective waits for a rank that died or hangs before raising.
    """

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: str = "subprocess",
    ) -> None:
        super().__init__()
        if start_method not in ("subprocess", "spawn"):
            raise ValueError(f"start_method={start_method!r} is not supported. Valid choices: 'subprocess', 'spawn'.")
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout={timeout!r} must be a datetime.timedelta.")
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.start_method = start_method
        self.num_nodes = 1
        self.environment: ProcessEnvironment | None = None
        self.launcher: Any = None

    def configure(self, accelerator: Any, num_nodes: int) -> None:
        """Called by Fabric once the accelerator is known: read the environment, pick the launcher."""
        self.accelerator = accelerator
        self.num_nodes = num_nodes
        processes = len(accelerator.device_indices)
        expected = processes * num_nodes
        self.environment = detect_environment()
        if self.environment is not None and self.environment.external:
            if self.environment.world_size != expected:
                raise ValueError(
                    f"This process was launched by {self.environment.source} with WORLD_SIZE={self.environment.world_size}, "
                    f"but Fabric was configured for devices * num_nodes = {processes} * {num_nodes} = {expected}. "
                    "Make them match."
                )
            self.launcher = _ExternalLauncher()
        elif num_nodes > 1:
            raise ValueError(
                f"num_nodes={num_nodes} needs the processes to be started by torchrun, SLURM or "
                "`fabriclite run --num-nodes`; a plain `python script.py` starts processes on one node only."
            )
        else:
            self.launcher = SpawnLauncher(processes) if self.start_method == "spawn" else SubprocessLauncher(processes)
        self.root_device = accelerator.device(self.local_rank)

    # Process layout: from whoever started this process, else from the variables our own launcher set.
    @property
    def world_size(self) -> int:
        if self.environment is not None:
            return self.environment.world_size
        return (
            int(os.environ.get("WORLD_SIZE", len(self.accelerator.device_indices) * self.num_nodes))
            if self.accelerator
            else 1
        )

    @property
    def global_rank(self) -> int:
        return self.environment.global_rank if self.environment is not None else int(os.environ.get("RANK", 0))

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank if self.environment is not None else int(os.environ.get("LOCAL_RANK", 0))

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank if self.environment is not None else int(os.environ.get("NODE_RANK", 0))

    def setup_environment(self) -> None:
        """Join the process group (gloo on CPU, nccl on CUDA) and give each CPU process its share of the cores."""
        super().setup_environment()
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            local_processes = len(self.accelerator.device_indices)
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_processes))
        if not dist.is_initialized():
            backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            if self.environment is not None:  # e.g. SLURM names the main node but sets no MASTER_* variables
                os.environ.setdefault("MASTER_ADDR", self.environment.main_address)
                os.environ.setdefault("MASTER_PORT", str(self.environment.main_port))
            dist.init_process_group(
                backend, init_method="env://", rank=self.global_rank, world_size=self.world_size, timeout=self.timeout
            )
            # A gloo group still alive when the interpreter exits can abort the process (SIGABRT): close it first.
            atexit.register(self.teardown)

    def teardown(self) -> None:
        if not dist.is_initialized():
            return
        # Objects still holding the group (compiled graphs, device meshes, reference cycles) would keep its gloo
        # threads alive into interpreter finalization, where destroying them can abort the process. Release them
        # while the interpreter is still whole.
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            dynamo.reset()
        gc.collect()
        dist.destroy_process_group()
        gc.collect()

    # Data.
    def process_dataloader(self, dataloader: DataLoader, use_distributed_sampler: bool) -> DataLoader:
        """Give each rank its shard: a copy of the loader with a distributed sampler, keeping shuffle and seed."""
        if not use_distributed_sampler or isinstance(dataloader.dataset, IterableDataset):
            return dataloader
        sampler = dataloader.sampler
        if isinstance(sampler, DistributedSampler):
            return dataloader
        seed = int(os.environ.get("FABRICLITE_GLOBAL_SEED", 0))
        common = {"num_replicas": self.world_size, "rank": self.global_rank, "seed": seed, "drop_last": False}
        if type(sampler) in (RandomSampler, SequentialSampler) and getattr(sampler, "generator", None) is None:
            new_sampler = FabricDistributedSampler(
                dataloader.dataset, shuffle=isinstance(sampler, RandomSampler), **common
            )
        else:
            new_sampler = FabricDistributedSampler(dataloader.dataset, source=sampler, shuffle=False, **common)
        sharded = copy.copy(dataloader)
        object.__setattr__(sharded, "_iterator", None)
        object.__setattr__(sharded, "sampler", new_sampler)
        batch_sampler = dataloader.batch_sampler
        if batch_sampler is not None:
            if type(batch_sampler) is not BatchSampler:
                raise ValueError(
                    f"The DataLoader uses a custom batch_sampler ({type(batch_sampler).__name__}), which fabriclite "
                    "cannot shard. Shard it yourself and pass use_distributed_sampler=False."
                )
            object.__setattr__(
                sharded, "batch_sampler", BatchSampler(new_sampler, batch_sampler.batch_size, batch_sampler.drop_last)
            )
        return sharded

    # Collectives.
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            return [obj]
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized():
            return tensor
        result = tensor.clone()
        if reduce_op == "mean" and not result.is_floating_point():
            result = result.float()
        dist.all_reduce(result, op=_REDUCE_OPS[reduce_op], group=group)
        if reduce_op == "mean":
            result /= dist.get_world_size(group)
        return result

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        """Stack every rank's tensor along a new first dimension; when first dimensions differ, return the list."""
        if not dist.is_initialized():
            return tensor
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        # Shapes as objects: ranks may even differ in the number of dimensions (e.g. an empty tensor).
        shapes = [None] * world
        dist.all_gather_object(shapes, tuple(tensor.shape), group=group)
        shape = tuple(tensor.shape)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather as all_gather_with_grad

        if all(s == shape for s in shapes):
            if sync_grads:
                return torch.stack(all_gather_with_grad(tensor, group=group or dist.group.WORLD))
            parts = [torch.empty_like(tensor) for _ in range(world)]
            dist.all_gather(parts, tensor, group=group)
            return torch.stack(parts)
        if tensor.dim() == 0 or any(len(s) != len(shape) or s[1:] != shape[1:] for s in shapes):
            # Every rank sees the same shapes, so every rank raises here: nobody is left waiting.
            raise ValueError(
                f"all_gather needs tensors that differ at most in their first dimension; got shapes {shapes}."
            )
        longest = max(s[0] for s in shapes)
        padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.shape[0]] = tensor
        if sync_grads:
            parts = list(all_gather_with_grad(padded, group=group or dist.group.WORLD))
        else:
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded, group=group)
        return [part[: s[0]] for part, s in zip(parts, shapes)]

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> ContextManager:
        return nullcontext()


class _ExternalLauncher:
    """Processes started by torchrun, SLURM or the user: nothing to start."""

    def start(self) -> None:
        pass
