"""Preemption notices for ranks that no fabriclite launcher started (srun's tasks, torchrun's workers):
`fabric.preempted` agrees across ranks without waiting on the step it is read in, every rank saves at the same
step even when only one got the signal, and the run ends "preempted, resumable"."""

import re
import signal
import subprocess

from helpers import SCRIPTS, read_until, sigkill, start_python

from fabriclite.plugins.environments import free_port

SCRIPT = str(SCRIPTS / "long_run.py")
TIMEOUT = 300


def srun_tasks(folder, *flags, **env):
    """Start long_run.py as `srun --ntasks 2` would in SLURM job 4242: one process per rank, rank and job in SLURM_*
    variables, no launcher above them. SLURM itself cannot run here: these variables stand in for it."""
    port = str(free_port())
    tasks = []
    for rank in range(2):
        slurm = {
            "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "long_run", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
        }  # fmt: skip
        args = [SCRIPT, str(folder), "--out", str(folder / "final.pt"), "--accelerator", "cpu", "--devices", "2"]
        tasks.append(start_python(*args, *flags, **slurm, **env))
    return tasks


def finish(tasks):
    """Wait for every task; return their exit codes and their output, rank 0's first."""
    codes, output = [], ""
    try:
        for task in tasks:
            try:
                output += task.communicate(timeout=TIMEOUT)[0]
            except subprocess.TimeoutExpired:
                raise AssertionError(f"a task did not end within {TIMEOUT} s") from None
            codes.append(task.returncode)
    finally:
        for task in tasks:
            sigkill(task)
    return codes, output


def test_a_notice_to_one_srun_task_only_stops_both_at_the_same_step(tmp_path):
    tasks = srun_tasks(tmp_path / "run", "--sleep", "0.05")
    try:
        before = read_until(tasks[0], "step 5\n", timeout=TIMEOUT)
        tasks[1].send_signal(signal.SIGUSR1)  # rank 1 alone: rank 0 learns it from the agreement
    except BaseException:
        finish(tasks)
        raise
    codes, output = finish(tasks)
    output = before + output
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", output))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    assert "rank 1 received SIGUSR1" in output and "rank 0 received" not in output


def test_srun_tasks_never_preempted_end_normally_with_the_last_reads_all_reduce_in_flight(tmp_path):
    # Every read starts an all-reduce that the next read finishes: the last one is still referenced at the end.
    codes, output = finish(srun_tasks(tmp_path / "run", "--epochs", "1"))
    assert codes == [0, 0], output[-3000:]
    assert "done" in output and "saved at step" not in output
