"""`fabriclite run` and `fabriclite consolidate`: settings, errors, and real runs through torchrun on 2 CPU processes.

Checks that need no processes call `fabriclite.cli` in this process; every run goes through `run_python`, with a
timeout that kills the whole process group.
"""

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fabriclite import Fabric
from fabriclite.choices import apply_cli_settings
from fabriclite.cli import build_parser, fabric_environment, main, resolve_settings
from fabriclite.plugins.environments import free_port
from helpers import SCRIPTS, run_python

REPORT = str(SCRIPTS / "cli_report.py")
REPORT_LINE = re.compile(r"rank (\d) of (\d) node (\d) accelerator (\w+) precision (\S+) args (\[.*?\]) sum (\S+)")


def reports(output):
    return sorted(REPORT_LINE.findall(output))


def fails_with(capsys, *argv):
    """Run `fabriclite <argv>` in this process, expect the usage error exit (2), return stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("raise SystemExit('the script must not run')\n")
    return str(path)


# ---------------------------------------------------------------- settings reach Fabric()
def test_fabric_takes_the_cli_settings_for_arguments_left_at_their_defaults(monkeypatch):
    monkeypatch.setenv("FABRICLITE_CLI_ACCELERATOR", "cpu")
    monkeypatch.setenv("FABRICLITE_CLI_PRECISION", "bf16-mixed")
    fabric = Fabric()
    assert fabric.accelerator.name == "cpu"
    assert fabric._precision.name == "bf16-mixed"


def test_a_fabric_argument_that_conflicts_with_the_cli_raises_naming_both(monkeypatch):
    monkeypatch.setenv("FABRICLITE_CLI_PRECISION", "bf16-mixed")
    expected = "precision='32-true' conflicts with `fabriclite run --precision bf16-mixed`; remove one of them"
    with pytest.raises(ValueError, match=re.escape(expected)):
        Fabric(accelerator="cpu", precision="32-true")


@pytest.mark.parametrize(
    ("key", "from_cli", "in_fabric"),
    [
        ("precision", "bf16-mixed", "BF16-mixed"),
        ("precision", "16-mixed", 16),
        ("devices", "2", 2),
        ("devices", "0,1", [0, 1]),
        ("accelerator", "cpu", "CPU"),
        ("num_nodes", "2", 2),
    ],
)
def test_the_same_setting_spelled_differently_is_not_a_conflict(monkeypatch, key, from_cli, in_fabric):
    monkeypatch.setenv(f"FABRICLITE_CLI_{key.upper()}", from_cli)
    arguments = {"accelerator": "auto", "strategy": "auto", "devices": "auto", "num_nodes": 1, "precision": None}
    arguments[key] = in_fabric
    assert apply_cli_settings(**arguments) == tuple({**arguments, key: in_fabric}.values())


def test_state_dict_type_from_the_cli_reaches_fsdp_left_at_its_default_and_conflicts_otherwise(monkeypatch):
    from fabriclite.accelerators import select_accelerator
    from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy, select_strategy

    cpu = select_accelerator("cpu", 2)
    assert fabric_environment({"state_dict_type": "full"}) == {"FABRICLITE_CLI_STATE_DICT_TYPE": "full"}
    monkeypatch.setenv("FABRICLITE_CLI_STATE_DICT_TYPE", "full")
    assert select_strategy("fsdp", cpu, 1).state_dict_type == "full"
    assert select_strategy("fsdp_cpu_offload", cpu, 1).state_dict_type == "full"
    assert select_strategy(FSDPStrategy(state_dict_type="full"), cpu, 1).state_dict_type == "full"
    assert select_strategy(ModelParallelStrategy(lambda model, mesh: model), cpu, 1).state_dict_type == "full"
    select_strategy("ddp", cpu, 1)  # writes full checkpoints anyway
    monkeypatch.setenv("FABRICLITE_CLI_STATE_DICT_TYPE", "sharded")
    expected = "state_dict_type='full' of FSDPStrategy conflicts with `fabriclite run --state-dict-type sharded`"
    with pytest.raises(ValueError, match=re.escape(expected)):
        select_strategy(FSDPStrategy(state_dict_type="full"), cpu, 1)
    with pytest.raises(ValueError, match="`fabriclite run --state-dict-type sharded` needs a strategy that shards"):
        select_strategy("ddp", cpu, 1)


def test_settings_the_cli_did_not_set_leave_fabric_alone(monkeypatch):
    monkeypatch.delenv("FABRICLITE_CLI_DEVICES", raising=False)
    assert apply_cli_settings("cpu", "ddp", 3, 1, "16") == ("cpu", "ddp", 3, 1, "16")


# ---------------------------------------------------------------- config file, flags, torchrun's arguments
def test_flags_override_the_config_file(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("devices: 1\nprecision: BF16-mixed\nmax_restarts: 2\nnum_nodes: 1\n")
    args = build_parser().parse_args(["run", "--config", str(config), "--devices", "2", "x.py", "--devices", "7"])
    assert resolve_settings(args) == {"devices": 2, "precision": "bf16-mixed", "max_restarts": 2, "num_nodes": 1}
    assert args.script_args == ["--devices", "7"]


def test_an_unknown_config_key_names_the_valid_keys_and_the_closest(tmp_path, script, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("precison: bf16-mixed\n")
    err = fails_with(capsys, "run", "--config", str(config), script)
    assert "Unknown setting 'precison'" in err
    assert "Valid settings: accelerator, strategy, devices, num_nodes, node_rank, main_address" in err
    assert "Did you mean 'precision'?" in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("num_nodes: '2'\n", "num_nodes='2' must be an integer"),
        ("main_port: true\n", "main_port=True must be an integer"),
        ("accelerator: 1\n", "accelerator=1 must be a string"),
        ("devices: 1.5\n", "devices=1.5 is not valid"),
        ("- devices\n", "must hold a mapping"),
        ("devices: [1\n", "is not valid YAML"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_refused(tmp_path, script, capsys, content, message):
    config = tmp_path / "run.yaml"
    config.write_text(content)
    assert message in fails_with(capsys, "run", "--config", str(config), script)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--precision", "bf61"], "precision='bf61' is not supported. Valid choices:"),
        (["--accelerator", "cpux"], "Did you mean 'cpu'?"),
        (["--strategy", "dpp"], "Did you mean 'ddp'?"),
        (["--devices", "0"], "devices='0' is not valid"),
        (["--accelerator", "cpu", "--devices", "-1"], "with accelerator='cpu'"),
        (["--num-nodes", "2"], "needs --main-address"),
        (["--num-nodes", "2", "--node-rank", "2", "--main-address", "h"], "node_rank=2 must be below num_nodes=2"),
        (["--main-port", "70000"], "main_port=70000 is not a TCP port"),
        (["--max-restarts", "-1"], "max_restarts=-1 must be 0 or more"),
        (["--node-timeout", "0"], "node_timeout=0 must be 1 second or more"),
        (["--num-nodes", "two"], "invalid int value: 'two'"),
        (["--state-dict-type", "consolidated"], "state_dict_type='consolidated' is not supported. Valid choices:"),
        (["--config", "missing.yaml"], "cannot read it"),
    ],
)
def test_bad_values_are_refused_before_anything_starts(script, capsys, flags, message):
    assert message in fails_with(capsys, "run", *flags, script)


def test_a_missing_script_is_refused(capsys):
    assert "script 'no_such_train.py' does not exist" in fails_with(capsys, "run", "no_such_train.py")


def test_run_without_a_script_says_where_the_script_goes(capsys):
    for argv in (["run"], ["run", "--devices", "2"]):
        error = fails_with(capsys, *argv)
        assert "no script to run: name it after the options, e.g. `fabriclite run --devices 2 train.py" in error
        assert "script_args" not in error


def test_version_prints_the_package_version(capsys):
    import fabriclite

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"fabriclite {fabriclite.__version__}\n"


def test_more_cpu_processes_than_cores_get_a_hint_from_run_and_from_launch(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(  # this machine, seen as one core by every process
        "import os, sys\nos.cpu_count = lambda: 1\nfrom fabriclite import Fabric\n"
        "fabric = Fabric(accelerator='cpu', devices=sys.argv[1] if len(sys.argv) > 1 else 'auto')\n"
        "fabric.launch()\nfabric.barrier()\nprint('TRAINED')\n"
    )
    for command in (["-m", "fabriclite.cli", "run", "--devices", "2", str(script)], [str(script), "2"]):
        result = run_python(*command, timeout=120)
        hint = "starting 2 processes on a CPU with 1 core(s): each gets less than one core"
        assert result.stderr.count(hint) == 1, (command, result.stderr)  # from local rank 0 only
        assert result.stdout.count("TRAINED") == 2, (command, result.stdout)  # a hint, not a refusal


def test_device_lists_travel_as_text_that_parses_back():
    assert fabric_environment({"devices": [0, 1], "node_rank": 1}) == {"FABRICLITE_CLI_DEVICES": "0,1"}
    assert fabric_environment({"devices": [3]}) == {"FABRICLITE_CLI_DEVICES": "3,"}


def test_consolidate_is_a_documented_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["consolidate", "--help"])
    assert "SHARDED_DIR" in capsys.readouterr().out


# ---------------------------------------------------------------- real processes
def test_the_console_script_documents_every_setting():
    console_script = Path(sys.executable).parent / "fabriclite"
    if not console_script.exists():
        pytest.skip("the `fabriclite` console script is not installed (pip install -e .)")
    out = run_python(str(console_script), "run", "--help", timeout=60).stdout
    for flag in ("--config", "--accelerator", "--strategy", "--devices", "--num-nodes", "--node-rank"):
        assert flag in out
    for flag in (
        "--main-address",
        "--main-port",
        "--precision",
        "--max-restarts",
        "--state-dict-type",
        "FABRICLITE_CLI_",
    ):
        assert flag in out


def test_a_bad_value_exits_2_with_the_parsers_message_and_starts_nothing(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = run_python("-m", "fabriclite.cli", "run", "--precision", "bf61", str(script), check=False, timeout=60)
    assert result.returncode == 2
    assert "precision='bf61' is not supported. Valid choices:" in result.stderr
    assert not marker.exists()


def test_two_cpu_processes_get_the_settings_of_the_config_and_flags_and_the_script_args(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("devices: 1\nprecision: bf16-mixed\n")
    out = run_python(
        "-m", "fabriclite.cli", "run", "--config", str(config), "--devices", "2", "--accelerator", "cpu",
        REPORT, "hello", "--lr", "0.1", timeout=120,
    ).stdout  # fmt: skip
    args = "['hello', '--lr', '0.1']"
    assert reports(out) == [(r, "2", "0", "cpu", "bf16-mixed", args, "3") for r in "01"], out


def test_two_nodes_over_loopback_form_one_world(tmp_path):
    port = str(free_port())

    def node(rank):
        return run_python(
            "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--num-nodes", "2", "--node-rank", str(rank),
            "--devices", "1", "--main-address", "127.0.0.1", "--main-port", port, REPORT, f"node{rank}", timeout=150,
        ).stdout  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        outputs = list(pool.map(node, [0, 1]))
    assert reports(outputs[0]) == [("0", "2", "0", "cpu", "32-true", "['node0']", "3")], outputs[0]
    assert reports(outputs[1]) == [("1", "2", "1", "cpu", "32-true", "['node1']", "3")], outputs[1]


def pid_alive(pid):
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True, check=False).returncode == 0


def run_stopping(mode, pid_dir, timeout):
    return run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "cli_stops.py"), mode,
        str(pid_dir), check=False, timeout=timeout,
    )  # fmt: skip


def worker_pids(pid_dir):
    return [int(path.read_text()) for path in sorted(pid_dir.iterdir())]


def test_a_rank_that_fails_ends_the_run_with_its_exit_code_and_no_orphans(tmp_path):
    start = time.monotonic()
    result = run_stopping("fail", tmp_path, timeout=100)
    assert time.monotonic() - start < 60  # rank 0 sleeps 120 s: torchrun stopped it
    assert result.returncode == 3, result.stderr[-3000:]
    assert "unreachable" not in result.stdout
    pids = worker_pids(tmp_path)
    assert len(pids) == 2, result.stderr[-3000:]
    time.sleep(0.5)
    assert not any(pid_alive(pid) for pid in pids)


def test_sigterm_twice_to_fabriclite_run_stops_every_rank_and_exits_75(tmp_path):
    # The first SIGTERM is a preemption notice (these ranks never read fabric.preempted, so they sleep on); the
    # second, nothing being saved, makes every rank leave with "preempted, resumable".
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_stopping, "sleep", tmp_path, 100)
        deadline = time.monotonic() + 60
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline and not running.done():
            time.sleep(0.2)
        time.sleep(0.2)  # let the second PID file be written in full
        pids = worker_pids(tmp_path)
        assert len(pids) == 2
        # On one machine `fabriclite run` starts the workers itself: their parent is the command.
        launcher = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(launcher, signal.SIGTERM)
        time.sleep(3)  # later than one notice come twice
        os.kill(launcher, signal.SIGTERM)
        result = running.result()
    assert result.returncode == 75, result.stderr[-3000:]
    assert "SIGTERM received again; the ranks exit once their saves under way have ended." in result.stderr
    time.sleep(0.5)
    assert not any(pid_alive(pid) for pid in pids)
