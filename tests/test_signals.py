"""The signal policy (fabriclite/processes/signals.py), with real processes and real signals: a preemption notice at an
awkward moment (during setup, before the Fabric exists, during a long save, to a whole SLURM job step) ends with
exit code 75 and a complete checkpoint or the previous one intact, never with a kill; a second notice waits for the
save under way; the same notice twice counts once. A Ctrl-C (SIGINT to the process group, as a terminal sends it)
lets the user's `except KeyboardInterrupt:` run to its end, however long it stays at one line; a second one ends it.
SLURM cannot run here: its job step is simulated by signalling the process group."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    LONG_RUN_SCRIPT,
    LONG_RUN_TIMEOUT,
    SCRIPTS,
    finish,
    python_env,
    read_until,
    run_python,
    sigkill,
    still_running,
)

from fabriclite import Fabric
from fabriclite.processes.signals import PREEMPTED_EXIT_CODE

NOTICES = str(SCRIPTS / "notices.py")
LAST_SAVE = str(SCRIPTS / "last_save.py")


def start(*args):
    """``python *args`` in a session of its own (its process group is the "job step"), output as lines."""
    return subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=python_env(),
        start_new_session=True,
    )


def run_and_signal(args, at, act, timeout=LONG_RUN_TIMEOUT):
    """Start ``args``, wait for the line ``at``, call ``act(child)``, and return (exit code, all output)."""
    child = start(*args)
    try:
        before = read_until(child, at, timeout=timeout)
        act(child)
        output = before + finish(child, timeout)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        sigkill(child)
    return child.returncode, output


def saved_step(output):
    found = re.findall(r"(\d) saved at step (\d+) on preemption", output)
    return dict(found)


def test_a_notice_during_setup_before_any_read_of_preempted_is_noted_and_the_run_saves_and_exits_75(tmp_path):
    code, output = run_and_signal(
        [NOTICES, str(tmp_path), "setup"], "setting up", lambda c: c.send_signal(signal.SIGTERM)
    )
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    step = saved_step(output)["0"]
    assert Fabric(accelerator="cpu", devices=1).load_latest(tmp_path, {"step": 0}) == tmp_path / f"step-{step}.ckpt"


def test_slurm_signalling_the_whole_job_step_leaves_the_dataloader_workers_alive(tmp_path):
    # SIGUSR1 to every process of the group, as SLURM's --signal does: the rank and its 2 loader workers.
    code, output = run_and_signal(
        [NOTICES, str(tmp_path), "workers"], "step 3\n", lambda c: os.killpg(c.pid, signal.SIGUSR1)
    )
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "killed by signal" not in output and "0" in saved_step(output), output[-3000:]


@pytest.mark.parametrize("mode", ["slow-save", "slow-save-async"])
def test_a_second_notice_during_a_save_waits_for_it_then_exits_75(tmp_path, mode):
    # SLURM's --signal=USR1@T, then the time limit's SIGTERM while the save is still being written.
    def usr1_then_term(child):
        os.killpg(child.pid, signal.SIGUSR1)
        read_until(child, "received SIGUSR1", timeout=60)
        time.sleep(3)  # later than the same notice come twice (SAME_NOTICE_S)
        os.killpg(child.pid, signal.SIGTERM)

    code, output = run_and_signal([NOTICES, str(tmp_path), mode], "saving", usr1_then_term)
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "received SIGTERM again; exiting with code 75 once no save is under way" in output, output[-3000:]
    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.load(tmp_path / "step-3.ckpt")["step"] == 3  # complete: its checksums verified
    # Asynchronously, the loop may have saved once more on preemption, once the write was done: still complete.
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    assert fabric.load_latest(tmp_path, state) == tmp_path / f"step-{state['step']}.ckpt" and state["step"] >= 3


def test_a_third_notice_ends_a_process_at_once_even_inside_a_save(tmp_path):
    def three_times(child):  # inside the 8 s save, which the second notice waits for
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM):
            os.killpg(child.pid, signum)
            time.sleep(2.5)  # later than one notice come twice

    code, output = run_and_signal([NOTICES, str(tmp_path), "slow-save"], "saving", three_times)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "received SIGTERM a third time; ending it at once" in output


def test_a_notice_while_rank_0_saves_for_long_and_rank_1_waits_for_it_kills_no_rank(tmp_path):
    # Before: after 10 s without the main thread moving, each rank exited 143 with no checkpoint.
    code, output = run_and_signal(
        [NOTICES, str(tmp_path), "busy-ranks"], "saving", lambda c: c.send_signal(signal.SIGTERM)
    )
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    saved = saved_step(output)
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    assert "stayed blocked" not in output
    ranks = [int(pid) for pid in re.findall(r"pid \d (\d+)", output)]
    assert len(ranks) == 2 and still_running(ranks, within=30) == []


def test_a_notice_to_fabriclite_run_before_the_ranks_have_a_fabric_ends_preempted_with_a_line(tmp_path):
    args = cli_run("2", NOTICES, str(tmp_path), "imports")
    code, output = run_and_signal(args, "importing", lambda c: c.send_signal(signal.SIGTERM))
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "before it took notices (its Fabric did not exist yet), so it had nothing to save" in output


def cli_run(devices, *args):
    """The arguments of ``python -m fabriclite.cli run`` on CPU with ``devices`` ranks."""
    return ["-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", devices, *args]


def long_run(tmp_path, sleep):
    folder, out = str(tmp_path / "run"), str(tmp_path / "run.pt")
    return cli_run("2", "--max-restarts", "1", LONG_RUN_SCRIPT, folder, "--out", out, "--sleep", str(sleep))


def test_a_notice_while_the_ranks_are_being_started_reaches_the_ranks_started_after_it(tmp_path, monkeypatch, capfd):
    # The supervisor runs here, in the test's main thread; the notice (a real SIGTERM to this process) is forced into
    # the moment after rank 0 has started and before rank 1 has, where a loaded machine once put it: rank 1 ran on
    # alone, reached Fabric creation, failed, and the run ended 143 instead of 75. This process made a Fabric, as a
    # script that calls fabric.launch() has: the supervisor alone takes the notice, not a rank's policy left behind
    # (it ended this process 143 once its grace had passed).
    from fabriclite.processes import signals, supervisor

    Fabric(accelerator="cpu", devices=1)

    popen = subprocess.Popen
    started = []

    def start_rank(*args, **kwargs):
        if started:
            os.kill(os.getpid(), signal.SIGTERM)
        started.append(popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(supervisor.subprocess, "Popen", start_rank)
    command = [sys.executable, NOTICES, str(tmp_path), "imports"]
    code = supervisor.Supervisor(command, processes=2, env=python_env()).run()
    output = capfd.readouterr()
    assert code == PREEMPTED_EXIT_CODE, output
    assert [rank.returncode for rank in started] == [-signal.SIGTERM, -signal.SIGTERM], output
    assert "rank 1 " in output.err and "before it took notices" in output.err, output
    assert signals.noticed() is None


def test_two_sigterms_a_moment_apart_to_fabriclite_run_are_one_notice(tmp_path):
    def twice(child):
        child.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        child.send_signal(signal.SIGTERM)

    code, output = run_and_signal(long_run(tmp_path, 0.05), "step 5\n", twice)
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    saved = saved_step(output)
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    assert "killing every rank" not in output


def test_a_second_notice_to_fabriclite_run_lets_the_ranks_leave_and_a_third_kills_them(tmp_path):
    # Every rank sleeps 30 s after each step: the second notice makes both leave (nothing is being saved) with 75.
    def again(child):
        child.send_signal(signal.SIGTERM)
        read_until(child, "received SIGTERM", timeout=60)
        time.sleep(3)
        child.send_signal(signal.SIGTERM)

    code, output = run_and_signal(long_run(tmp_path, 30), "step 1\n", again)
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert "SIGTERM received again; the ranks exit once their saves under way have ended." in output

    def three_times(child):  # while the rank is inside an 8 s save, which the second notice waits for
        for signum in (signal.SIGUSR1, signal.SIGTERM, signal.SIGTERM):
            child.send_signal(signum)
            time.sleep(2.5)

    args = cli_run("1", NOTICES, str(tmp_path), "slow-save")
    code, output = run_and_signal(args, "saving", three_times)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "SIGTERM received a third time; killing every rank." in output


FORKED_RANKS = """
import os, signal, time
from fabriclite import Fabric
def work(fabric):
    if fabric.global_rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    for step in range(1200):
        time.sleep(0.05)
        if fabric.preempted:
            return "preempted"
    return "never preempted"
