"""Long runs across nodes, for real: two `fabriclite run --num-nodes 2` on loopback (torch's elastic agent on each,
node 0 hosting the c10d rendezvous), one process each. A rank killed on either node restarts every node and the run
ends bit-identical to one never interrupted; a lost node's `fabriclite run` ends the other with no rank left
behind; a preemption notice to any node ends every node preempted, and the same commands resume it; a failure that
repeats is not restarted. (Without training: test_nodes.py.)

torch's rendezvous orders the nodes its own way, so which node runs global rank 0 is its choice: the tests read both
nodes' output together."""

import re
import signal
import threading
import time

import pytest
import torch
from helpers import (
    LONG_RUN_SCRIPT,
    LONG_RUN_TIMEOUT,
    SCRIPTS,
    assert_same_weights,
    kill_rank,
    pids,
    sigkill,
    start_python,
    still_running,
)

from fabriclite.plugins.environments import free_port
from fabriclite.processes.preemption import PREEMPTED_EXIT_CODE

SCRIPT = LONG_RUN_SCRIPT
TIMEOUT = LONG_RUN_TIMEOUT


class TwoNodes:
    """Both nodes' `fabriclite run` of ``script`` (default: long_run.py) with one process each; their output is read
    as it comes, so the test can wait for a line from either node."""

    def __init__(
        self, tmp_path, name, *flags, restarts=0, strategy="ddp", port=None, launcher=(), script=SCRIPT, mode=()
    ):
        port = port or free_port()
        self.folder, self.out = tmp_path / name, tmp_path / f"{name}.pt"
        args = [
            [
                "-m",
                "fabriclite.cli",
                "run",
                "--accelerator",
                "cpu",
                "--devices",
                "1",
                "--strategy",
                strategy,
                "--num-nodes",
                "2",
                "--node-rank",
                str(node),
                "--main-address",
                "127.0.0.1",
                "--main-port",
                str(port),
                "--max-restarts",
                str(restarts),
                *launcher,
                script,
                *mode,
                str(self.folder),
                *flags,
            ]  # fmt: skip
            for node in (0, 1)
        ]
        if script == SCRIPT:
            args = [[*node, "--out", str(self.out)] for node in args]
        self.nodes = [start_python(*node) for node in args]
        self.outputs = ["", ""]
        self.readers = [threading.Thread(target=self._read, args=(node,), daemon=True) for node in (0, 1)]
        for reader in self.readers:
            reader.start()

    def _read(self, node):
        for line in self.nodes[node].stdout:
            self.outputs[node] += line

    def wait_for(self, pattern, count=1):
        """Wait until ``count`` lines from either node match ``pattern``; return rank -> PID (from long_run.py)."""
        deadline = time.monotonic() + TIMEOUT
        while len(re.findall(pattern, "".join(self.outputs))) < count:
            assert time.monotonic() < deadline, f"no {pattern!r} within {TIMEOUT} s:\n" + "\n".join(self.outputs)
            assert all(node.poll() is None for node in self.nodes), "a node ended:\n" + "\n".join(self.outputs)
            time.sleep(0.1)
        return pids("".join(self.outputs))

    def finish(self):
        """Both exit codes once both nodes have ended; fails the test after the timeout."""
        try:
            for node in self.nodes:
                node.wait(timeout=TIMEOUT)
            for reader in self.readers:
                reader.join(timeout=30)
        finally:
            for node in self.nodes:
                sigkill(node)
        return [node.returncode for node in self.nodes]

    @property
    def both(self):
        return "\n".join(self.outputs)


def test_across_nodes_a_rank_sigkilled_mid_run_restarts_every_node_and_ends_bit_identical(tmp_path):
    # FSDP only: the restart across nodes does not depend on the strategy, and FSDP's sharded checkpoint is the harder
    # resume (DDP's killed-and-resumed run is tests/test_long_runs.py's, on one machine).
    strategy = "fsdp"
    reference = TwoNodes(tmp_path, "ref", strategy=strategy)
    assert reference.finish() == [0, 0], reference.both[-6000:]
    expected = torch.load(reference.out)
    run = TwoNodes(tmp_path, "run", "--sleep", "0.05", strategy=strategy, restarts=1)
    kill_rank(1)(None, run.wait_for(r"step 33\n"))
    assert run.finish() == [0, 0], run.both[-6000:]
    # Both nodes name the rank killed; its node counts a restart, and so may the other, whose rank's collective broke
    # (torch counts a restart on every node whose rank failed).
    killed = r"fabriclite: rank 1 on node \d was killed by SIGKILL; stopping every rank on every node and starting them again"
    assert all(len(re.findall(killed, output)) == 1 for output in run.outputs), run.both[-6000:]
    assert re.search(killed + r" \(restart 1 of 1\)\.", run.both), run.both[-6000:]
    resumed = re.findall(r"resumed from step-(\d+)\.ckpt at step (\d+)", run.both)
    assert len(resumed) == 1 and int(resumed[0][1]) >= 20, run.both[-6000:]
    assert_same_weights(expected, run.out)


def test_across_nodes_more_failures_than_restarts_end_every_node_with_the_failure_naming_the_rank(tmp_path):
    run = TwoNodes(tmp_path, "run", "--sleep", "0.2")
    ranks = run.wait_for(r"step 3\n")
    kill_rank(1)(None, ranks)
    assert run.finish() == [128 + signal.SIGKILL] * 2, run.both[-6000:]
    line = r"fabriclite: rank 1 on node \d was killed by SIGKILL; stopping every rank\."
    assert all(re.search(line, output) for output in run.outputs), run.both[-6000:]
    assert sorted(ranks) == [0, 1] and still_running(list(ranks.values()), within=30) == []


