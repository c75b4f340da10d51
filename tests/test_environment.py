"""Which launcher started this process, read from the environment. SLURM cannot run here: its variables, set as
salloc, sbatch's batch script, srun's tasks and an `srun --pty bash` shell set them (SLURM's man pages, OUTPUT
ENVIRONMENT VARIABLES), stand in for it."""

import os
import re
import signal
import subprocess
import sys

import pytest
from helpers import (
    LAUNCH_VARS,
    SCRIPTS,
    SLURM_BATCH_SCRIPT,
    SLURM_JOB,
    finish_all,
    python_env,
    srun_tasks,
    start_python,
)

from fabriclite.plugins.environments import SLURMEnvironment, _first_slurm_host, detect_environment

TIMEOUT = 180
RANKS_SCRIPT = str(SCRIPTS / "slurm_ranks.py")


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_process_has_no_launcher(clean_env):
    assert detect_environment() is None


def test_srun_tasks_are_read_from_the_job_steps_variables(clean_env):
    # The step's own numbers: with --preserve-env, SLURM_NTASKS and SLURM_NODELIST stay the job's.
    for name, value in {
        "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "8",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NODELIST": "cpu[1-9]",
        "SLURM_STEP_NODELIST": "gpu[03-06],cpu1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "train",
    }.items():
        clean_env.setenv(name, value)
    env = detect_environment()
    assert (env.world_size, env.global_rank, env.local_rank, env.node_rank) == (8, 5, 1, 2)
    assert env.main_address == "gpu03" and env.main_port == 10000 + 3456 and env.source == "slurm" and env.external


SLURM_PLACES = {
    # sbatch's batch script: task 0 of the job, but no job step (SLURM's FAQ tells a batch script by that).
    "batch script": SLURM_BATCH_SCRIPT,
    # an salloc shell: the allocation's numbers, no task of any step.
    "salloc shell": {"SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"},
    # `srun --pty bash`: a step of one task.
    "srun --pty bash": {
        "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "bash",
    },
    # salloc's shell as an interactive step (LaunchParameters=use_interactive_step: --preserve-env keeps NTASKS).
    "salloc interactive step": {
        "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_ID": "4294967290", "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_JOB_NAME": "interactive",
    },
}  # fmt: skip


@pytest.mark.parametrize("place", SLURM_PLACES)
def test_a_batch_script_an_salloc_shell_and_a_step_of_one_task_are_no_tasks_to_join(clean_env, place):
    for name, value in {**SLURM_JOB, **SLURM_PLACES[place]}.items():
        clean_env.setenv(name, value)
    assert detect_environment() is None and not SLURMEnvironment.detect()
    assert detect_environment(SLURMEnvironment()) is None


@pytest.mark.parametrize("name", ["bash", "interactive", "train"])
def test_srun_tasks_are_tasks_whatever_the_job_is_named(clean_env, name):
    # An interactive allocation (salloc's default name is "interactive", `srun --pty bash` makes "bash") runs steps too.
    for variable, value in {**SLURM_JOB, **SLURM_PLACES["srun --pty bash"], "SLURM_JOB_NAME": name}.items():
        clean_env.setenv(variable, value)
    clean_env.setenv("SLURM_STEP_ID", "1")
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "2")
    clean_env.setenv("SLURM_TASK_PID", str(os.getpid()))  # the task itself, as srun starts it
    assert SLURMEnvironment.detect() and detect_environment().world_size == 2


def test_plain_variables_and_torchelastic_are_recognised(clean_env):
    for name, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        clean_env.setenv(name, value)
    env = detect_environment()
    assert (env.source, env.global_rank, env.main_address, env.main_port) == ("env", 1, "10.0.0.1", 29500)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert detect_environment().source == "torchelastic"


def test_a_malformed_rank_is_named(clean_env):
    for name, value in {
        "RANK": "one",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "1",
    }.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match="RANK='one'"):
        detect_environment()


@pytest.mark.parametrize(
    ("nodelist", "first"), [("node1", "node1"), ("n[7-9]", "n7"), ("a[01,05]", "a01"), ("x,y", "x")]
)
def test_the_first_slurm_host_is_the_main_node(nodelist, first):
    assert _first_slurm_host(nodelist) == first


def test_each_launcher_has_its_lightning_class_reading_the_same_variables(clean_env):
    from fabriclite.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment

    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.2",
        "MASTER_PORT": "29501",
        "TORCHELASTIC_RUN_ID": "x",
    }.items():
        clean_env.setenv(name, value)
    elastic = TorchElasticEnvironment()
    assert TorchElasticEnvironment.detect() and not SLURMEnvironment.detect()
    assert (elastic.world_size(), elastic.global_rank(), elastic.local_rank(), elastic.node_rank()) == (4, 3, 1, 1)
    assert (elastic.main_address, elastic.main_port, elastic.creates_processes_externally) == ("10.0.0.2", 29501, True)
    assert detect_environment() == elastic.read()
    elastic.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(ValueError, match="4 processes, but devices \\* num_nodes = 2 \\* 1"):
        elastic.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(ValueError, match="rank 3, not 0"):
        elastic.set_global_rank(0)
    clean_env.delenv("TORCHELASTIC_RUN_ID")
    assert LightningEnvironment().global_rank() == 3 and detect_environment().source == "env"