print(Fabric(accelerator="cpu", devices=2, strategy="ddp_fork").launch(work))
"""


def test_a_rank_forked_by_ddp_fork_takes_notices_of_its_own():
    result = run_python("-c", FORKED_RANKS, timeout=180)
    assert "preempted" in result.stdout and "never" not in result.stdout, result.stdout + result.stderr[-2000:]


def ready(devices):
    """The line (a pattern) after which every rank of last_save.py waits for the Ctrl-C."""
    return re.compile(r"(READY \d[\s\S]*){%d}" % devices)


@pytest.mark.parametrize("devices", ["1", "2"])
def test_a_ctrl_c_handler_that_saves_longer_than_the_interrupt_grace_at_one_line_runs_to_its_end(tmp_path, devices):
    # Before: exit 130 after 10 s, "stayed blocked for 10 s in ... time.sleep(SLOW_S)", and no checkpoint; with two
    # processes, rank 1 took the terminal's SIGINT and rank 0's copy of it as two, and died in its handler.
    code, output = run_and_signal(
        [LAST_SAVE, str(tmp_path), devices], ready(int(devices)), lambda c: os.killpg(c.pid, signal.SIGINT)
    )
    assert code == 0, output[-3000:]
    assert "stayed blocked" not in output, output[-3000:]
    assert all(f"SAVED {rank} 2" in output for rank in range(int(devices))), output[-3000:]  # ranks share a pipe
    assert Fabric(accelerator="cpu", devices=1).load(tmp_path / "last.ckpt")["step"] == 2
    ranks = [int(pid) for pid in re.findall(r"PID \d (\d+)", output)]
    assert len(ranks) == int(devices) and still_running(ranks, within=30) == []


def test_a_second_ctrl_c_ends_a_cleanup_blocked_where_python_cannot_raise_it(tmp_path):
    # Rank 0 sleeps in its slow storage (Python raises the second KeyboardInterrupt there); rank 1 waits for it in
    # the save's collective, where only the watching thread can end it.
    def twice(child):
        os.killpg(child.pid, signal.SIGINT)
        read_until(child, re.compile(r"SAVING \d[\s\S]*SAVING \d"), timeout=60)
        time.sleep(3)  # later than the same SIGINT come twice (SAME_NOTICE_S)
        os.killpg(child.pid, signal.SIGINT)

    code, output = run_and_signal([LAST_SAVE, str(tmp_path), "2"], ready(2), twice)
    assert code in (-signal.SIGINT, 128 + signal.SIGINT), output[-3000:]
    assert "SAVED" not in output and not (tmp_path / "last.ckpt").exists(), output[-3000:]
    assert "SIGINT received again, and this process stayed blocked for 1 s in Fabric.save" in output, output[-3000:]
    ranks = [int(pid) for pid in re.findall(r"PID \d (\d+)", output)]
    assert len(ranks) == 2 and still_running(ranks, within=30) == []
