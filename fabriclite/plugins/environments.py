"""Where this process sits in a job: rank, world size, main address. Read from whoever started the processes
(torchrun/torchelastic, SLURM's srun, plain environment variables, or fabriclite's own launcher), plus the two
facts about this machine that launching needs: a free port, and how many CPU threads each process gets.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass

__all__ = [
    "ClusterEnvironment",
    "LightningEnvironment",
    "ProcessEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "cpu_oversubscription_hint",
    "cpu_threads_per_process",
    "detect_environment",
    "free_port",
    "slurm_local_launch",
]


@dataclass(frozen=True)
class ProcessEnvironment:
    """This process's place in the job. ``external`` is True when something other than fabriclite started it."""

    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int
    main_address: str
    main_port: int
    source: str
    external: bool = True


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"Environment variable {name}={value!r} must be an integer.") from None


def _first_slurm_host(nodelist: str) -> str:
    # "node[03-05,09],gpu1" -> "node03" (also "a b c" -> "a"): the first host is the main process's node.
    match = re.match(r"([^,\[\s]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


class ClusterEnvironment(ABC):
    """Who started this process and where it sits in the job, at Lightning Fabric's import path. A subclass reads
    one launcher's variables; ``read()`` gives the ``ProcessEnvironment`` fabriclite works from, or None when that
    launcher did not start this process. ``Fabric(plugins=[SLURMEnvironment()])`` uses the one given instead of
    detecting it.

    Usage: ``TorchElasticEnvironment.detect() and TorchElasticEnvironment().global_rank()``.
    """

    source = "env"

    @staticmethod
    @abstractmethod
    def detect() -> bool:
        """Whether this process runs under this launcher."""

    @abstractmethod
    def read(self) -> ProcessEnvironment | None:
        """This process's place in the job, or None when this launcher did not start it."""

    @property
    def creates_processes_externally(self) -> bool:
        """Whether this launcher started this process (then Fabric starts no processes of its own)."""
        return self.read() is not None

    @property
    def main_address(self) -> str:
        """The host of rank 0, where the process group meets."""
        return self._read_or_fail().main_address

    @property
    def main_port(self) -> int:
        """The port on ``main_address`` where the process group meets."""
        return self._read_or_fail().main_port

    def world_size(self) -> int:
        """How many processes the job has."""
        return self._read_or_fail().world_size

    def global_rank(self) -> int:
        """This process's rank among all of them."""
        return self._read_or_fail().global_rank

    def local_rank(self) -> int:
        """This process's rank on its node (which GPU it uses)."""
        return self._read_or_fail().local_rank

    def node_rank(self) -> int:
        """The rank of this process's node."""
        return self._read_or_fail().node_rank

    def set_world_size(self, size: int) -> None:
        """The launcher sets the world size; a value given here that differs from it is an error."""
        if self.world_size() != size:
            raise ValueError(f"{type(self).__name__} says the world size is {self.world_size()}, not {size}.")

    def set_global_rank(self, rank: int) -> None:
        """The launcher sets the rank; a value given here that differs from it is an error."""
        if self.global_rank() != rank:
            raise ValueError(f"{type(self).__name__} says this process is rank {self.global_rank()}, not {rank}.")

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Raise when the launcher started a different number of processes than ``num_devices * num_nodes``."""
        environment = self.read()
        if environment is not None and environment.world_size != num_devices * num_nodes:
            raise ValueError(
                f"{environment.source} started {environment.world_size} processes, but devices * num_nodes = "
                f"{num_devices} * {num_nodes} = {num_devices * num_nodes}. Make them match."
            )

    def teardown(self) -> None:
        """Nothing to undo: reading the environment changes nothing."""
        return None

    def _read_or_fail(self) -> ProcessEnvironment:
        environment = self.read()
        if environment is None:
            raise RuntimeError(
                f"This process was not started by {self.source}: {type(self).__name__} has nothing to read."
            )
        return environment

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class TorchElasticEnvironment(ClusterEnvironment):
    """torchrun (torchelastic): RANK, WORLD_SIZE, LOCAL_RANK, GROUP_RANK, MASTER_ADDR and MASTER_PORT."""

    source = "torchelastic"

    @staticmethod
    def detect() -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ

    def read(self) -> ProcessEnvironment | None:
        if not self.detect():
            return None
        return ProcessEnvironment(
            world_size=_env_int("WORLD_SIZE"),
            global_rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            node_rank=int(os.environ.get("GROUP_RANK", "0")),
            main_address=os.environ["MASTER_ADDR"],
            main_port=_env_int("MASTER_PORT"),
            source=self.source,
        )


class LightningEnvironment(ClusterEnvironment):
    """Plain variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (NODE_RANK optional), as set by
    ``fabriclite run``, Lightning's ``fabric run`` or by hand. Like Lightning's, it is always available."""

    _NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @staticmethod
    def detect() -> bool:
        return True

    def read(self) -> ProcessEnvironment | None:
        if not all(name in os.environ for name in self._NAMES):
            return None
        return ProcessEnvironment(
            world_size=_env_int("WORLD_SIZE"),
            global_rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            node_rank=int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))),
            main_address=os.environ["MASTER_ADDR"],
            main_port=_env_int("MASTER_PORT"),
            source=os.environ.get("FABRICLITE_LAUNCHER", self.source),
            external=os.environ.get("FABRICLITE_LAUNCHER") is None,
        )


class SLURMEnvironment(ClusterEnvironment):
    """SLURM. Processes join as ranks when ``srun`` started them as the tasks of one job step (SLURM_STEP_ID set,
    more than one task: SLURM_STEP_NUM_TASKS, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID); the main address is
    MASTER_ADDR or the first node of the step, the port MASTER_PORT or one derived from the job id. A batch script, an
    ``salloc`` shell, a step of one task (``srun --pty bash``) and a command typed in an ``srun --pty`` terminal are
    not tasks to join: there ``fabric.launch()`` starts the processes on this node (``slurm_local_launch``).

    ``requeue_signal`` (default SIGUSR1) is a preemption notice for this run, as SIGTERM and SIGUSR1 always are:
    ``fabric.preempted`` becomes True on every rank, the script saves and exits 75, and the job is requeued with
    ``scontrol requeue``; ``auto_requeue=False`` saves and exits 75 without requeuing. Lightning's signature.

    Usage: ``Fabric(plugins=[SLURMEnvironment(requeue_signal=signal.SIGUSR2)])`` with ``#SBATCH --signal=USR2@120``.
    """

    source = "slurm"

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        if not isinstance(auto_requeue, bool):
            raise TypeError(
                f"SLURMEnvironment(auto_requeue={auto_requeue!r}) must be True (requeue the job after a preemption "
                "notice) or False (save and exit 75 without requeuing)."
            )
        self.auto_requeue = auto_requeue
        self.requeue_signal = signal.SIGUSR1 if requeue_signal is None else _catchable_signal(requeue_signal)

    @staticmethod
    def detect() -> bool:
        """Whether ``srun`` started this process as one of several tasks of a job step (then they join as ranks)."""
        return (_slurm_step_tasks() or 0) > 1

    @staticmethod
    def job_name() -> str | None:
        """The job's name (SLURM_JOB_NAME), or None outside SLURM."""
        return os.environ.get("SLURM_JOB_NAME")

    @staticmethod
    def job_id() -> int | None:
        """The job's id (SLURM_JOB_ID) as a number; None outside SLURM and, as in Lightning, in a job named "bash" or
        "interactive" (a shell to work in, whose runs should not share one id)."""
        job = os.environ.get("SLURM_JOB_ID", "")
        if not job.isdigit() or SLURMEnvironment.job_name() in _INTERACTIVE_JOB_NAMES:
            return None
        return int(job)

    @staticmethod
    def resolve_root_node_address(nodes: str) -> str:
        """The first host of a SLURM node list ("gpu[03-06],cpu1" -> "gpu03"), where rank 0 runs."""
        return _first_slurm_host(nodes)

    def read(self) -> ProcessEnvironment | None:
        if not self.detect():
            return None
        job_id = os.environ.get("SLURM_JOB_ID", "0")
        nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_NODELIST", "")
        return ProcessEnvironment(
            world_size=_slurm_step_tasks() or 1,
            global_rank=_env_int("SLURM_PROCID"),
            local_rank=_env_int("SLURM_LOCALID"),
            node_rank=_env_int("SLURM_NODEID"),
            main_address=os.environ.get("MASTER_ADDR") or _first_slurm_host(nodelist),
            main_port=int(os.environ.get("MASTER_PORT", 10000 + int(job_id[-4:] or 0))),
            source=self.source,
        )

    def __repr__(self) -> str:
        return f"SLURMEnvironment(auto_requeue={self.auto_requeue}, requeue_signal=signal.{self.requeue_signal.name})"


_INTERACTIVE_JOB_NAMES = ("bash", "interactive")  # SLURM's default names for `srun --pty bash` and salloc's shell
# Signals that cannot be a scheduler's notice: the kernel does not let a process catch the first two, and the others
# already mean something else (Ctrl-C, a child process ended, this process crashed).
_NOT_NOTICES = (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT, signal.SIGCHLD, signal.SIGSEGV, signal.SIGBUS,
                signal.SIGFPE, signal.SIGILL, signal.SIGABRT)  # fmt: skip


def _catchable_signal(value: object) -> signal.Signals:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"SLURMEnvironment(requeue_signal={value!r}) must be a signal, such as signal.SIGUSR2 (SLURM sends the one "
            "named in #SBATCH --signal=USR2@120), or None for SIGUSR1."
        )
    try:
        signum = signal.Signals(value)
    except ValueError:
        raise ValueError(f"SLURMEnvironment(requeue_signal={value!r}) is not a signal number on this system.") from None
    if signum in _NOT_NOTICES:
        why = "cannot be caught" if signum in (signal.SIGKILL, signal.SIGSTOP) else "means something else already"
        raise ValueError(
            f"SLURMEnvironment(requeue_signal=signal.{signum.name}): {signum.name} {why}, so it cannot serve as a "
            "preemption notice. Use SIGUSR1 (the default), SIGUSR2, SIGTERM or SIGHUP, with the same signal in "
            "#SBATCH --signal."
        )
    return signum