def test_an_environment_class_that_did_not_start_this_process_says_so(clean_env):
    from fabriclite.plugins.environments import SLURMEnvironment

    assert SLURMEnvironment().read() is None and not SLURMEnvironment().creates_processes_externally
    with pytest.raises(RuntimeError, match="not started by slurm"):
        SLURMEnvironment().global_rank()


def test_a_given_cluster_environment_decides_over_stale_variables(clean_env):
    """Two real srun tasks whose RANK/WORLD_SIZE/... variables (say, left from torchrun) disagree with SLURM's: with
    plugins=[SLURMEnvironment()] both join as SLURM says."""
    stale = [
        {"RANK": str(1 - rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(1 - rank), "MASTER_ADDR": "127.0.0.1"}
        for rank in (0, 1)
    ]
    codes, output = finish_all(srun_tasks(RANKS_SCRIPT, "--plugin", per_task=stale), TIMEOUT)
    assert codes == [0, 0], output[-3000:]
    assert sorted(re.findall(r"rank (\d) of 2 pid \d+ procid (\d) gathered \[0, 1\]", output)) == [
        ("0", "0"),
        ("1", "1"),
    ], output


def test_a_cluster_environment_plugin_must_be_one(clean_env):
    from fabriclite import Fabric
    from fabriclite.plugins.environments import LightningEnvironment, SLURMEnvironment

    with pytest.raises(ValueError, match="two ClusterEnvironment plugins"):
        Fabric(accelerator="cpu", plugins=[LightningEnvironment(), SLURMEnvironment()])
    with pytest.raises(TypeError, match="cluster_environment='slurm' must be"):
        from fabriclite.strategies import DDPStrategy

        DDPStrategy(cluster_environment="slurm")


def test_slurm_environment_takes_lightnings_arguments(clean_env):
    default = SLURMEnvironment()
    assert default.auto_requeue is True and default.requeue_signal == signal.SIGUSR1  # Lightning's defaults
    given = SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGUSR2)
    assert given.auto_requeue is False and given.requeue_signal is signal.SIGUSR2
    assert SLURMEnvironment(requeue_signal=int(signal.SIGHUP)).requeue_signal is signal.SIGHUP
    assert repr(given) == "SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGUSR2)"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"requeue_signal": "SIGUSR2"},
            TypeError,
            "requeue_signal='SIGUSR2'\\) must be a signal, such as signal.SIGUSR2",
        ),
        ({"requeue_signal": True}, TypeError, "requeue_signal=True\\) must be a signal"),
        ({"requeue_signal": signal.SIGKILL}, ValueError, "SIGKILL cannot be caught"),
        ({"requeue_signal": signal.SIGSTOP}, ValueError, "SIGSTOP cannot be caught"),
        ({"requeue_signal": signal.SIGINT}, ValueError, "SIGINT means something else already"),
        ({"requeue_signal": 999}, ValueError, "requeue_signal=999\\) is not a signal number"),
        ({"auto_requeue": "no"}, TypeError, "auto_requeue='no'\\) must be True .* or False"),
        ({"auto_requeue": 0}, TypeError, "auto_requeue=0\\) must be True"),
    ],
)
def test_slurm_environment_refuses_what_cannot_be_a_requeue_setting(kwargs, error, message):
    with pytest.raises(error, match=message):
        SLURMEnvironment(**kwargs)


NODE_LISTS = [  # SLURM's node-list forms, and the host where rank 0 runs (the cases of Lightning's own tests)
    ("127.0.0.1", "127.0.0.1"),
    ("alpha,beta,gamma", "alpha"),
    ("alpha beta gamma", "alpha"),
    ("1.2.3.[100-110]", "1.2.3.100"),
    ("1.2.3.[089, 100-110]", "1.2.3.089"),
    ("host[22]", "host22"),
    ("host[5-9,1]", "host5"),
    ("alpha, host[5-9], gamma", "alpha"),
    ("alpha[3,1], beta", "alpha3"),
]


def test_slurm_environment_has_lightnings_public_members_saying_the_same_facts(clean_env):
    for name, value in {"SLURM_JOB_ID": "0001234", "SLURM_JOB_NAME": "JOB"}.items():
        clean_env.setenv(name, value)
    assert SLURMEnvironment.job_id() == 1234 and SLURMEnvironment.job_name() == "JOB"
    assert [SLURMEnvironment.resolve_root_node_address(nodes) for nodes, _ in NODE_LISTS] == [h for _, h in NODE_LISTS]
    clean_env.setenv("SLURM_JOB_NAME", "interactive")
    assert SLURMEnvironment.job_id() is None  # as Lightning: a shell's runs do not share one id
    clean_env.delenv("SLURM_JOB_ID")
    clean_env.delenv("SLURM_JOB_NAME")
    assert SLURMEnvironment.job_id() is None and SLURMEnvironment.job_name() is None
    try:
        from lightning.fabric.plugins.environments import SLURMEnvironment as Lightnings
    except ImportError:  # the names below are checked against Lightning wherever it is installed
        return
    public = {name for name in dir(Lightnings) if not name.startswith("_")}
    assert public - set(dir(SLURMEnvironment)) == set()
    assert [Lightnings.resolve_root_node_address(nodes) for nodes, _ in NODE_LISTS] == [h for _, h in NODE_LISTS]


