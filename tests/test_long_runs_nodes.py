"""Long runs across nodes, for real: two `fabriclite run` on loopback, one process each, node 0 hosting the store.
A rank killed on either node restarts every node and the run ends bit-identical to one never interrupted; a lost
node supervisor stops the other with no rank left behind; a preemption notice to any node ends every node
preempted, and the same commands resume it. (How the supervisors keep in step, without training: test_nodes.py.)"""

import re
import signal
import time

import pytest
import torch
from helpers import (
    LONG_RUN_SCRIPT,
    LONG_RUN_TIMEOUT,
    assert_same_weights,
    finish,
    kill_rank,
    pids,
    read_until,
    sigkill,
    start_python,
    still_running,
)

from fabriclite.plugins.environments import free_port
from fabriclite.processes.preemption import PREEMPTED_EXIT_CODE

SCRIPT = LONG_RUN_SCRIPT
TIMEOUT = LONG_RUN_TIMEOUT


def node_args(node, port, folder, out, *flags, restarts=0, strategy="ddp", launcher=()):
    """One node's `fabriclite run` of a two-node run with one process per node; node 0 hosts the store on ``port``.
    ``flags`` go to the script, ``launcher`` to `fabriclite run`."""
    return [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1", "--strategy", strategy,
        "--num-nodes", "2", "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port", str(port),
        "--max-restarts", str(restarts), *launcher, SCRIPT, str(folder), "--out", str(out), *flags,
    ]  # fmt: skip


def two_nodes(tmp_path, name, *flags, restarts=0, at=None, act=None, strategy="ddp", port=None, launcher=()):
    """Run both nodes (checkpoints in the folder ``name``, weights in ``name``.pt; node 0's store on ``port``, else
    a free one); with ``at``, wait for node 0's output line ``at`` and call ``act(supervisors, ranks)`` (``ranks``:
    global rank -> PID). Return both exit codes, both outputs and ``ranks``."""
    port = port or free_port()
    folder, out = tmp_path / name, tmp_path / f"{name}.pt"
    args = [
        node_args(node, port, folder, out, *flags, restarts=restarts, strategy=strategy, launcher=launcher)
        for node in (0, 1)
    ]
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
        (1, "node 1's supervisor stopped answering (no heartbeat for 15 s)"),
        (0, "lost the connection to node 0's supervisor at 127.0.0.1:"),
    ],
    ids=["node-1", "node-0-with-the-store"],
)
def test_across_nodes_a_sigkilled_node_supervisor_stops_the_other_node_and_leaves_no_rank(tmp_path, killed, message):
    def kill_node(nodes, ranks):
        nodes[killed].send_signal(signal.SIGKILL)

    quicker = ["--node-timeout", "15"]  # than the default 60 s (a loaded machine still beats every second)
    codes, outputs, ranks = two_nodes(
        tmp_path, "run", "--sleep", "0.2", restarts=1, at="step 3\n", act=kill_node, launcher=quicker
    )
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
    def three_times(nodes, ranks):  # while rank 0 writes for 60 s: the second notice waits for it, the third kills
        for _ in range(3):
            nodes[0].send_signal(signal.SIGTERM)
            time.sleep(2.5)  # later than one notice come twice

    flags = ("--save-every", "1", "--slow-io", "60")
    codes, outputs, ranks = two_nodes(tmp_path, "run", *flags, at="saving", act=three_times)
    assert codes == [128 + signal.SIGTERM] * 2, outputs
    assert "SIGTERM received a third time; killing every rank." in outputs[0], outputs
    assert "node 0 ended the run with exit code 143 (received SIGTERM 3 times)" in outputs[1], outputs[1][-3000:]
    assert still_running(list(ranks.values()), within=30) == []
