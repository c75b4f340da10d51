"""Long runs on shared machines: `fabriclite run --max-restarts` restarts the whole group when a rank dies, a
preemption notice (SIGTERM, SIGUSR1) makes every rank save at the same step and the run exit "preempted,
resumable" (or requeue the SLURM job), and the resumed run ends bit-identical to one never interrupted."""

import atexit
import os
import re
import signal
import subprocess
import textwrap

import pytest
import torch
from helpers import ROOT, SCRIPTS, fake_scontrol, read_until, run_python, sigkill, start_python, still_running

from fabriclite.plugins.environments import free_port
from fabriclite.preemption import PREEMPTED_EXIT_CODE

SCRIPT = str(SCRIPTS / "long_run.py")
TIMEOUT = 300


def run_args(folder, out, *flags, strategy="ddp", restarts=0):
    return [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--strategy", strategy,
        "--max-restarts", str(restarts), SCRIPT, str(folder), "--out", str(out), *flags,
    ]  # fmt: skip


def reference(tmp_path, strategy="ddp"):
    """The final weights of the same run, never interrupted."""
    run_python(*run_args(tmp_path / "ref", tmp_path / "ref.pt", strategy=strategy), timeout=TIMEOUT)
    return torch.load(tmp_path / "ref.pt")


def assert_same_weights(expected, path):
    actual = torch.load(path)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), f"{key} differs from the uninterrupted run"


def pids(output):
    return {int(rank): int(pid) for rank, pid in re.findall(r"pid (\d) (\d+)", output)}


def finish(child):
    try:
        output, _ = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        sigkill(child)
        raise AssertionError(f"the run did not end within {TIMEOUT} s") from None
    return output


def interrupted(args, at, act, **env):
    """Start ``python *args``, wait for the output line ``at``, call ``act(child, ranks)`` (``ranks``: rank -> PID
    from the "pid" lines so far), and wait for the run to end; return (its exit code, its output, ``ranks``)."""
    child = start_python(*args, **env)
    try:
        before = read_until(child, at, timeout=TIMEOUT)
        ranks = pids(before)
        act(child, ranks)
        output = before + finish(child)
    finally:
        sigkill(child)
    return child.returncode, output, ranks


def kill_rank(rank):
    return lambda child, ranks: os.kill(ranks[rank], signal.SIGKILL)


def send(signum):
    return lambda child, ranks: child.send_signal(signum)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_sigkilled_mid_run_restarts_the_group_which_ends_bit_identical(tmp_path, strategy):
    expected = reference(tmp_path, strategy)
    folder, out = tmp_path / "run", tmp_path / "run.pt"
    args = run_args(folder, out, "--sleep", "0.05", strategy=strategy, restarts=1)
    code, output, _ = interrupted(args, "step 33\n", kill_rank(1))
    assert code == 0, output[-3000:]
    assert (
        "fabriclite: rank 1 was killed by SIGKILL; stopping every rank and starting them again (restart 1 of 1)."
        in output
    )
    resumed = re.findall(r"resumed from step-(\d+)\.ckpt at step (\d+)", output)
    assert len(resumed) == 1 and resumed[0][0].lstrip("0") == resumed[0][1] and int(resumed[0][1]) >= 20, output[-3000:]
    assert_same_weights(expected, out)
    assert sorted(path.name for path in folder.iterdir()) == ["step-0060.ckpt", "step-0070.ckpt"]  # keep_last=2


def test_fabric_launch_restarts_its_ranks_with_fabriclite_max_restarts(tmp_path):
    expected = reference(tmp_path)
    folder, out = tmp_path / "run", tmp_path / "run.pt"
    args = [SCRIPT, str(folder), "--out", str(out), "--accelerator", "cpu", "--devices", "2", "--sleep", "0.05"]
    code, output, _ = interrupted(args, "step 33\n", kill_rank(0), FABRICLITE_MAX_RESTARTS="1")  # a child too
    assert code == 0, output[-3000:]
    assert (
        "fabriclite: rank 0 was killed by SIGKILL; stopping every rank and starting them again (restart 1 of 1)."
        in output
    )
    assert_same_weights(expected, out)


def test_a_bad_fabriclite_max_restarts_is_refused_naming_it(tmp_path):
    args = [SCRIPT, str(tmp_path), "--out", str(tmp_path / "w.pt"), "--accelerator", "cpu", "--devices", "2"]
    result = run_python(*args, FABRICLITE_MAX_RESTARTS="two", check=False, timeout=120)
    assert result.returncode != 0
    assert "FABRICLITE_MAX_RESTARTS='two' must be a whole number, 0 or more" in result.stderr


