"""`fabriclite run --num-nodes` on torch's elastic agent (fabriclite/processes/nodes.py), run for real as two
`fabriclite run` on loopback with scripts that need no training: a rank failing on one node restarts the ranks of
both (also those that had finished), the failure is named on both, a node started with settings other than node
0's is refused on its own, and a node alone says what is missing. The training runs (restarts ending bit-identical,
a lost node, preemption) are in test_long_runs_nodes.py."""

import re
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import read_until, run_python, sigkill, start_python

from fabriclite.plugins.environments import free_port
from fabriclite.processes.nodes import NodeGroupError, check_nodes

TIMEOUT = 300

# The rank of node 0 ends at once; node 1's a few seconds later, with code 3 in node 1's first attempt. (torch's
# c10d rendezvous orders the nodes its own way: which global rank runs on node 1 is its choice.)
SCRIPT = textwrap.dedent("""\
    import os, sys, time
    node, attempt = int(os.environ["FABRICLITE_NODE_RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(f"node {node} rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} attempt {attempt}", flush=True)
    if node == 1:
        time.sleep(3)
        sys.exit(3 if attempt == 0 else 0)
""")


def node_args(port, node, *flags):
    return [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2",
        "--node-rank", str(node), "--main-address", "127.0.0.1", "--main-port", str(port), *flags,
    ]  # fmt: skip


def run_two_nodes(tmp_path, restarts=0):
    """Both nodes' results (exit code, output), each node a `fabriclite run` of SCRIPT."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    port = free_port()

    def node(rank):
        args = node_args(port, rank, "--max-restarts", str(restarts), str(script))
        result = run_python(*args, check=False, timeout=TIMEOUT)
        return result.returncode, result.stdout + result.stderr

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(node, [0, 1]))


@pytest.mark.torch_versions  # fabriclite's agent builds on torch's: checked on every torch CI runs
def test_a_node_whose_ranks_finished_starts_them_again_when_another_nodes_rank_dies(tmp_path):
    (code0, out0), (code1, out1) = run_two_nodes(tmp_path, restarts=1)
    assert (code0, code1) == (0, 0), out0 + out1
    failed = (
        r"fabriclite: rank \d on node 1 exited with code 3; stopping every rank on every node and starting them again"
    )
    assert re.search(failed + r" \(restart 1 of 1\)\.", out1), out1  # node 1's agent counted the restart
    assert re.search(failed + r"\.\n", out0), out0  # node 0's restarted on node 1's rejoining: named all the same
    assert len(re.findall(r"node 0 rank \d of 2", out0)) == 2, out0  # its rank had finished, and ran again


def test_without_restarts_every_node_exits_with_the_failed_ranks_code(tmp_path):
    (code0, out0), (code1, out1) = run_two_nodes(tmp_path)
    assert (code0, code1) == (3, 3), out0 + out1
    line = r"fabriclite: rank \d on node 1 exited with code 3; stopping every rank\."
    assert re.search(line, out0) and re.search(line, out1), out0 + out1


# Every rank waits for the file GO, so the run is still on when the wrong latecomer tries to join it.
WAITING_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    print(f"node {os.environ['FABRICLITE_NODE_RANK']} rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
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
    port = free_port()

    def args(*own):
        settings = {"--devices": "1", "--num-nodes": "2", **dict(zip(own[::2], own[1::2]))}
        return [
            "-m", "fabriclite.cli", "run", "--accelerator", "cpu", *(item for pair in settings.items() for item in pair),
            "--main-address", "127.0.0.1", "--main-port", str(port), str(script), str(go),
        ]  # fmt: skip

    nodes = [start_python(*args("--node-rank", str(rank))) for rank in (0, 1)]
    try:
        before = read_until(nodes[1], "node 1 rank", timeout=TIMEOUT)  # node 1 joined: its node rank is taken
        latecomer = run_python(*args(*flags), check=False, timeout=TIMEOUT)
        go.touch()
        outputs = [output + node.communicate(timeout=TIMEOUT)[0] for output, node in zip(["", before], nodes)]
    finally:
        for node in nodes:
            sigkill(node)
    said = latecomer.stdout + latecomer.stderr
    assert latecomer.returncode == code and message in said, said
    assert " rank " not in said  # it started no rank
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert all("refused" not in output for output in outputs), outputs


def test_a_node_that_cannot_reach_node_0_says_where_it_looked():
    port = free_port()
    expected = rf"node 1 could not reach node 0's `fabriclite run` at 127.0.0.1:{port} within 2 s"
    with pytest.raises(NodeGroupError, match=expected):
        check_nodes(2, 1, 1, "127.0.0.1", port, timeout=2)


def test_node_0_alone_says_that_a_node_did_not_join_and_what_to_do(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('the script ran')\n")
    result = run_python(*node_args(free_port(), 0, "--node-timeout", "5", str(script)), check=False, timeout=TIMEOUT)
    said = result.stdout + result.stderr
    assert result.returncode == 1, said
    assert "the nodes did not all join within 5 s (--node-timeout)" in said, said
    assert "start `fabriclite run` on every node, each with its --node-rank" in said and "the script ran" not in said