@pytest.mark.parametrize(
    ("nodes", "num_nodes", "message"),
    [
        ("1", 2, "Fabric\\(num_nodes=2\\) in SLURM job 4242, but this process is not one of srun's tasks"),
        ("2", 1, "SLURM job 4242 has 2 nodes \\(SLURM_JOB_NUM_NODES=2\\), but this process is not one of srun's"),
    ],
)
def test_outside_srun_a_run_on_several_nodes_fails_at_once_saying_how_to_start_it(clean_env, nodes, num_nodes, message):
    from fabriclite import Fabric

    for name, value in {**SLURM_JOB, **SLURM_PLACES["batch script"], "SLURM_JOB_NUM_NODES": nodes}.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message) as raised:
        Fabric(accelerator="cpu", devices=2, strategy="ddp", num_nodes=num_nodes)
    assert "srun --nodes=2 --ntasks-per-node=2 python " in str(raised.value)


def ranks_of(output: str) -> list[tuple[str, str, int]]:
    """(rank, world size, PID) of every "rank R of W pid P" line slurm_ranks.py printed, by rank."""
    return sorted((r, w, int(p)) for r, w, p in re.findall(r"rank (\d) of (\d) pid (\d+)", output))


def test_srun_tasks_in_an_interactive_allocation_join_as_ranks_0_and_1(clean_env):
    """`srun -n 2 python slurm_ranks.py` in an salloc shell (job name "interactive"): two real processes with the
    variables srun gives its tasks. Each was one rank of a group of two, not the first of a group of its own."""
    tasks = srun_tasks(RANKS_SCRIPT, SLURM_JOB_NAME="interactive")
    pids = [task.pid for task in tasks]
    codes, output = finish_all(tasks, TIMEOUT)
    assert codes == [0, 0], output[-3000:]
    assert ranks_of(output) == [("0", "2", pids[0]), ("1", "2", pids[1])], output[-3000:]
    assert "gathered [0, 1]" in output and "not one of srun's tasks" not in output


@pytest.mark.parametrize("place", ["batch script", "salloc shell"])
def test_outside_srun_python_starts_its_local_processes_and_says_so_once(clean_env, place):
    """`python slurm_ranks.py` (devices=2) in an sbatch script or an `salloc -n 2` shell, no srun: fabric.launch()
    starts the two processes as anywhere else, and one line says how srun would start them instead."""
    child = start_python(RANKS_SCRIPT, **SLURM_JOB, **SLURM_PLACES[place])
    codes, output = finish_all([child], TIMEOUT)
    assert codes == [0], output[-3000:]
    assert [(rank, world) for rank, world, _ in ranks_of(output)] == [("0", "2"), ("1", "2")], output[-3000:]
    assert ranks_of(output)[0][2] == child.pid  # the process started is rank 0, as fabric.launch() makes it
    line = "fabriclite: SLURM job 4242, but this process is not one of srun's tasks (no job step"
    assert output.count(line) == 1 and "`srun --nodes=1 --ntasks-per-node=2 python " in output, output[-3000:]


@pytest.mark.parametrize("tasks", [1, 2])
def test_python_typed_in_an_srun_pty_shell_starts_its_local_processes(clean_env, tasks):
    """`python slurm_ranks.py` typed in the shell of `srun --pty bash` (a step of one task), or of task 0 of
    `srun -n 2 --pty bash`, whose terminal it reads: the shell is srun's task (SLURM_TASK_PID, here this test's
    PID), not this process, so it starts its two local processes instead of waiting for tasks that never come."""
    shell = {
        **SLURM_JOB, **SLURM_PLACES["srun --pty bash"], "SLURM_JOB_NAME": "dev", "SLURM_NTASKS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_TASK_PID": str(os.getpid()),
    }  # fmt: skip
    terminal, its_end = os.openpty()
    try:
        child = subprocess.Popen(
            [sys.executable, RANKS_SCRIPT],
            stdin=its_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=python_env(**shell),
        )
        codes, output = finish_all([child], TIMEOUT)
    finally:
        os.close(terminal)
        os.close(its_end)
    assert codes == [0], output[-3000:]
    assert [(rank, world) for rank, world, _ in ranks_of(output)] == [("0", "2"), ("1", "2")], output[-3000:]
    assert "not one of srun's tasks (a step of one task, such as `srun --pty bash`, or a command typed" in output, (
        output[-3000:]
    )
