"""What every multi-process strategy shares: the launcher, the process group, the collectives, and sharding the
data. Imported only when a strategy with more than one process is chosen, so single-process scripts never load
``torch.distributed``'s heavier parts.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from fabriclite import collectives
from fabriclite.processes import preemption, signals, torchelastic
from fabriclite.accelerators import Accelerator
from fabriclite.checkpoint import CheckpointIO
from fabriclite.data import distributed_loader
from fabriclite.processes.launcher import InProcessLauncher, MultiprocessingLauncher, SubprocessLauncher
from fabriclite.plugins.environments import (
    ClusterEnvironment,
    ProcessEnvironment,
    cpu_oversubscription_hint,
    cpu_threads_per_process,
    detect_environment,
    slurm_local_launch,
)
from fabriclite.rank_zero import log, rank_zero_info, rank_zero_only
from fabriclite.strategies.strategy import Strategy
from fabriclite.processes.watchdog import StallWatchdog, saying_who_has_not_joined
from fabriclite._versions import reset_compiler

# How a launch starts the processes: run the script again ("popen" is Lightning's name for it), or multiprocessing.
_JOIN_TIMEOUT = timedelta(minutes=30)  # the longest a process waits for the others to start and join
_START_METHODS = ("subprocess", "popen", "spawn", "fork")


class ParallelStrategy(Strategy):
    """A strategy running one process per device, joined in a ``torch.distributed`` process group.

    ``timeout`` bounds how long a collective waits for a rank that died or hangs before raising. ``stall_timeout``
    (seconds; None turns it off) is when a rank waiting in a collective first prints which ranks have not arrived
    and where each one is (``fabriclite.processes.watchdog``), and when a slow start says which processes have not joined.

    Fabric's own collectives (``barrier``, ``broadcast``, the gathers and reductions without a ``group``, and so
    the first collective of a save or load) run over ``calls_group``, a process group of their own: a call made on
    some ranks only then waits there, never pairing with the other ranks' training collectives (DDP's and FSDP's
    stay on their groups), until the watchdog proves it and ends the run saying which call. Where the process
    group existed before (the user's own ``init_process_group``), they run over the default group, as then.
    """

    syncs_in_forward = True

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        start_method: str = "subprocess",
        checkpoint_io: CheckpointIO | None = None,
        stall_timeout: float | None = 60.0,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io)
        if cluster_environment is not None and not isinstance(cluster_environment, ClusterEnvironment):
            raise TypeError(
                f"cluster_environment={cluster_environment!r} must be a fabriclite.plugins.environments."
                "ClusterEnvironment (LightningEnvironment, TorchElasticEnvironment, SLURMEnvironment), or None to detect it."
            )
        self.cluster_environment = cluster_environment
        if start_method not in _START_METHODS:
            raise ValueError(
                f"start_method={start_method!r} is not supported. Valid choices: {', '.join(map(repr, _START_METHODS))}."
            )
        if not isinstance(timeout, timedelta):
            raise TypeError(f"timeout={timeout!r} must be a datetime.timedelta.")
        if stall_timeout is not None and (
            isinstance(stall_timeout, bool) or not isinstance(stall_timeout, (int, float)) or not stall_timeout > 0
        ):
            raise ValueError(
                f"stall_timeout={stall_timeout!r} must be a number of seconds > 0, or None to turn it off."
            )
        self.stall_timeout = stall_timeout
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.start_method = start_method
        self.num_nodes = 1
        self.local_processes = 1

    def _process_state(self) -> dict[str, Any]:
        environment: ProcessEnvironment | None = None  # read in configure, or once our launcher has set it
        watchdog: StallWatchdog | None = None
        state = {"environment": environment, "watchdog": watchdog, "calls_group": None, "_store": None}
        return {**super()._process_state(), **state}

    def configure(self, accelerator: Accelerator, num_nodes: int = 1) -> None:
        """Read the environment: processes that are already running join it; otherwise pick the launcher that
        starts them (then this process becomes rank 0)."""
        self.accelerator = accelerator
        self.num_nodes = num_nodes
        self.local_processes = len(accelerator.device_indices)
        expected = self.local_processes * num_nodes
        self.environment = detect_environment(self.cluster_environment)
        # In a SLURM job outside srun's tasks (a batch script, an salloc shell): start them here, or refuse at once.
        outside_srun = None if self.environment else slurm_local_launch(self.local_processes, num_nodes)
        if self.environment is not None:
            if self.environment.world_size != expected:
                stale = ""
                if self.environment.external and self.environment.source == "env":
                    stale = (
                        " If RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT are left over from another job "
                        "or your shell, unset them and Fabric starts its processes itself."
                    )
                raise ValueError(
                    f"This process was launched by {self.environment.source} with WORLD_SIZE={self.environment.world_size}, "
                    f"but Fabric was configured for devices * num_nodes = {self.local_processes} * {num_nodes} = "
                    f"{expected}. Make them match.{stale}"
                )
            self.launcher = InProcessLauncher()
        elif num_nodes > 1:
            raise ValueError(
                f"num_nodes={num_nodes} needs the processes to be started by torchrun, SLURM or "
                "`fabriclite run --num-nodes`; a plain `python script.py` starts processes on one node only."
            )
        elif self.start_method in ("subprocess", "popen"):
            self.launcher = SubprocessLauncher(self.local_processes)
        else:
            self.launcher = MultiprocessingLauncher(self.local_processes, self.start_method)
        if outside_srun:
            print(outside_srun, file=sys.stderr, flush=True)
        self.root_device = accelerator.device(self.local_rank)

    # Process layout: from whoever started this process; before launching, this process is rank 0 of the planned run.
    @property
    def world_size(self) -> int:
        return self.environment.world_size if self.environment else self.local_processes * self.num_nodes

    @property
    def global_rank(self) -> int:
        return self.environment.global_rank if self.environment else 0

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank if self.environment else 0

    @property
    def node_rank(self) -> int:
        return self.environment.node_rank if self.environment else 0

    def setup_environment(self) -> None:
        """Join the process group (gloo on CPU, nccl on CUDA) and give each CPU process its share of the cores."""
        if self.environment is None:  # our own launcher has just put this process's rank in the environment
            self.environment = detect_environment(self.cluster_environment)
        super().setup_environment()
        rank_zero_only.rank = self.global_rank  # a forked or spawned process imported it before it knew its rank
        if dist.is_initialized():  # the user's own group (Lightning's RL example: trainers in a group of theirs)
            return
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(cpu_threads_per_process(self.local_processes))
        hint = cpu_oversubscription_hint(self.local_processes) if self.root_device.type == "cpu" else None
        if hint and self.local_rank == 0:  # however the processes were started
            print(hint, file=sys.stderr, flush=True)
        backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        if self.environment is not None:  # e.g. SLURM names the main node but sets no MASTER_* variables
            os.environ.setdefault("MASTER_ADDR", self.environment.main_address)
            os.environ.setdefault("MASTER_PORT", str(self.environment.main_port))
        torchelastic.die_with_agent()  # under `fabriclite run --num-nodes`: its agent started this rank
        signals.install(self.global_rank)  # done at Fabric creation; this names the rank in what it says
        signals.forward_to(getattr(self.launcher, "children", []))
        with saying_who_has_not_joined(self.environment, self.stall_timeout):
            # `timeout` bounds the collectives; joining waits longer, for processes that are slow to start (a loaded
            # machine takes seconds to import torch) rather than failing a run with a short collective timeout.
            join_timeout = max(self.timeout, _JOIN_TIMEOUT)
            store, rank, world_size = next(
                dist.rendezvous("env://", rank=self.global_rank, world_size=self.world_size, timeout=join_timeout)
            )
            generation = None
            if torchelastic.uses_agent_store():  # torchrun's store outlives a restarted group: a fresh part of it
                generation = torchelastic.join(store, rank, world_size, join_timeout)
                store = generation.store
            log.info(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{world_size}")
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=self.timeout)
            self.calls_group = dist.new_group(timeout=self.timeout)
            self._store = store  # rank 0 serves it: kept until this process ends, for the ranks' last words
        rank_zero_info(  # Lightning's words
            f"{'-' * 100}\ndistributed_backend={backend}\n"
            f"All distributed processes registered. Starting with {world_size} processes\n{'-' * 100}\n"
        )
        if generation is not None:
            generation.watch()
        if self.stall_timeout is not None and self.world_size > 1:
            prefix = generation.prefix if generation is not None else ""
            self.watchdog = StallWatchdog(
                self.global_rank,
                self.world_size,
                self.stall_timeout,
                self.timeout,
                prefix,
                groups=self._counted_groups,
            )
            self.watchdog.start()
        # A gloo group still alive when the interpreter exits can abort the process (SIGABRT): close it first.
        atexit.register(self.teardown)

    def teardown(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        if not dist.is_initialized():
            return
        preemption.settle()  # fabric.preempted's last all-reduce, still referenced, must not outlive the group
        # Objects still holding the group (compiled graphs, device meshes, reference cycles) would keep its gloo
        # threads alive into interpreter finalization, where destroying them can abort the process. Release them
        # while the interpreter is still whole.
        reset_compiler()
        gc.collect()
        dist.destroy_process_group()
        self.calls_group = None
        gc.collect()

    def _counted_groups(self) -> tuple[Any, list[Any]]:
        # What the watchdog counts: the calls group, and the groups the training issues its collectives on in
        # program order: the default one, and a device mesh's (FSDP, tensor parallel). Not those of background
        # threads (the asynchronous checkpoint writer's), whose order against the step is not fixed.
        if self.calls_group is None or not dist.is_initialized():
            return None, []
        mesh = self.__dict__.get("mesh")
        training = [dist.group.WORLD, *(mesh.get_all_groups() if mesh is not None else [])]
        return self.calls_group, list({id(group): group for group in training}.values())

    def _call(self, collective: Any, *args: Any, **kwargs: Any) -> Any:
        """``collective(*args, group=calls_group, **kwargs)``; when it fails because a rank went past a call it did
        not make and ended (closing the group), the watchdog's explanation is raised instead of the backend's."""
        try:
            return collective(*args, group=self.calls_group, **kwargs)
        except RuntimeError:
            explained = self.watchdog.explain() if self.watchdog is not None else None
            if explained is None:
                raise
            raise RuntimeError(explained) from None

    def process_dataloader(self, dataloader: DataLoader, use_distributed_sampler: bool) -> DataLoader:
        """Give each rank its shard: a copy of the loader with a distributed sampler, keeping shuffle and seed."""
        if not use_distributed_sampler:
            return dataloader
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))  # seed_everything exports it, as Lightning
        replicas, rank = self.data_parallel_shard()
        return distributed_loader(dataloader, replicas, rank, seed)

    def data_parallel_shard(self) -> tuple[int, int]:
        """(how many different shards of the data there are, which one this rank reads): one per rank here."""
        return self.world_size, self.global_rank

    # Collectives: before the process group exists (or after teardown) there is nobody to exchange with. Without a
    # group of the caller's, over the calls group (see the class's docstring).
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            self._call(dist.barrier)

    # DTensors (FSDP parameters) take part with their full value: see fabriclite.collectives.
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        return self._call(collectives.broadcast_object, collectives.full_value(obj), src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self._call(collectives.all_gather_object, obj) if dist.is_initialized() else [obj]

    def all_reduce(self, tensor: torch.Tensor, group: Any = None, reduce_op: str = "mean") -> torch.Tensor:
        if not dist.is_initialized():
            return tensor
        if group is not None:
            return collectives.all_reduce(collectives.full_value(tensor), reduce_op, group)
        return self._call(collectives.all_reduce, collectives.full_value(tensor), reduce_op)

    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> Any:
        """Stack every rank's tensor along a new first dimension; when first dimensions differ, return the list."""
        if not dist.is_initialized():
            return tensor
        if group is not None:
            return collectives.all_gather(collectives.full_value(tensor), group, sync_grads)
        return self._call(collectives.all_gather, collectives.full_value(tensor), sync_grads=sync_grads)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        # First a barrier over the calls group: a sharded load's own collectives run on the default group, where a
        # load made on some ranks only would pair with the others' training.
        self.barrier("load")
        return super().load_checkpoint(*args, **kwargs)
