"""The launchers, through their one interface ``launch(function, *args, **kwargs)``: in this process, by running
the script again (subprocess), and in new processes (spawn). Each multi-process run carries a timeout."""

import pickle

import pytest

from fabriclite.launcher import InProcessLauncher, SpawnLauncher, SubprocessLauncher
from helpers import SCRIPTS, assert_passed, run_python


def test_in_process_runs_the_function_here_and_returns_its_result():
    calls = []
    result = InProcessLauncher().launch(lambda a, b=0: calls.append((a, b)) or a + b, 2, b=3)
    assert result == 5 and calls == [(2, 3)]


@pytest.mark.parametrize(
    ("launcher", "starts", "needs_function"),
    [(InProcessLauncher(), False, False), (SubprocessLauncher(2), True, False), (SpawnLauncher(2), True, True)],
)
def test_each_launcher_says_whether_it_starts_processes_and_needs_a_function(launcher, starts, needs_function):
    assert (launcher.starts_processes, launcher.needs_function) == (starts, needs_function)


def test_a_spawn_launcher_pickles_so_a_strategy_can_travel():
    launcher = pickle.loads(pickle.dumps(SpawnLauncher(3)))
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
