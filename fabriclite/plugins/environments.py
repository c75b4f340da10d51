"""Where this process sits in a job: rank, world size, main address. Read from whoever started the processes
(torchrun/torchelastic, SLURM's srun, plain environment variables, or fabriclite's own launcher), plus the two
facts about this machine that launching needs: a free port, and how many CPU threads each process gets.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass


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
    # "node[03-05,09],gpu1" -> "node03": the first host is the main process's node.
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist)
    if not match:
        return "127.0.0.1"
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def detect_environment() -> ProcessEnvironment | None:
    """Return the environment of an already launched process, or None when this is a plain single process.

    Usage: ``env = detect_environment(); env.global_rank if env else 0``.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return ProcessEnvironment(
            world_size=_env_int("WORLD_SIZE"),
            global_rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            node_rank=int(os.environ.get("GROUP_RANK", "0")),
            main_address=os.environ["MASTER_ADDR"],
            main_port=_env_int("MASTER_PORT"),
            source="torchelastic",
        )
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")):
        return ProcessEnvironment(
            world_size=_env_int("WORLD_SIZE"),
            global_rank=_env_int("RANK"),
            local_rank=_env_int("LOCAL_RANK"),
            node_rank=int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))),
            main_address=os.environ["MASTER_ADDR"],
            main_port=_env_int("MASTER_PORT"),
            source=os.environ.get("FABRICLITE_LAUNCHER", "env"),
            external=os.environ.get("FABRICLITE_LAUNCHER") is None,
        )
    # srun starts one task per process; an interactive `srun --pty bash` shell is not a job to join.
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        job_id = os.environ.get("SLURM_JOB_ID", "0")
        return ProcessEnvironment(
            world_size=_env_int("SLURM_NTASKS"),
            global_rank=_env_int("SLURM_PROCID"),
            local_rank=_env_int("SLURM_LOCALID"),
            node_rank=_env_int("SLURM_NODEID"),
            main_address=os.environ.get("MASTER_ADDR") or _first_slurm_host(os.environ.get("SLURM_NODELIST", "")),
            main_port=int(os.environ.get("MASTER_PORT", 10000 + int(job_id[-4:] or 0))),
            source="slurm",
        )
    return None


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cpu_threads_per_process(local_processes: int) -> int:
    """The CPU threads each of ``local_processes`` processes on this machine gets, so that together they use every
    core once (torch would give each process every core, and they would fight over them).

    Usage: ``torch.set_num_threads(cpu_threads_per_process(2))``.
    """
    return max(1, (os.cpu_count() or 1) // local_processes)