def _slurm_step_tasks() -> int | None:
    """How many tasks ``srun`` started in the job step this process is a task of, or None when it is no task of one:
    outside SLURM, in a batch script or an ``salloc`` shell (no job step: SLURM_STEP_ID unset, as SLURM's FAQ tells a
    batch script apart), or a command typed in the terminal of an ``srun --pty`` step (the task is the shell:
    SLURM_TASK_PID names another process, and this one reads that terminal)."""
    if "SLURM_PROCID" not in os.environ or not ({"SLURM_STEP_ID", "SLURM_STEPID"} & os.environ.keys()):
        return None
    task_pid = os.environ.get("SLURM_TASK_PID")
    if task_pid and task_pid != str(os.getpid()) and _reads_a_terminal():
        return None
    return _env_int("SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in os.environ else "SLURM_NTASKS")


def _reads_a_terminal() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def slurm_local_launch(processes: int, num_nodes: int) -> str | None:
    """In a SLURM job, where this process is none of srun's tasks and Fabric is to start ``processes`` processes on
    this node itself: the line to say so, once (None outside SLURM, or with nothing to start). Raises ValueError where
    that cannot be right: ``num_nodes > 1``, or an allocation of several nodes (all but this one would stay idle).

    Usage: ``line = slurm_local_launch(2, 1); if line: print(line, file=sys.stderr)``.
    """
    job = os.environ.get("SLURM_JOB_ID")
    if job is None or (processes <= 1 and num_nodes <= 1):
        return None
    if {"SLURM_STEP_ID", "SLURM_STEPID"} & os.environ.keys():
        why = "a step of one task, such as `srun --pty bash`, or a command typed in a step's shell"
    else:
        why = "no job step: a batch script or an salloc shell"
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    wanted = max(num_nodes, nodes)
    import shlex  # only for this message

    srun = f"srun --nodes={wanted} --ntasks-per-node={processes} python {shlex.join(sys.argv)}"
    if num_nodes > 1:
        raise ValueError(
            f"Fabric(num_nodes={num_nodes}) in SLURM job {job}, but this process is not one of srun's tasks ({why}), "
            f"and fabric.launch() starts processes on this node only. Let SLURM start one task per device on every "
            f"node: `{srun}` (in an sbatch script with #SBATCH --nodes={num_nodes} --ntasks-per-node={processes})."
        )
    if nodes > 1:
        raise ValueError(
            f"SLURM job {job} has {nodes} nodes (SLURM_JOB_NUM_NODES={nodes}), but this process is not one of srun's "
            f"tasks ({why}): fabric.launch() would start the {processes} processes on this node only and leave the "
            f"others idle. Run `{srun}` with Fabric(num_nodes={nodes}), or ask SLURM for one node (--nodes=1)."
        )
    return (
        f"fabriclite: SLURM job {job}, but this process is not one of srun's tasks ({why}): fabric.launch() starts "
        f"the {processes} processes on this node itself. To have SLURM start them instead: `{srun}`."
    )


def detect_environment(given: ClusterEnvironment | None = None) -> ProcessEnvironment | None:
    """Return the environment of an already launched process, or None when this is a plain single process.
    ``given`` (a ``Fabric(plugins=[...])`` environment) is read instead of looking at every launcher; where it did
    not start this process but fabriclite's own launcher did (``SLURMEnvironment()`` in a batch script whose
    ``fabric.launch()`` started the ranks), the variables that launcher set are read.

    Usage: ``env = detect_environment(); env.global_rank if env else 0``.
    """
    if given is not None:
        environment = given.read()
        if environment is None and "FABRICLITE_LAUNCHER" in os.environ:
            return LightningEnvironment().read()
        return environment
    for kind in (TorchElasticEnvironment, LightningEnvironment, SLURMEnvironment):
        environment = kind().read()
        if environment is not None:
            return environment
    return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on right now, on ``host`` (default: loopback; ``""``: every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cpu_threads_per_process(local_processes: int) -> int:
    """The CPU threads each of ``local_processes`` processes on this machine gets, so that together they use every
    core once (torch would give each process every core, and they would fight over them).

    Usage: ``torch.set_num_threads(cpu_threads_per_process(2))``.
    """
    return max(1, (os.cpu_count() or 1) // local_processes)


def cpu_oversubscription_hint(local_processes: int) -> str | None:
    """A hint to print when ``local_processes`` CPU processes outnumber this machine's cores (each then gets less
    than one core, and the run is slower than with fewer processes); None when they fit.

    Usage: ``hint = cpu_oversubscription_hint(8); if hint: print(hint, file=sys.stderr)``.
    """
    cores = os.cpu_count() or 1
    if local_processes <= cores:
        return None
    return (
        f"fabriclite: starting {local_processes} processes on a CPU with {cores} core(s): each gets less than one "
        f"core, so they take turns and the run is slower than with {cores} (devices={cores}). Fine for trying out "
        "several processes; for speed, use at most as many devices as cores."
    )
