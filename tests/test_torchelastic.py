"""Ranks that torchrun started and restarts (fabriclite/processes/torchelastic.py): a restarted group reconnects
through the agent's store that outlives it, torchrun's stop after a rank's failure is no preemption, and torchrun
names the rank that failed first. torchrun itself runs here (`python -m torch.distributed.run`), with a real rank
failing; the group's generation protocol is also checked on a real TCPStore with a dead group's keys in it.
"""

from __future__ import annotations

import re
import threading
from datetime import timedelta

import pytest

from fabriclite.plugins.environments import free_port
from helpers import SCRIPTS, run_python

SCRIPT = str(SCRIPTS / "torchrun_restarts.py")
TORCHRUN = ("-m", "torch.distributed.run", "--max-restarts", "2")
RUNS = 5  # a restarted group failed to reconnect in about 1 run of 3 before: 5 runs each catch that
TIMEOUT = 240


def each_run(runs: dict[str, int], on_every_torch: str) -> list:
    """The parameters (mode, run) of ``runs[mode]`` runs of each mode, each run a test of its own. The first run of
    mode ``on_every_torch`` is also a version-sensitive test: the rendezvous code differs between torch versions, and
    on the other versions CI tests that one run is checked (in the whole suite, it is one of the runs)."""
    every_torch = pytest.mark.torch_versions
    return [
        pytest.param(mode, run, id=f"{mode}-{run}", marks=every_torch if (mode, run) == (on_every_torch, 0) else ())
        for mode, count in runs.items()
        for run in range(count)
    ]


def check_resumed_and_finished(output: str) -> None:
    """One run of torchrun_restarts.py under torchrun: restarted once, resumed from step 2, finished; torchrun's
    stop was no preemption; the dead group's keys were never read."""
    assert "resumed at step 2" in output and "done" in output, output[-4000:]
    assert "rank 1 fails once, at step 3" in output, output[-4000:]
    assert "fabric.preempted becomes True" not in output, output[-4000:]  # torchrun's SIGTERM taken as a notice
    assert "connectFullMesh" not in output and "for the other processes of the job" not in output, output[-4000:]


@pytest.mark.parametrize(("rendezvous", "run"), each_run({"standalone": RUNS, "c10d": RUNS}, "standalone"))
def test_a_rank_failing_once_under_one_torchrun_agent_restarts_resumes_and_finishes_every_time(
    tmp_path, rendezvous, run
):
    run_one_agent(rendezvous, tmp_path)


def run_one_agent(rendezvous: str, folder) -> None:
    """One torchrun agent with two workers; checks that the run resumed and finished, and what torchrun said."""
    where = (
        ["--standalone"]
        if rendezvous == "standalone"
        else ["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    )
    result = run_python(*TORCHRUN, *where, "--nproc-per-node", "2", SCRIPT, str(folder), timeout=TIMEOUT)
    output = result.stdout + result.stderr
    check_resumed_and_finished(output)
    # torchrun names the rank that raised, not rank 0 whose collective broke a moment later
    failed = re.findall(r"failed \(exitcode: \S+\) local_rank: (\d)", output)
    assert failed == ["1"], output[-4000:]
    assert "the launcher is stopping the group, which is no preemption" in output, output[-4000:]


def test_torchruns_summary_names_the_rank_that_raised_with_its_exception(tmp_path):
    result = run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
        SCRIPT, str(tmp_path), check=False, timeout=TIMEOUT,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode != 0
    root_cause = output.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"rank\s*: 1 \(local_rank: 1\)", root_cause), output[-4000:]
    assert "RuntimeError: rank 1 fails once, at step 3" in root_cause, output[
        -4000:
    ]  # our error file, read by torchrun
    # rank 0, whose collective broke when rank 1 died, was stopped by torchrun: no failure of its own to report (newer
    # torch lists the ranks it stopped among the other failures, with the exit code of the stop, 143)
    others = output.split("Root Cause (first observed failure):", 1)[0].split("Failures:", 1)[-1]
    assert "<NO_OTHER_FAILURES>" in others or "exitcode  : 143" in others, output[-4000:]
    assert "Connection closed by peer" not in others, output[-4000:]


# ------------------------------------------------------------------------------------- the generation protocol
def _agent_store():
    import torch.distributed as dist

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    return server, lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


def _join_all(connect, world_size: int, order: list[int], pause: float = 0.3) -> dict[int, str]:
    """Each rank joins on a thread of its own with a connection of its own, started in ``order`` ``pause`` seconds
    apart; returns rank -> generation name."""
    import time

    from fabriclite.processes.torchelastic import join

    names: dict[int, str] = {}
    errors: list[BaseException] = []

    def rank_joins(rank: int) -> None:
        try:
            names[rank] = join(connect(), rank, world_size, timedelta(seconds=60)).name
        except BaseException as error:  # reported by the test
            errors.append(error)

    threads = []
    for rank in order:
        threads.append(threading.Thread(target=rank_joins, args=(rank,), daemon=True))
        threads[-1].start()
        time.sleep(pause)
    for thread in threads:
        thread.join(timeout=90)
    assert not errors, errors
    assert len(names) == world_size, f"ranks {sorted(set(range(world_size)) - set(names))} never joined"
    return names


def test_a_group_joins_one_generation_that_the_dead_group_before_it_did_not_use():
    server, connect = _agent_store()
    first = _join_all(connect, 3, [0, 1, 2])
    # The next group's ranks 1 and 2 start first and read the dead group's generation, admitted long ago.
    second = _join_all(connect, 3, [2, 1, 0])
    assert len(set(first.values())) == 1 and len(set(second.values())) == 1
    assert set(first.values()) != set(second.values())


def test_ranks_waiting_under_a_generation_whose_rank_0_died_before_admitting_it_join_the_next():
    from fabriclite.processes.torchelastic import _GENERATION_KEY

    server, connect = _agent_store()
    # A dead group's rank 0 published its generation and died waiting for rank 1, which never registered.
    store = connect()
    store.set(_GENERATION_KEY, "deadbeef")
    names = _join_all(connect, 2, [1, 0], pause=1.0)  # rank 1 registers under the dead one before rank 0 starts
    assert names[0] == names[1] != "deadbeef"
