"""Two torchrun agents on loopback, as two machines run them (static and c10d rendezvous): a rank failing once on
one node restarts the group on both, which reconnects, resumes and finishes, every time. Each agent is a real
`python -m torch.distributed.run` process with one worker.
"""

from __future__ import annotations

import threading

import pytest

from fabriclite.plugins.environments import free_port
from helpers import run_python
from test_torchelastic import RUNS, SCRIPT, TIMEOUT, check_resumed_and_finished, each_run


def run_two_agents(rendezvous: str, folder) -> list[str]:
    """Both agents of one run, started together; their outputs."""
    port = free_port()
    outputs = ["", ""]

    def agent(node: int) -> None:
        if rendezvous == "c10d":
            where = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        else:
            where = ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
        result = run_python(
            "-m", "torch.distributed.run", "--max-restarts", "2", "--nnodes", "2", "--nproc-per-node", "1", *where,
            SCRIPT, str(folder), "1", "2", timeout=TIMEOUT,
        )  # fmt: skip
        outputs[node] = result.stdout + result.stderr

    threads = [threading.Thread(target=agent, args=(node,)) for node in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT + 30)
    assert all(outputs), "an agent failed:\n" + "\n".join(outputs)[-4000:]
    return outputs


# Static rendezvous has no membership changes: the node whose rank did not fail learns of the restart only when its
# own rank has failed too, after waiting FOLLOWER_WAIT_S to be stopped, which makes a run about 1.5x c10d's. Its
# reconnect is the same generation protocol as c10d's, so 3 runs for it (and RUNS for c10d's).
STATIC_RUNS = 3


@pytest.mark.parametrize(("rendezvous", "run"), each_run({"c10d": RUNS, "static": STATIC_RUNS}, "c10d"))
def test_a_rank_failing_once_under_two_torchrun_agents_restarts_both_and_finishes_every_time(tmp_path, rendezvous, run):
    check_resumed_and_finished("\n".join(run_two_agents(rendezvous, tmp_path)))
