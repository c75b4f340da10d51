"""The launchers, through their one interface ``launch(function, *args, **kwargs)``: in this process, by running
the script again (subprocess), and in new processes (spawn). Each multi-process run carries a timeout."""

import os
import pickle
import re
import signal
import subprocess
import time

import pytest

from fabriclite.processes.launcher import InProcessLauncher, MultiprocessingLauncher, SubprocessLauncher
from helpers import SCRIPTS, assert_passed, read_until, run_python, sigkill, start_python, still_running


def test_in_process_runs_the_function_here_and_returns_its_result():
    calls = []
    result = InProcessLauncher().launch(lambda a, b=0: calls.append((a, b)) or a + b, 2, b=3)
    assert result == 5 and calls == [(2, 3)]


@pytest.mark.parametrize(
    ("launcher", "starts", "needs_function"),
    [
        (InProcessLauncher(), False, False),
        (SubprocessLauncher(2), True, False),
        (MultiprocessingLauncher(2), True, True),
    ],
)
def test_each_launcher_says_whether_it_starts_processes_and_needs_a_function(launcher, starts, needs_function):
    assert (launcher.starts_processes, launcher.needs_function) == (starts, needs_function)


def test_a_spawn_launcher_pickles_so_a_strategy_can_travel():
    launcher = pickle.loads(pickle.dumps(MultiprocessingLauncher(3)))
    assert launcher.processes == 3


def test_subprocess_runs_the_script_again_with_the_rank_in_the_environment():
    out = run_python(str(SCRIPTS / "launcher_checks.py"), "subprocess", timeout=180).stdout
    assert_passed(out, ["the rank is in the environment", "the arguments arrive", "the function runs in this process"])
    assert_passed(out, ["launching twice is refused"], ranks=("0",))


def test_one_process_needs_no_script_to_run_again_so_python_c_can_launch():
    code = (
        "from fabriclite import Fabric\n"
        "fabric = Fabric(accelerator='cpu', devices=1, strategy='ddp')\n"
        "fabric.launch()\n"
        "print('launched', fabric.world_size, fabric.global_rank)\n"
    )
    result = run_python("-c", code, timeout=120)
    assert "launched 1 0" in result.stdout


def test_spawn_runs_the_function_in_new_processes_and_returns_rank_zeros_result():
    out = run_python(str(SCRIPTS / "launcher_checks.py"), "spawn", timeout=180).stdout
    assert_passed(out, ["the rank is in the environment", "the arguments arrive"])
    assert_passed(out, ["rank 0's result comes back", "this process stays outside the run"], ranks=("0",))


def signal_masks(pid: int) -> str:
    """A process's pending, blocked, ignored and caught signals as /proc shows them (hexadecimal masks, bit n-1 for
    signal n: SIGINT is 0x2): why a signal sent to it did nothing."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return " ".join("".join(line.split()[:2]) for line in status if line.startswith(("Sig", "ShdPnd")))
    except OSError as error:
        return f"gone ({error})"


def interrupt_when_waiting(mode: str, tmp_path) -> tuple[int, str, list[int]]:
    """Start ``stalls.py mode`` (rank 1 hangs), SIGINT the process the user started once rank 0 waits for rank 1,
    and return its exit code, its output and the PIDs of its ranks. Fails if the run leaves a folder of its own in
    ``tmp_path`` (its TMPDIR)."""
    child = start_python(str(SCRIPTS / "stalls.py"), mode, TMPDIR=str(tmp_path))
    try:
        output = read_until(child, "WAITING 0", timeout=150)
        time.sleep(1)  # rank 0 is now inside the collective
        child.send_signal(signal.SIGINT)
        try:
            rest, _ = child.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # every rank's signal masks and threads' stacks (stalls.py), then fail
            pids = {child.pid, *map(int, re.findall(r"PID \d (\d+)", output))}
            masks = "".join(f"{pid}: {signal_masks(pid)}\n" for pid in pids)
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            time.sleep(3)
            child.kill()
            rest, _ = child.communicate(timeout=30)
            raise AssertionError(f"stalls.py {mode} did not end 90 s after SIGINT:\n{masks}{output}{rest}") from None
    finally:
        sigkill(child)
    output += rest
    assert list(tmp_path.glob("fabriclite-*")) == [], "the run left its failure records behind"
    return child.returncode, output, [int(pid) for pid in re.findall(r"PID \d (\d+)", output)]


def test_sigint_ends_every_rank_even_one_blocked_in_a_collective_and_exits_130(tmp_path):
    code, output, pids = interrupt_when_waiting("deaf", tmp_path)  # rank 1 ignores SIGINT: it has to be stopped
    assert code == 128 + signal.SIGINT, output[-3000:]
    assert "SIGINT received, and this process stayed blocked for 10 s in Fabric.backward, called at" in output
    assert len(pids) == 2 and still_running(pids, within=30) == []


def test_sigint_to_a_ddp_spawn_parent_stops_the_processes_it_started(tmp_path):
    code, output, pids = interrupt_when_waiting("spawn_hang", tmp_path)
    assert code in (-signal.SIGINT, 128 + signal.SIGINT), output[-3000:]
    assert "KeyboardInterrupt" in output
    assert len(pids) == 2 and still_running(pids, within=30) == []


NOTEBOOK_CELL = """
from fabriclite import Fabric
offset = 10
def train(fabric):  # a function of an interactive session: spawn cannot pickle what it closes over
    return fabric.all_reduce(fabric.global_rank + offset, reduce_op='sum').item() + (lambda: 0)()
print('result', Fabric(accelerator='cpu', devices=2, strategy='ddp_notebook').launch(train))
"""


def test_ddp_notebook_runs_a_function_defined_in_an_interactive_session_by_forking():
    assert "result 21" in run_python("-c", NOTEBOOK_CELL, timeout=180).stdout


def test_forking_is_refused_once_cuda_is_initialised(monkeypatch):
    # Mock: this machine has no GPU, so CUDA cannot really be initialised here.
    monkeypatch.setattr("torch.cuda.is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA is already initialised here"):
        MultiprocessingLauncher(2, "fork").launch(print)


def test_sigint_to_a_ddp_notebook_parent_stops_the_processes_it_forked(tmp_path):
    code, output, pids = interrupt_when_waiting("fork_hang", tmp_path)
    assert code in (-signal.SIGINT, 128 + signal.SIGINT), output[-3000:]
    assert len(pids) == 2 and still_running(pids, within=30) == []


FORK_AFTER_GUARD = """
import os, signal
from fabriclite.processes.launcher import stop_on_interrupt
stop_on_interrupt([])
pid = os.fork()
if pid == 0:  # a DataLoader worker, say: its signals must not reach the parent's interrupt thread
    os._exit(0 if signal.set_wakeup_fd(-1) == -1 else 3)
print('child exit', os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_process_forked_after_the_interrupt_guard_does_not_share_its_pipe():
    assert "child exit 0" in run_python("-c", FORK_AFTER_GUARD, timeout=60).stdout
