"""Which launcher started this process, read from the environment."""

import pytest

from fabriclite.plugins.environments import _first_slurm_host, detect_environment

LAUNCH_VARS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK",
               "TORCHELASTIC_RUN_ID", "FABRICLITE_LAUNCHER", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_NODEID", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOB_NAME"]


@pytest.fixture
def clean_env(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_a_plain_process_has_no_launcher(clean_env):
    assert detect_environment() is None


def test_srun_tasks_are_read_from_slurm_variables(clean_env):
    for name, value in {"SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
                        "SLURM_NODELIST": "gpu[03-06],cpu1", "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train"}.items():
        clean_env.setenv(name, value)
    env = detect_environment()
    assert (env.world_size, env.global_rank, env.local_rank, env.node_rank) == (8, 5, 1, 2)
    assert env.main_address == "gpu03" and env.main_port == 10000 + 3456 and env.source == "slurm" and env.external


def test_an_interactive_srun_shell_is_not_a_job(clean_env):
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("SLURM_JOB_NAME", "bash")
    assert detect_environment() is None


def test_plain_variables_and_torchelastic_are_recognised(clean_env):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():
        clean_env.setenv(name, value)
    env = detect_environment()
    assert (env.source, env.global_rank, env.main_address, env.main_port) == ("env", 1, "10.0.0.1", 29500)
    clean_env.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert detect_environment().source == "torchelastic"


def test_a_malformed_rank_is_named(clean_env):
    for name, value in {"RANK": "one", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match="RANK='one'"):
        detect_environment()


@pytest.mark.parametrize(("nodelist", "first"), [("node1", "node1"), ("n[7-9]", "n7"), ("a[01,05]", "a01"), ("x,y", "x")])
def test_the_first_slurm_host_is_the_main_node(nodelist, first):
    assert _first_slurm_host(nodelist) == first
