"""Supervisors of one run on several machines kept in step (fabriclite/processes/nodes.py), run for real as two
`fabriclite run` on loopback with a script that needs no training: a node whose ranks finished still restarts them
when another node's rank dies, and a node started with settings other than node 0's is refused on its own. The training runs (restarts
ending bit-identical, a lost node, preemption) are in test_long_runs_nodes.py."""

import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import read_until, run_python, sigkill, start_python

from fabriclite.processes.nodes import NodeGroup, NodeGroupError
from fabriclite.plugins.environments import free_port

TIMEOUT = 300

# Rank 0 ends at once; rank 1 ends a few seconds later, with code 3 in the first attempt.
SCRIPT = textwrap.dedent("""\
    import os, sys, time
    rank, attempt = int(os.environ["RANK"]), int(os.environ["FABRICLITE_RESTART_COUNT"])
    print(f"rank {rank} of {os.environ['WORLD_SIZE']} attempt {attempt} port {os.environ['MASTER_PORT']}", flush=True)
    if rank == 1:
        time.sleep(3)
        sys.exit(3 if attempt == 0 else 0)
""")


def run_two_nodes(tmp_path, devices=(1, 1), restarts=0):
    """Both nodes' results (exit code, output), each node a `fabriclite run` of SCRIPT."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    port = str(free_port())

    def node(rank):
        result = run_python(
            "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices[rank]), "--num-nodes",
            "2", "--node-rank", str(rank), "--main-address", "127.0.0.1", "--main-port", port, "--max-restarts",
            str(restarts), str(script), check=False, timeout=TIMEOUT,
        )  # fmt: skip
        return result.returncode, result.stdout + result.stderr

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(node, [0, 1]))


def test_a_node_whose_ranks_finished_starts_them_again_when_another_nodes_rank_dies(tmp_path):
    (code0, out0), (code1, out1) = run_two_nodes(tmp_path, restarts=1)
    assert (code0, code1) == (0, 0), out0 + out1
    line = (
        "fabriclite: rank 1 on node 1 exited with code 3; stopping every rank and starting them again (restart 1 of 1)."
    )
    assert line in out0 and line in out1, out0 + out1
    assert "rank 0 of 2 attempt 0" in out0 and "rank 0 of 2 attempt 1" in out0, out0
    ports = [line.split()[-1] for line in out0.splitlines() if line.startswith("rank 0 of 2")]
    assert len(ports) == 2 and ports[0] != ports[1], out0  # every attempt meets on a fresh port


def test_without_restarts_every_node_exits_with_the_failed_ranks_code(tmp_path):
    (code0, out0), (code1, out1) = run_two_nodes(tmp_path)
    assert (code0, code1) == (3, 3), out0 + out1
    assert all("fabriclite: rank 1 on node 1 exited with code 3; stopping every rank." in out for out in (out0, out1))


# Every rank waits for the file GO, so the run is still on when the wrong latecomer tries to join it.
WAITING_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} attempt 0", flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.1)
""")


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--node-rank", "1"], 2, "this node is refused: another node already joined this run as --node-rank 1"),
        (
            ["--node-rank", "1", "--devices", "2"], 1,
            "this node is refused: node 0 runs --num-nodes 2 with 1 device(s) per node, this node --num-nodes 2 with 2",
        ),
        (
            ["--node-rank", "1", "--num-nodes", "3"], 1,
            "this node is refused: node 0 runs --num-nodes 2 with 1 device(s) per node, this node --num-nodes 3 with 1",
        ),
    ],
    ids=["same-node-rank", "other-devices", "other-num-nodes"],
)  # fmt: skip
def test_a_latecomer_with_wrong_settings_is_refused_alone_and_the_run_goes_on(tmp_path, flags, code, message):
    script, go = tmp_path / "script.py", tmp_path / "go"
    script.write_text(WAITING_SCRIPT)
    port = str(free_port())

    def args(*own):
        settings = {"--devices": "1", "--num-nodes": "2", **dict(zip(own[::2], own[1::2]))}
        return [
            "-m", "fabriclite.cli", "run", "--accelerator", "cpu", *(item for pair in settings.items() for item in pair),
            "--main-address", "127.0.0.1", "--main-port", port, str(script), str(go),
        ]  # fmt: skip

    nodes = [start_python(*args("--node-rank", str(rank))) for rank in (0, 1)]
    try:
        before = read_until(nodes[1], "rank 1 of 2 attempt 0", timeout=TIMEOUT)  # node 1 joined: its rank is taken
        latecomer = run_python(*args(*flags), check=False, timeout=TIMEOUT)
        go.touch()
        outputs = [output + node.communicate(timeout=TIMEOUT)[0] for output, node in zip(["", before], nodes)]
    finally:
        for node in nodes:
            sigkill(node)
    said = latecomer.stdout + latecomer.stderr
    assert latecomer.returncode == code and message in said, said
    assert "attempt" not in said  # it started no rank
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert all("refused" not in output for output in outputs), outputs


# ---------------------------------------------------------------- joining, in this process (real stores on loopback)
def test_a_node_that_cannot_reach_node_0_says_where_it_looked():
    port = free_port()
    with pytest.raises(
        NodeGroupError, match=rf"node 1 could not reach node 0's supervisor at 127.0.0.1:{port} within 2 s"
    ):
        NodeGroup(2, 1, "127.0.0.1", port, processes=1, join_timeout=2).join()


def test_node_0_alone_says_how_many_nodes_joined():
    node = NodeGroup(2, 0, "127.0.0.1", free_port(), processes=1, timeout=5, join_timeout=2)
    try:
        with pytest.raises(NodeGroupError, match="only 1 of 2 nodes joined within 2 s"):
            node.join()
    finally:
        node.leave(1)


def test_a_second_node_with_the_same_node_rank_is_refused():
    port = free_port()
    nodes = [NodeGroup(2, rank, "127.0.0.1", port, processes=1, timeout=5, join_timeout=60) for rank in (0, 1)]
    duplicate = NodeGroup(2, 1, "127.0.0.1", port, processes=1, timeout=5, join_timeout=60)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(NodeGroup.join, nodes))
        assert nodes[0].rendezvous_port(0) == nodes[1].rendezvous_port(0)  # both meet on node 0's pick
        with pytest.raises(NodeGroupError, match="another node already joined this run as --node-rank 1") as error:
            duplicate.join()
        assert error.value.code == 2
        duplicate.leave(2, str(error.value))  # as its supervisor does: this must not end the run for the others
        nodes[0].check()
        nodes[1].check()
    finally:
        for node in (duplicate, nodes[1], nodes[0]):
            node.leave(0)