def test_without_restarts_left_the_run_ends_with_the_dead_ranks_code_and_no_rank_lives_on(tmp_path):
    args = run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "0.2")
    code, output, ranks = interrupted(args, "step 3\n", kill_rank(0))
    assert code == 128 + signal.SIGKILL, output[-3000:]
    assert "fabriclite: rank 0 was killed by SIGKILL; stopping every rank." in output
    assert still_running(list(ranks.values()), within=30) == []


def test_ranks_stop_within_seconds_when_the_launcher_is_sigkilled(tmp_path):
    child = start_python(*run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "0.2", restarts=1))
    try:
        ranks = pids(read_until(child, "step 3\n", timeout=TIMEOUT))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
        assert still_running(list(ranks.values()), within=30) == []
    finally:
        sigkill(child)


@pytest.mark.parametrize(
    ("signum", "flags"), [(signal.SIGTERM, []), (signal.SIGUSR1, ["--asynchronous"])], ids=["SIGTERM", "SIGUSR1-async"]
)
def test_a_preemption_notice_saves_every_rank_at_one_step_and_the_rerun_ends_bit_identical(tmp_path, signum, flags):
    expected = reference(tmp_path)
    args = run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "0.05", *flags, restarts=1)
    code, output, _ = interrupted(args, "step 20\n", send(signum))
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", output))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    assert f"Exit code {PREEMPTED_EXIT_CODE}: run it again to resume" in output
    assert "restart" not in output  # a preemption is not a failure

    again = run_python(*args, timeout=TIMEOUT).stdout
    assert f"resumed from step-{int(saved['0']):04d}.ckpt at step {saved['0']}" in again, again[-3000:]
    assert_same_weights(expected, tmp_path / "run.pt")


def test_a_notice_to_one_rank_alone_ends_the_run_preempted_and_restarts_nothing(tmp_path):
    args = run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "0.05", restarts=1)
    code, output, _ = interrupted(args, "step 5\n", lambda child, ranks: os.kill(ranks[1], signal.SIGUSR1))
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]  # the ranks' 75 says it, though this launcher got no signal
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", output))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], output[-3000:]
    assert "restart" not in output and f"Exit code {PREEMPTED_EXIT_CODE}" in output, output[-3000:]


@pytest.mark.parametrize("allowed", [True, False])
def test_in_a_slurm_job_a_preempted_run_requeues_it_when_allowed(tmp_path, allowed):
    """SLURM itself cannot run here: a stand-in `scontrol` on PATH records the call and answers as SLURM does."""
    env, log = fake_scontrol(tmp_path / "bin", allowed)
    args = run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "0.05")
    code, output, _ = interrupted(args, "step 5\n", send(signal.SIGUSR1), **env)
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert log.read_text() == "requeue 4242\n"
    if allowed:
        assert "fabriclite: requeued SLURM job 4242" in output
    else:
        assert "SLURM did not requeue job 4242: Requested operation not supported on this job." in output
        assert f"Exit code {PREEMPTED_EXIT_CODE}" in output


def test_a_second_signal_kills_every_rank_at_once(tmp_path):
    def twice(child, ranks):
        child.send_signal(signal.SIGTERM)  # every rank now sleeps 30 s before it can save
        read_until(child, "received SIGTERM", timeout=60)
        child.send_signal(signal.SIGTERM)

    args = run_args(tmp_path / "run", tmp_path / "run.pt", "--sleep", "30")
    code, output, ranks = interrupted(args, "step 1\n", twice)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "SIGTERM received again; killing every rank." in output
    assert still_running(list(ranks.values()), within=30) == []


