"""DDP on 2 CPU processes (gloo), started from a plain script as a user would. Each script run carries a timeout."""

import re
import sys

import pytest

from helpers import ROOT, SCRIPTS, assert_passed, passed, python_env, run_python, still_running

CHECKS = [
    "layout",
    "threads",
    "all_gather stacks a world dimension",
    "all_gather of a dict",
    "all_gather of uneven lengths gives a list",
    "all_gather with an empty rank",
    "all_reduce mean",
    "all_reduce sum/max/min",
    "broadcast",
    "all_reduce of a DTensor reduces its full value",
    "shards are disjoint and cover the data",
    "set_epoch reshuffles every epoch",
    "a user's sampler is sharded",
    "a user's sampler keeps its own order",
    "a metric under DDP equals the single-process value",
    "counting the duplicate would differ",
    "use_distributed_sampler=False keeps the whole data",
    "weights identical across ranks",
    "DDP equals one process on the whole batch",
    "no_backward_sync keeps gradients local",
    "gradients are averaged outside no_backward_sync",
    "clip_gradients norm agrees across ranks",
]
SCALER_CHECKS = [
    "an inf on one rank makes every rank skip",
    "every rank backs off the scale",
    "after a skip the next step applies on every rank",
]


@pytest.fixture(scope="module")
def fp32_run():
    return run_python(str(SCRIPTS / "ddp_checks.py"), "32-true", timeout=240).stdout


@pytest.mark.parametrize("name", CHECKS)
def test_ddp_behaviour_on_two_processes(fp32_run, name):
    assert {("0", name), ("1", name)} <= passed(fp32_run), fp32_run[-2000:]


def test_loss_scaling_under_ddp_skips_the_same_step_on_every_rank():
    out = run_python(str(SCRIPTS / "ddp_checks.py"), "16-mixed", timeout=240).stdout
    for name in SCALER_CHECKS:
        assert {("0", name), ("1", name)} <= passed(out), out[-2000:]


def test_compile_under_ddp_compiles_each_block_in_place_without_graph_breaks_and_trains_like_eager():
    out = run_python(str(SCRIPTS / "compile_checks.py"), "ddp", timeout=240).stdout
    for name in (
        "every block is compiled",
        "the root stays eager",
        "regional=False compiles around DDP",
        "no graph breaks",
        "compiled training equals eager",
    ):
        assert {("0", name), ("1", name)} <= passed(out), out[-2000:]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("crash", "(RuntimeError: rank 1 fails on purpose); stopping the other processes."),  # named, rank 0 not
        ("kill", "process 1 was killed by SIGKILL; stopping the other processes"),
        ("hang", ""),
        ("late", "process 1 exited with code 3; this run failed"),
        ("kill-late", "process 1 was killed by SIGKILL; stopping the other processes"),
        ("kill-redirected", "process 1 was killed by SIGKILL; stopping the other processes"),
    ],
)
def test_a_failing_or_hanging_rank_stops_the_run_with_an_error_and_no_orphans(mode, message, tmp_path):
    # A hang must end at the script's 3 s collective timeout, long before run_python's own timeout.
    result = run_python(str(SCRIPTS / "ddp_failures.py"), mode, timeout=120, check=False, TMPDIR=str(tmp_path))
    assert result.returncode != 0
    assert message in result.stderr
    assert "unreachable" not in result.stdout
    pids = [int(pid) for pid in re.findall(r"PID \d (\d+)", result.stdout)]
    assert len(pids) == 2, result.stdout
    # A killed rank may stay a zombie for a moment until it is reaped: only running processes are orphans.
    assert still_running(pids, within=30) == []
    # The folder where the ranks recorded their exceptions goes with the run, however it ended.
    assert list(tmp_path.glob("fabriclite-failures-*")) == []


def test_ddp_spawn_runs_the_function_and_returns_rank_zeros_result(tmp_path):
    script = tmp_path / "spawn.py"
    script.write_text(
        "from fabriclite import Fabric\n"
        "def work(fabric, base):\n"
        "    return base + fabric.all_reduce(fabric.global_rank + 1, reduce_op='sum').item()\n"
        "if __name__ == '__main__':\n"
        "    print('result', Fabric(accelerator='cpu', devices=2, strategy='ddp_spawn').launch(work, 10))\n"
    )
    assert "result 13" in run_python(str(script), timeout=180).stdout


def test_torchrun_launched_processes_are_detected_and_reused(tmp_path):
    script = tmp_path / "elastic.py"
    script.write_text(
        "import sys\n"
        "from fabriclite import Fabric\n"
        "fabric = Fabric(accelerator='cpu', devices=2)\n"
        "fabric.launch()\n"
        "line = f'rank {fabric.global_rank} of {fabric.world_size} {fabric.strategy.environment.source}'\n"
        "open(f'{sys.argv[1]}/rank{fabric.global_rank}.txt', 'w').write(line)\n"  # one file per rank: no interleaving
    )
    run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), str(tmp_path), timeout=180
    )
    assert (tmp_path / "rank0.txt").read_text() == "rank 0 of 2 torchelastic"
    assert (tmp_path / "rank1.txt").read_text() == "rank 1 of 2 torchelastic"


def test_a_world_size_that_does_not_match_devices_is_refused():
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    result = run_python(
        "-c", "from fabriclite import Fabric; Fabric(accelerator='cpu', devices=2)", check=False, timeout=60, **env
    )
    assert result.returncode != 0
    assert "WORLD_SIZE=3" in result.stderr and "2 * 1 = 2" in result.stderr
    assert "left over from another job or your shell, unset them" in result.stderr


def test_launch_from_python_c_explains_what_to_do():
    result = run_python(
        "-c", "from fabriclite import Fabric; Fabric(accelerator='cpu', devices=2).launch()", check=False, timeout=60
    )
    assert result.returncode != 0
    assert "ddp_spawn" in result.stderr


def test_setup_before_launch_is_refused_under_a_launcher():
    code = (
        "import torch\nfrom fabriclite import Fabric\nFabric(accelerator='cpu', devices=2).setup(torch.nn.Linear(2, 2))"
    )
    result = run_python("-c", code, check=False, timeout=60)
    assert result.returncode != 0
    assert "before fabric.launch()" in result.stderr


def test_setup_without_launch_runs_on_one_device_where_there_is_nothing_to_start():
    import torch

    from fabriclite import Fabric

    model = Fabric(accelerator="cpu", devices=1).setup(torch.nn.Linear(2, 2))  # as docs/launching.md says
    assert model(torch.ones(1, 2)).shape == (1, 2)


def test_unused_helpers_are_importable():
    # the module-level import of python_env and ROOT documents where the helpers live
    assert callable(python_env) and ROOT.exists() and sys.executable


def test_an_optimizer_or_a_loss_from_a_model_not_set_up_is_refused_clearly():
    out = run_python(str(SCRIPTS / "ddp_not_set_up.py"), timeout=240).stdout
    assert_passed(
        out,
        [
            "setup_optimizers refuses an optimizer over a model that was not set up",
            "setup refuses an optimizer over another model than the one set up",
            "backward refuses a loss from a model that was not set up",
            "and touches no gradient",
            "backward warns about a loose parameter beside a set-up model",
            "a model set up with its optimizer trains, checked on the first backward only",
        ],
    )
