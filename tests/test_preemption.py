"""Preemption notices for ranks that no fabriclite launcher started (srun's tasks, torchrun's workers):
`fabric.preempted` agrees across ranks without waiting on the step it is read in, every rank saves at the same
step even when only one got the signal, and the run ends "preempted, resumable"."""

import os
import re
import signal

from helpers import (
    SCRIPTS,
    SLURM_BATCH_SCRIPT,
    SLURM_JOB,
    fake_scontrol,
    finish_all,
    read_until,
    sigkill,
    srun_tasks,
    start_python,
    still_running,
)

from fabriclite.plugins.environments import free_port
from fabriclite.processes.preemption import PREEMPTED_EXIT_CODE, requeue

SCRIPT = str(SCRIPTS / "long_run.py")
TIMEOUT = 300


def srun_run(folder, *flags, **env):
    """long_run.py as `srun --ntasks 2` starts it in SLURM job 4242 (its variables stand in for SLURM, which cannot
    run here; see helpers.srun_tasks): one process per rank, no launcher above them."""
    args = [SCRIPT, str(folder), "--out", str(folder / "final.pt"), "--accelerator", "cpu", "--devices", "2"]
    return srun_tasks(*args, *flags, **{"SLURM_JOB_NAME": "long_run", **env})


def finish(tasks):
    """Wait for every task; return their exit codes and their output, rank 0's first."""
    return finish_all(tasks, TIMEOUT)


def preempted(children, notice):
    """Once rank 0 (the first of ``children``) has printed "step 5", run ``notice(children)``, which sends the
    signals (and returns what it read, if anything); then wait for every child. Returns their exit codes, all their
    output, and the step at which both ranks saved on preemption: one step, the same on both."""
    try:
        output = read_until(children[0], "step 5\n", timeout=TIMEOUT)
        output += notice(children) or ""
    except BaseException:
        finish(children)
        raise
    codes, rest = finish(children)
    output += rest
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", output))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    return codes, output, saved["0"]


def test_a_notice_to_one_srun_task_stops_both_at_one_step_rank_0_requeues_and_both_exit_75(tmp_path):
    env, log = fake_scontrol(tmp_path / "bin")
    folder = tmp_path / "run"

    def notice(tasks):
        tasks[1].send_signal(signal.SIGUSR1)  # rank 1 alone: rank 0 learns it from the agreement
        said = read_until(tasks[1], "rank 1 received SIGUSR1", timeout=TIMEOUT)
        tasks[1].send_signal(signal.SIGUSR1)  # again at once, as SLURM and a launcher may both send it: one notice
        return said

    codes, output, step = preempted(srun_run(folder, "--sleep", "0.05", **env), notice)
    assert "rank 1 received SIGUSR1" in output and "rank 0 received" not in output
    assert codes == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE], output[-3000:]
    assert log.read_text() == "requeue 4242\n"  # once, by rank 0, after both saved
    assert "fabriclite: requeued SLURM job 4242" in output

    # What SLURM does with a requeued job: start the same tasks again. They resume where they stopped.
    codes, again = finish(srun_run(folder, **env))
    assert codes == [0, 0], again[-3000:]
    assert f"resumed from step-{int(step):04d}.ckpt at step {step}" in again, again[-3000:]


def test_a_slurm_environments_requeue_signal_is_a_notice_both_srun_tasks_save_at_one_step_and_rank_0_requeues(tmp_path):
    """Fabric(plugins=[SLURMEnvironment(requeue_signal=signal.SIGUSR2)]), Lightning's signature: SIGUSR2 (SLURM's
    --signal=USR2@T) to one task is a preemption notice, as SIGUSR1 is. SLURM cannot run here: srun's variables and
    a stand-in `scontrol` on PATH stand in for it."""
    env, log = fake_scontrol(tmp_path / "bin")
    tasks = srun_run(tmp_path / "run", "--sleep", "0.05", "--requeue-signal", "SIGUSR2", **env)
    codes, output, _ = preempted(tasks, lambda tasks: tasks[1].send_signal(signal.SIGUSR2))  # rank 1 alone
    assert "rank 1 received SIGUSR2" in output, output[-3000:]
    assert codes == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE], output[-3000:]
    assert log.read_text() == "requeue 4242\n" and "fabriclite: requeued SLURM job 4242" in output


def test_without_auto_requeue_a_batch_scripts_ranks_save_at_one_step_and_exit_75_unrequeued(tmp_path):
    """`python long_run.py` (devices=2) in an sbatch script, no srun, with SLURMEnvironment(auto_requeue=False,
    requeue_signal=signal.SIGUSR2): fabric.launch() starts rank 1; SIGUSR2 to the script's process (SLURM's
    --signal=B:USR2@T) reaches both ranks, which save at one step, and the run exits 75 without `scontrol requeue`.
    SLURM cannot run here: its variables and a stand-in `scontrol` on PATH stand in for it."""
    env, log = fake_scontrol(tmp_path / "bin")
    folder = tmp_path / "run"
    args = [SCRIPT, str(folder), "--out", str(folder / "final.pt"), "--accelerator", "cpu", "--devices", "2"]
    flags = ["--sleep", "0.05", "--requeue-signal", "SIGUSR2", "--no-auto-requeue"]
    child = start_python(*args, *flags, **{**SLURM_JOB, **SLURM_BATCH_SCRIPT, **env})
    codes, output, _ = preempted([child], lambda children: child.send_signal(signal.SIGUSR2))  # rank 0 passes it on
    assert codes == [PREEMPTED_EXIT_CODE], output[-3000:]
    assert not log.exists(), log.read_text()
    assert "fabriclite: not requeuing SLURM job 4242, as SLURMEnvironment(auto_requeue=False) asks." in output
    assert output.count("this process is not one of srun's tasks") == 1, output[-3000:]