def test_ranks_that_do_not_exit_by_the_deadline_after_a_notice_are_killed():
    rank = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
    supervise = textwrap.dedent(f"""\
        import sys
        from fabriclite.supervisor import Supervisor
        sys.exit(Supervisor([sys.executable, "-c", {rank!r}], processes=2, deadline=3).run())
    """)
    code, output, _ = interrupted(["-c", supervise], "ready", send(signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, output
    assert "the ranks did not exit within 3 s of the preemption notice; killing them." in output


# ---------------------------------------------------------------- across nodes: two `fabriclite run` on loopback
def node_args(node, port, folder, out, *flags, restarts=0, strategy="ddp"):
    """One node's `fabriclite run` of a two-node run with one process per node; node 0 hosts the store on ``port``."""
    return [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1", "--strategy", strategy,
        "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port", str(port),
        "--max-restarts", str(restarts), SCRIPT, str(folder), "--out", str(out), *flags,
    ]  # fmt: skip


def two_nodes(tmp_path, name, *flags, restarts=0, at=None, act=None, strategy="ddp", port=None):
    """Run both nodes (checkpoints in the folder ``name``, weights in ``name``.pt; node 0's store on ``port``, else
    a free one); with ``at``, wait for node 0's output line ``at`` and call ``act(supervisors, ranks)`` (``ranks``:
    global rank -> PID). Return both exit codes, both outputs and ``ranks``."""
    port = port or free_port()
    folder, out = tmp_path / name, tmp_path / f"{name}.pt"
    args = [node_args(node, port, folder, out, *flags, restarts=restarts, strategy=strategy) for node in (0, 1)]
    nodes = [start_python(*args[node]) for node in (0, 1)]
    try:
        before, ranks = ["", ""], {}
        if at is not None:
            before[1] = read_until(nodes[1], "pid 1 ", timeout=TIMEOUT)
            before[0] = read_until(nodes[0], at, timeout=TIMEOUT)
            ranks = {**pids(before[0]), **pids(before[1])}
            act(nodes, ranks)
        outputs = [before[node] + finish(nodes[node]) for node in (0, 1)]
    finally:
        for node in nodes:
            sigkill(node)
    return [node.returncode for node in nodes], outputs, ranks


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_across_nodes_a_rank_sigkilled_mid_run_restarts_every_node_and_ends_bit_identical(tmp_path, strategy):
    codes, outputs, _ = two_nodes(tmp_path, "ref", strategy=strategy)
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    expected = torch.load(tmp_path / "ref.pt")
    kill = {"restarts": 1, "at": "step 33\n", "act": kill_rank(1)}
    codes, outputs, _ = two_nodes(tmp_path, "run", "--sleep", "0.05", strategy=strategy, **kill)
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    line = "fabriclite: rank 1 on node 1 was killed by SIGKILL; stopping every rank and starting them again (restart 1 of 1)."
    assert all(output.count(line) == 1 for output in outputs), outputs
    resumed = re.findall(r"resumed from step-(\d+)\.ckpt at step (\d+)", outputs[0])
    assert len(resumed) == 1 and int(resumed[0][1]) >= 20, outputs[0][-3000:]
    assert_same_weights(expected, tmp_path / "run.pt")


def test_across_nodes_more_failures_than_restarts_end_every_node_with_the_failure_naming_the_rank(tmp_path):
    codes, outputs, ranks = two_nodes(tmp_path, "run", "--sleep", "0.2", at="step 3\n", act=kill_rank(1))
    assert codes == [128 + signal.SIGKILL] * 2, outputs
    assert all("fabriclite: rank 1 on node 1 was killed by SIGKILL; stopping every rank." in out for out in outputs)
    assert sorted(ranks) == [0, 1] and still_running(list(ranks.values()), within=30) == []


@pytest.mark.parametrize(
    ("killed", "message"),
    [
        (1, "node 1's supervisor stopped answering (no heartbeat for 60 s)"),
        (0, "lost the connection to node 0's supervisor at 127.0.0.1:"),
    ],
    ids=["node-1", "node-0-with-the-store"],
)
def test_across_nodes_a_sigkilled_node_supervisor_stops_the_other_node_and_leaves_no_rank(tmp_path, killed, message):
    def kill_node(nodes, ranks):
        nodes[killed].send_signal(signal.SIGKILL)

    codes, outputs, ranks = two_nodes(tmp_path, "run", "--sleep", "0.2", restarts=1, at="step 3\n", act=kill_node)
    other = 1 - killed
    assert codes[other] == 1, outputs[other][-3000:]
    assert message in outputs[other], outputs[other][-3000:]
    assert f"stopping every rank of node {other}." in outputs[other] and "restart 1 of 1" not in outputs[other]
    assert sorted(ranks) == [0, 1] and still_running(list(ranks.values()), within=30) == []


@pytest.mark.parametrize("signalled", [[0], [0, 1]], ids=["node-0-only", "every-node"])
def test_across_nodes_a_preemption_notice_ends_every_node_preempted(tmp_path, signalled):
    def notice(nodes, ranks):  # a spot instance's notice reaches one machine; SLURM's, every node
        for node in signalled:
            nodes[node].send_signal(signal.SIGTERM)

    codes, outputs, _ = two_nodes(tmp_path, "run", "--sleep", "0.05", restarts=1, at="step 20\n", act=notice)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, outputs
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", outputs[0] + outputs[1]))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], outputs
    assert all(f"Exit code {PREEMPTED_EXIT_CODE}: run it again to resume" in output for output in outputs)
    assert all("restart" not in output for output in outputs)


def test_across_nodes_a_preempted_run_saves_at_one_step_and_the_same_commands_resume_it_bit_identical(tmp_path):
    def notice(nodes, ranks):  # to node 0's supervisor alone, as a spot instance's
        nodes[0].send_signal(signal.SIGTERM)

    codes, outputs, _ = two_nodes(tmp_path, "ref")
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    expected = torch.load(tmp_path / "ref.pt")

    port = free_port()
    flags = ("--sleep", "0.05")
    codes, outputs, _ = two_nodes(tmp_path, "run", *flags, port=port, at="step 20\n", act=notice)
    assert codes == [PREEMPTED_EXIT_CODE] * 2, outputs[0][-3000:] + outputs[1][-3000:]
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", outputs[0] + outputs[1]))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], outputs
    assert not (tmp_path / "run.pt").exists()  # it stopped before the end

    # A requeued job runs the same two commands again: load_latest at the script's top resumes both ranks.
    codes, outputs, _ = two_nodes(tmp_path, "run", *flags, port=port)
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    line = f"resumed from step-{int(saved['0']):04d}.ckpt at step {saved['0']}"  # said by rank 0, on node 0
    assert line in outputs[0] and "fresh start" not in outputs[0], outputs[0][-3000:]
    assert_same_weights(expected, tmp_path / "run.pt")


def test_across_nodes_a_node_that_ends_the_run_alone_ends_the_others_with_its_code(tmp_path):
    def twice(nodes, ranks):
        nodes[0].send_signal(signal.SIGTERM)  # every rank now sleeps 30 s before it can save
        read_until(nodes[0], "received SIGTERM", timeout=60)
        nodes[0].send_signal(signal.SIGTERM)

    codes, outputs, ranks = two_nodes(tmp_path, "run", "--sleep", "30", at="step 1\n", act=twice)
    assert codes == [128 + signal.SIGTERM] * 2, outputs
    assert "SIGTERM received again; killing every rank." in outputs[0], outputs
    assert "node 0 ended the run with exit code 143 (received SIGTERM twice)" in outputs[1], outputs[1][-3000:]
    assert still_running(list(ranks.values()), within=30) == []


@pytest.fixture
def preemption_reset():
    from fabriclite import preemption

    handlers = {signum: signal.getsignal(signum) for signum in preemption.SIGNALS}
    yield preemption
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    preemption._received, preemption._installed, preemption._agreed, preemption._in_flight = None, False, False, None
    atexit.unregister(preemption._end)  # this process is pytest: nothing to requeue when it ends


def test_fabric_preempted_turns_true_after_sigusr1_and_stays_true(preemption_reset):
    from fabriclite import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    assert fabric.preempted is False  # the first read installs the handlers
    os.kill(os.getpid(), signal.SIGUSR1)
    assert fabric.preempted is True
    assert fabric.preempted is True
    assert preemption_reset._received == signal.SIGUSR1


def test_signals_keep_their_usual_effect_until_preempted_is_read(tmp_path):
    code = "import os, signal; from fabriclite import Fabric; Fabric(accelerator='cpu', devices=1); os.kill(os.getpid(), signal.SIGTERM); print('survived')"
    result = run_python("-c", code, check=False, timeout=120)
    assert result.returncode == -signal.SIGTERM and "survived" not in result.stdout


def docs_script(tmp_path):
    """The script of docs/long-runs.md, made to run in the folder given as its first argument."""
    page = (ROOT / "docs" / "long-runs.md").read_text()
    code = page.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "long_run.py"
    script.write_text("import os, sys\nos.chdir(sys.argv[1])\n" + code)
    return str(script)


def test_the_docs_script_preempted_by_sigterm_exits_75_and_resumes_bit_identical(tmp_path):
    script = docs_script(tmp_path)
    command = ["-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--max-restarts", "1", script]
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    run_python(*command, str(tmp_path / "ref"), timeout=TIMEOUT)
    code, output, _ = interrupted([*command, str(tmp_path / "run")], "saved step 20\n", send(signal.SIGTERM))
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    step = re.findall(r"preempted: saved at step (\d+)", output)
    assert len(step) == 1, output[-3000:]
    again = run_python(*command, str(tmp_path / "run"), timeout=TIMEOUT).stdout
    assert f"resumed from checkpoints/step-{int(step[0]):06d}.ckpt at step {step[0]}" in again, again[-3000:]
    assert_same_weights(torch.load(tmp_path / "ref" / "final.pt"), tmp_path / "run" / "final.pt")
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) == 3  # keep_last=3
