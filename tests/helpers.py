"""What tests need to run real processes: one place, every call with a timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
# What launchers (torchrun, SLURM, ours) set to tell a process its rank: a test of a plain process clears them.
LAUNCH_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NODE_RANK",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "FABRICLITE_LAUNCHER",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_NUM_NODES",
    "SLURM_STEP_NODELIST",
    "SLURM_TASK_PID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
]


def passed(output: str) -> set[tuple[str, str]]:
    """The ``(rank, check name)`` pairs of the "PASS <rank> <name>" lines a check script printed (ranks share one
    pipe, so a line may run into the next one's PASS or DONE)."""
    return set(re.findall(r"PASS ([0-9]+) ([^\n]+?)(?=PASS |DONE |\n|$)", output))


def assert_passed(output: str, names: list[str] | tuple[str, ...], ranks: tuple[str, ...] = ("0", "1")) -> None:
    """Every rank in ``ranks`` printed PASS for every check in ``names``; else fail showing the output's end."""
    found = passed(output)
    for name in names:
        assert {(rank, name) for rank in ranks} <= found, output[-3000:]


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout importable, one thread, no buffering."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_python(*args: str, timeout: float = 120, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run ``python *args`` to completion and return the result (stdout and stderr as text); see ``run_command``."""
    return run_command(sys.executable, *args, timeout=timeout, check=check, **env)


def run_command(*command: str, timeout: float = 120, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run ``command`` to completion and return the result (stdout and stderr as text).

    The child gets its own process group, and on timeout the whole group is killed, so processes it started
    (DDP ranks, torchrun workers) never outlive the test.
    """
    name = " ".join(("python", *command[1:]) if command[0] == sys.executable else command)
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(**env),
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        raise AssertionError(f"{name} ran past {timeout} s and was killed\n{stdout}\n{stderr}") from None
    result = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"{name} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def start_python(*args: str, **env: str) -> subprocess.Popen:
    """Start ``python *args`` with stdout as a pipe of lines; the caller must wait or kill it (with a timeout)."""
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(**env)
    )


def sigkill(child: subprocess.Popen) -> None:
    """SIGKILL a child from ``start_python`` (unless it already ended) and reap it; for ``finally`` blocks."""
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)


def read_until(child: subprocess.Popen, text: str | re.Pattern, timeout: float) -> str:
    """The output of a ``start_python`` child up to the first line containing ``text`` (or matching the regular
    expression ``text``; and whatever came with it); fails the test (showing the output) when ``timeout`` seconds
    pass first or the child ends without printing it.

    Reads the pipe's file descriptor itself, not ``child.stdout``: that file's read-ahead buffer would keep output
    that a later ``child.communicate()``, which reads the descriptor, never sees.
    """
    data = bytearray()
    pattern = text if isinstance(text, re.Pattern) else re.compile(re.escape(text))
    found = threading.Event()

    def read() -> None:
        while not pattern.search(data.decode(errors="replace")):
            chunk = os.read(child.stdout.fileno(), 65536)
            if not chunk:  # the child closed its output
                break
            data.extend(chunk)
        found.set()

    threading.Thread(target=read, daemon=True).start()
    found.wait(timeout)
    output = bytes(data).decode(errors="replace")
    assert pattern.search(output), f"no line with {pattern.pattern!r} within {timeout} s:\n{output[-3000:]}"
    return output


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie waiting to be reaped has stopped running)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def still_running(pids: list[int], within: float) -> list[int]:
    """The processes of ``pids`` still running after waiting up to ``within`` seconds for all of them to end."""
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [pid for pid in pids if alive(pid)]


def run_on_small_disk(tmp_path: Path, size: str, script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``python SCRIPTS/script DISK *args`` where DISK is a fresh tmpfs of ``size`` (e.g. "2m"), mounted in a
    private mount namespace (``unshare --mount``; as a normal user also ``--user --map-root-user``), so the script
    can fill a disk for real. Skips the test where that is impossible (not Linux, no ``unshare``, namespaces
    disallowed)."""
    import shutil

    import pytest

    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux `unshare` (a private mount namespace) to fill a small tmpfs for real")
    base = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    if subprocess.run([*base, "true"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("this machine does not allow a private mount namespace (`unshare --mount`)")
    disk = tmp_path / "disk"
    disk.mkdir()
    command = f"mount -t tmpfs -o size={size} tmpfs {disk} && exec {sys.executable} {SCRIPTS / script} {disk} {' '.join(args)}"
    return subprocess.run([*base, "sh", "-c", command], capture_output=True, text=True, timeout=300, env=python_env())


def fake_scontrol(folder: Path, allowed: bool = True) -> tuple[dict[str, str], Path]:
    """A stand-in for SLURM's `scontrol` (SLURM cannot run here): a script in ``folder`` that appends its arguments
    to a log and succeeds, or, with ``allowed=False``, fails as SLURM does for a job that may not be requeued.
    Returns (the environment of a process in SLURM job 4242 with it first on PATH, the log's path)."""
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "scontrol.log"
    answer = "exit 0" if allowed else 'echo "Requested operation not supported on this job" >&2; exit 1'
    (folder / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{log}"\n{answer}\n')
    (folder / "scontrol").chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}, log


SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_NODELIST": "localhost"}
# What sbatch's batch script has besides: task 0 of the job, but no job step (no SLURM_STEP_ID).
SLURM_BATCH_SCRIPT = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}


def srun_tasks(
    *args: str, tasks: int = 2, per_task: list[dict[str, str]] | None = None, **env: str
) -> list[subprocess.Popen]:
    """Start ``python *args`` as ``srun --ntasks TASKS`` starts the tasks of a job step of SLURM job 4242 on one node:
    one process per task, each with the variables slurmstepd gives a task (SLURM_STEP_ID, SLURM_STEP_NUM_TASKS,
    SLURM_PROCID, SLURM_LOCALID, ..., and SLURM_TASK_PID, its own PID: `sh` sets it, then execs Python, as slurmstepd
    sets it and execs the task). SLURM itself cannot run here: these variables stand in for it. MASTER_PORT is a free
    port (a fixed one derived from the job id could be taken on a shared machine); ``env`` adds to or overrides the
    rest (a job name, a stand-in scontrol's PATH), ``per_task[rank]`` those of one task. Stdout is a pipe of lines, as
    from ``start_python``; the caller waits for them or kills them, with a timeout (``finish_all``, ``sigkill``)."""
    from fabriclite.plugins.environments import free_port

    step = {
        **SLURM_JOB, "SLURM_JOB_NAME": "train", "SLURM_NTASKS": str(tasks), "SLURM_STEP_ID": "0",
        "SLURM_STEPID": "0", "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NODELIST": "localhost", "SLURM_NODEID": "0", "MASTER_PORT": str(free_port()),
    }  # fmt: skip
    exec_as_task = ["sh", "-c", 'export SLURM_TASK_PID=$$; exec "$@"', "sh", sys.executable]
    return [
        subprocess.Popen(
            [*exec_as_task, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=python_env(**{**step, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank), **env, **own}),
        )
        for rank, own in enumerate(per_task or [{}] * tasks)
    ]


def finish_all(children: list[subprocess.Popen], timeout: float) -> tuple[list[int], str]:
    """Wait for every child of ``start_python`` or ``srun_tasks``; return their exit codes and their output, in
    order. Fails the test when one has not ended within ``timeout`` seconds; none is left running."""
    codes, output = [], ""
    try:
        for child in children:
            try:
                output += child.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a process did not end within {timeout} s:\n{output[-3000:]}") from None
            codes.append(child.returncode)
    finally:
        for child in children:
            sigkill(child)
    return codes, output


# ------------------------------------------------------------- long runs: what the one-machine and two-node tests share
LONG_RUN_SCRIPT = str(SCRIPTS / "long_run.py")
LONG_RUN_TIMEOUT = 300


def assert_same_weights(expected: dict, path: Path) -> None:
    """The weights saved at ``path`` equal ``expected`` bit for bit (an uninterrupted run's)."""
    import torch  # only the tests that compare weights need it

    actual = torch.load(path)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} differs from the uninterrupted run"


def pids(output: str) -> dict[int, int]:
    """Rank -> PID from long_run.py's "pid RANK PID" lines."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"pid (\d) (\d+)", output)}


def finish(child: subprocess.Popen, timeout: float = LONG_RUN_TIMEOUT) -> str:
    """The rest of a ``start_python`` child's output once it has ended; fails the test after ``timeout`` s."""
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        sigkill(child)
        raise AssertionError(f"the run did not end within {timeout} s") from None
    return output


def kill_rank(rank: int):
    """An action for a running launcher: SIGKILL rank ``rank`` (``ranks``: rank -> PID)."""
    return lambda child, ranks: os.kill(ranks[rank], signal.SIGKILL)


def send(signum: int):
    """An action for a running launcher: send it ``signum``."""
    return lambda child, ranks: child.send_signal(signum)