def test_srun_tasks_preempted_where_scontrol_is_missing_save_exit_75_and_say_what_to_run(tmp_path):
    """SIGUSR1 to both srun tasks (as SLURM's --signal sends it) in SLURM job 4242, with no `scontrol` on the PATH (a
    container without SLURM's commands): both save at one step and exit 75, and rank 0 says it could not requeue the
    job and which command does. SLURM cannot run here: srun's variables stand in for it."""
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(f"{d}/scontrol"))
    tasks = srun_run(tmp_path / "run", "--sleep", "0.05", PATH=path)

    def notice(tasks):
        for task in tasks:
            task.send_signal(signal.SIGUSR1)

    codes, output, _ = preempted(tasks, notice)
    assert codes == [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE], output[-3000:]
    said = (
        "fabriclite: could not requeue SLURM job 4242: `scontrol` is not on the PATH here. Run `scontrol requeue 4242`"
    )
    assert said in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_srun_tasks_never_preempted_end_normally_with_the_last_reads_all_reduce_in_flight(tmp_path):
    # Every read starts an all-reduce that the next read finishes: the last one is still referenced at the end.
    codes, output = finish(srun_run(tmp_path / "run", "--epochs", "1"))
    assert codes == [0, 0], output[-3000:]
    assert "done" in output and "saved at step" not in output


def test_torchrun_given_the_notice_stops_its_workers_at_one_step_and_restarts_none(tmp_path):
    # torchrun handles SIGTERM: it passes it to every worker and ends the group, whatever the workers' exit codes,
    # even with restarts left; a worker's exit 75 alone would count as a failure and start the group again.
    folder = tmp_path / "run"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
    args = [SCRIPT, str(folder), "--out", str(folder / "final.pt"), "--accelerator", "cpu", "--devices", "2"]
    child = start_python(*torchrun, *args, "--sleep", "0.05")
    codes, output, _ = preempted([child], lambda children: child.send_signal(signal.SIGTERM))
    assert output.count("fresh start") == 1 and "resumed from" not in output, output[-3000:]  # no restart
    assert "every rank has saved and reached the end of its script" in output, output[-3000:]
    workers = [int(pid) for pid in re.findall(r"pid \d (\d+)", output)]
    assert len(workers) == 2 and still_running(workers, within=30) == []
    assert codes == [1], output[-3000:]  # torchrun's own code after a signal; the workers' 75 stays inside


def test_fabric_launch_ranks_preempted_through_the_first_process_save_at_one_step_and_it_exits_75(tmp_path):
    # `python long_run.py` with Fabric(devices=2).launch(): the first process is rank 0 and starts rank 1, which
    # exits 75 after saving; that is how a preempted rank ends, not a failure that stops rank 0 mid-save.
    folder = tmp_path / "run"
    args = [SCRIPT, str(folder), "--out", str(folder / "final.pt"), "--accelerator", "cpu", "--devices", "2"]
    child = start_python(*args, "--sleep", "0.05")
    codes, output, _ = preempted([child], lambda children: child.send_signal(signal.SIGTERM))  # rank 0 passes it on
    assert codes == [PREEMPTED_EXIT_CODE], output[-3000:]
    assert "exited with code" not in output, output[-3000:]


def test_in_an_array_job_the_requeue_names_the_arrays_task_and_else_the_job(tmp_path, monkeypatch):
    # SLURM itself cannot run here: `scontrol` is the stand-in from helpers, which records its arguments.
    env, log = fake_scontrol(tmp_path / "bin")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    said = []
    assert requeue(say=said.append)
    monkeypatch.setenv("SLURM_JOB_ID", "4250")  # an array task has a job id of its own, too
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "7")
    assert requeue(say=said.append)
    assert log.read_text() == "requeue 4242\nrequeue 4242_7\n"
    assert (
        said[-1] == "fabriclite: requeued SLURM job 4242_7; it resumes from its latest checkpoint when it starts again."
    )


def test_a_surviving_rank_ends_without_a_traceback_from_the_last_reads_all_reduce_after_a_peer_is_killed(tmp_path):
    port, go = str(free_port()), tmp_path / "go"
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    ranks = [
        start_python(str(SCRIPTS / "survivor.py"), str(go), RANK=str(rank), LOCAL_RANK=str(rank), **env)
        for rank in (0, 1)
    ]
    try:
        read_until(ranks[1], "ready", timeout=TIMEOUT)
        read_until(ranks[0], "waiting", timeout=TIMEOUT)
        ranks[1].send_signal(signal.SIGKILL)  # a real SIGKILL, as the OOM killer sends it
        ranks[1].wait(timeout=60)
        go.touch()
        output = ranks[0].communicate(timeout=TIMEOUT)[0]
    finally:
        for rank in ranks:
            sigkill(rank)
    assert "end of script" in output, output[-3000:]
    assert "Traceback" not in output and "atexit" not in output, output[-3000:]
    assert ranks[0].returncode == 0, output[-3000:]