@pytest.mark.parametrize("killed", [1, 0], ids=["node-1", "node-0-with-the-rendezvous"])
def test_across_nodes_a_sigkilled_node_run_stops_the_other_node_and_leaves_no_rank(tmp_path, killed):
    quicker = ["--node-timeout", "30"]  # than the default 600 s: how long a restart waits for the lost node
    run = TwoNodes(tmp_path, "run", "--sleep", "0.2", restarts=1, launcher=quicker)
    ranks = run.wait_for(r"step 3\n")
    run.nodes[killed].send_signal(signal.SIGKILL)
    codes = run.finish()
    other = 1 - killed
    assert codes[other] == 1, run.outputs[other][-3000:]
    if killed == 1:  # the restart waits for node 1 to rejoin, for --node-timeout
        assert "the nodes did not all join within 30 s (--node-timeout)" in run.outputs[other], run.outputs[other]
    else:  # the rendezvous went with node 0
        assert re.search(r"the run ended on another node|lost the rendezvous", run.outputs[other]), run.outputs[other]
    assert sorted(ranks) == [0, 1] and still_running(list(ranks.values()), within=30) == []


@pytest.mark.parametrize("signalled", [[0], [0, 1]], ids=["node-0-only", "every-node"])
def test_across_nodes_a_preemption_notice_ends_every_node_preempted(tmp_path, signalled):
    # A spot instance's notice reaches one machine; SLURM's, every node.
    run = TwoNodes(tmp_path, "run", "--sleep", "0.05", restarts=1)
    run.wait_for(r"step 20\n")
    for node in signalled:
        run.nodes[node].send_signal(signal.SIGTERM)
    assert run.finish() == [PREEMPTED_EXIT_CODE] * 2, run.both[-6000:]
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", run.both))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], run.both[-6000:]
    assert all(f"Exit code {PREEMPTED_EXIT_CODE}: run it again to resume" in output for output in run.outputs)
    assert "restart" not in run.both


def test_across_nodes_a_preempted_run_saves_at_one_step_and_the_same_commands_resume_it_bit_identical(tmp_path):
    reference = TwoNodes(tmp_path, "ref")
    assert reference.finish() == [0, 0], reference.both[-6000:]
    expected = torch.load(reference.out)

    port = free_port()
    run = TwoNodes(tmp_path, "run", "--sleep", "0.05", port=port)
    run.wait_for(r"step 20\n")
    run.nodes[0].send_signal(signal.SIGUSR1)  # to node 0's `fabriclite run` alone; torch's agent would die of it
    assert run.finish() == [PREEMPTED_EXIT_CODE] * 2, run.both[-6000:]
    saved = dict(re.findall(r"(\d) saved at step (\d+) on preemption", run.both))
    assert set(saved) == {"0", "1"} and saved["0"] == saved["1"], run.both[-6000:]
    assert not run.out.exists()  # it stopped before the end

    # A requeued job runs the same two commands again: load_latest at the script's top resumes both ranks.
    again = TwoNodes(tmp_path, "run", "--sleep", "0.05", port=port)
    assert again.finish() == [0, 0], again.both[-6000:]
    line = f"resumed from step-{int(saved['0']):04d}.ckpt at step {saved['0']}"  # said by global rank 0
    assert line in again.both and "fresh start" not in again.both, again.both[-6000:]
    assert_same_weights(expected, run.out)


def test_across_nodes_a_node_that_kills_its_ranks_ends_the_others_naming_why(tmp_path):
    run = TwoNodes(tmp_path, "run", "--save-every", "1", "--slow-io", "20")
    ranks = run.wait_for("saving", count=2)
    for _ in range(3):  # while the ranks write for 20 s: the second notice waits for it, the third kills
        run.nodes[0].send_signal(signal.SIGTERM)
        time.sleep(2.5)  # later than one notice come twice
    codes = run.finish()
    assert codes == [128 + signal.SIGTERM, 128 + signal.SIGKILL], run.both[-6000:]
    assert "SIGTERM received a third time; killing every rank." in run.outputs[0], run.outputs[0][-3000:]
    why = r"rank \d on node 0 was killed by SIGKILL \(node 0 received SIGTERM 3 times\); stopping every rank"
    assert re.search(why, run.outputs[1]), run.outputs[1][-3000:]
    assert still_running(list(ranks.values()), within=30) == []


def test_across_nodes_a_failure_that_repeats_from_the_same_checkpoint_is_not_restarted_again(tmp_path):
    # fails_at_step.py "same": rank 1 raises the same error at the same step of every attempt
    script = str(SCRIPTS / "fails_at_step.py")
    run = TwoNodes(tmp_path, "run", restarts=3, script=script, mode=["same"])
    assert run.finish() == [1, 1], run.both[-6000:]
    assert "again: the same failure as in an earlier attempt" in run.both, run.both[-6000:]
    assert "(2 of --max-restarts 3 left unused)" in run.both, run.both[-6000:]


def test_across_nodes_ctrl_c_on_one_node_ends_every_node_and_leaves_no_rank(tmp_path):
    run = TwoNodes(tmp_path, "run", "--sleep", "0.2", restarts=2)
    ranks = run.wait_for(r"step 3\n")
    run.nodes[0].send_signal(signal.SIGINT)
    codes = run.finish()
    assert codes[0] == 128 + signal.SIGINT and codes[1] != 0, run.both[-6000:]
    assert "restart" not in run.outputs[0], run.outputs[0][-3000:]  # an interrupt is no failure to restart after
    assert sorted(ranks) == [0, 1] and still_running(list(ranks.values()), within=30) == []
