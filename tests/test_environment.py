"""Which launcher started this process, read from the environment."""

import pytest
from helpers import LAUNCH_VARS

from fabriclite.plugins.environments import _first_slurm_host, detect_environment


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_process_has_no_launcher(clean_env):
    assert detect_environment() is None


def test_srun_tasks_are_read_from_slurm_variables(clean_env):
    for name, value in {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2",
        "SLURM_NODELIST": "gpu[03-06],cpu1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "train",
    }.items():
        clean_env.setenv(name, value)
    env = detect_environment()
    assert (env.world_size, env.global_rank, env.local_rank, env.node_rank) == (8, 5, 1, 2)
    assert env.main_address == "gpu03" and env.main_port == 10000 + 3456 and env.source == "slurm" and env.external


def test_an_interactive_srun_shell_is_not_a_job(clean_env):
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_JOB_NAME", "bash")
    assert detect_environment() is None


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
    """Two real srun-like tasks whose RANK/WORLD_SIZE/... variables (say, left from torchrun) disagree with SLURM's:
    with plugins=[SLURMEnvironment()] both join as SLURM says."""
    from helpers import SCRIPTS, assert_passed, python_env
    import subprocess
    import sys

    from fabriclite.plugins.environments import free_port

    port = str(free_port())
    children = []
    for rank in (0, 1):
        env = python_env(
            SLURM_NTASKS="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_JOB_ID="7",
            SLURM_JOB_NAME="train",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(1 - rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(1 - rank),
        )
        children.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "cluster_environment.py")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    output = ""
    try:
        for child in children:
            output += child.communicate(timeout=180)[0]
    finally:
        for child in children:
            child.kill()
    assert_passed(output, ["joined as SLURM says"])


def test_a_cluster_environment_plugin_must_be_one(clean_env):
    from fabriclite import Fabric
    from fabriclite.plugins.environments import LightningEnvironment, SLURMEnvironment

    with pytest.raises(ValueError, match="two ClusterEnvironment plugins"):
        Fabric(accelerator="cpu", plugins=[LightningEnvironment(), SLURMEnvironment()])
    with pytest.raises(TypeError, match="cluster_environment='slurm' must be"):
        from fabriclite.strategies import DDPStrategy

        DDPStrategy(cluster_environment="slurm")
