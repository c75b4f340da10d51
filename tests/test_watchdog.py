"""Stall detection: a rank waiting for one that hangs says so, naming the missing rank and where it is; a start
that never completes names the launch variables; a call every rank must make, made on some ranks only, ends the run
naming the call and where the other ranks went. Real processes over gloo; every wait carries a timeout."""

import json
import re
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from fabriclite.plugins.environments import free_port
from fabriclite.strategies import DDPStrategy, FSDPStrategy
from fabriclite.processes.watchdog import Places, StallWatchdog, describe, locate, skipped_call, skipped_message
from helpers import SCRIPTS, read_until, run_python, sigkill, start_python


def test_a_hung_rank_is_named_with_its_line_by_the_rank_waiting_for_it():
    child = start_python(str(SCRIPTS / "stalls.py"), "hang", "2")
    # Waits for the report about the wait in backward, whatever came before it: on a loaded machine rank 0 can
    # also wait more than 2 s in setup for a slow rank 1, and report that first.
    backward_report = re.compile(r"fabriclite: rank 0 has waited \d+ s in Fabric\.backward.*?None turns it off", re.S)
    try:
        output = read_until(child, backward_report, timeout=300)
    finally:
        sigkill(child)
    report = backward_report.search(output).group(0)
    assert "in Fabric.backward (called at tests/scripts/stalls.py" in report
    assert "1 of 2 ranks have not arrived" in report
    assert "rank 1: running its own code" in report and "`time.sleep(3600)  # the hung rank`" in report
    assert "collective timeout of 30 min" in report


def test_launch_variables_left_in_the_environment_are_named_when_nobody_joins(tmp_path):
    stale = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    child = start_python(str(SCRIPTS / "stalls.py"), "join", "2", MASTER_PORT=str(free_port()), **stale)
    try:
        output = read_until(child, "unset RANK WORLD_SIZE LOCAL_RANK MASTER_ADDR MASTER_PORT", timeout=150)
    finally:
        sigkill(child)
    assert "rank 0 has waited 2 s for the other processes of the job (2 in all)" in output
    assert "RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR=127.0.0.1" in output
    assert "torchrun or `fabriclite run`" in output


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=30))
    yield dist.PrefixStore("test/", server)


def heartbeat(store, rank, operation, caller, since_s_ago):
    now = time.time()
    state = {"operation": operation, "caller": caller, "since": now - since_s_ago, "beat": now}
    store.set(f"fabriclite/watchdog/rank{rank}", json.dumps(state))


def waiting_rank(store, world_size=3):
    watchdog = StallWatchdog(0, world_size, stall_timeout=5.0, collective_timeout=timedelta(minutes=30))
    watchdog._store = store
    mine = {"operation": "Fabric.barrier", "caller": "train.py:9 in main", "since": time.time() - 70, "beat": 0}
    return watchdog, mine


def test_ranks_all_inside_the_same_call_are_a_slow_collective_not_a_stall(store, capsys):
    watchdog, mine = waiting_rank(store)
    heartbeat(store, 1, "Fabric.barrier", "train.py:9 in main", 70)
    heartbeat(store, 2, "Fabric.barrier", "train.py:9 in main", 69)
    assert watchdog._report(mine, 70, time.time()) is False
    assert capsys.readouterr().err == ""


def test_a_report_lists_ranks_elsewhere_silent_or_never_seen_and_counts_those_waiting_too(store, capsys):
    watchdog, mine = waiting_rank(store, world_size=5)
    heartbeat(store, 1, "Fabric.barrier", "train.py:9 in main", 70)
    heartbeat(store, 2, None, "train.py:4 in evaluate: `input()`", 80)
    heartbeat(store, 3, "Fabric.all_reduce", "train.py:7 in main", 75)
    assert watchdog._report(mine, 70, time.time()) is True
    err = capsys.readouterr().err
    assert "rank 0 has waited 70 s in Fabric.barrier (called at train.py:9 in main); 3 of 5 ranks" in err
    assert "rank 2: running its own code for 80 s, at train.py:4 in evaluate: `input()`" in err
    assert "rank 3: in Fabric.all_reduce for 75 s, called at train.py:7 in main" in err
    assert "rank 4: no heartbeat yet" in err
    assert "ranks 1 wait in the same call" in err


def test_a_heartbeat_that_stopped_is_reported_as_such(store, capsys):
    watchdog, mine = waiting_rank(store, world_size=2)
    heartbeat(store, 1, "Fabric.barrier", "train.py:9 in main", 70)
    state = json.loads(store.get("fabriclite/watchdog/rank1"))
    state["beat"] -= 120
    store.set("fabriclite/watchdog/rank1", json.dumps(state))
    assert watchdog._report(mine, 70, time.time()) is True
    assert "rank 1: no heartbeat for 120 s" in capsys.readouterr().err


class FlakyStore:
    """The job's store, whose first ``failures`` calls time out, as one may on a loaded machine."""

    def __init__(self, store, failures):
        self.store, self.failures = store, failures

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(*args, **kwargs):
            if self.failures > 0:
                self.failures -= 1
                raise RuntimeError("Socket Timeout")
            return method(*args, **kwargs)

        return call


def watch_a_thread_waiting_in_torch(store, waits, watchdog_store=None):
    """A thread waiting in torch's Future.wait on each of ``waits`` in turn, and a watchdog (rank 0 of 2, stall
    timeout 1 s) watching it through ``watchdog_store`` (default ``store``); rank 1 runs its own code."""
    thread = threading.Thread(target=lambda: [future.wait() for future in waits], daemon=True)
    thread.start()
    heartbeat(store, 1, None, "train.py:4 in main: `input()`", 10)
    store = watchdog_store or store
    watchdog = StallWatchdog(0, 2, stall_timeout=1.0, thread_id=thread.ident)
    watchdog._store, watchdog._places = store, Places()
    watchdog._thread = threading.Thread(target=watchdog._run, daemon=True)
    watchdog._thread.start()
    return watchdog


def reports_after(capsys, count, timeout=120):
    """The stderr written until it holds ``count`` stall reports; fails after ``timeout`` seconds without them."""
    err, deadline = "", time.monotonic() + timeout
    while err.count("None turns it off") < count and time.monotonic() < deadline:
        time.sleep(0.2)
        err += capsys.readouterr().err
    assert err.count("None turns it off") >= count, f"{count} report(s) expected within {timeout} s:\n{err}"
    return err


def test_a_store_call_that_times_out_once_does_not_end_the_watchdog(store, capsys):
    waits = [torch.futures.Future()]
    watchdog = watch_a_thread_waiting_in_torch(store, waits, FlakyStore(store, failures=2))
    try:
        err = reports_after(capsys, 1)
    finally:
        watchdog.stop()
        waits[0].set_result(None)
    assert "rank 0 has waited" in err and "in Future.wait" in err and "rank 1: running its own code" in err


def test_a_new_wait_gets_its_own_report_soon_after_one_about_the_previous_wait(store, capsys):
    waits = [torch.futures.Future(), torch.futures.Future()]
    watchdog = watch_a_thread_waiting_in_torch(store, waits)
    try:
        reports_after(capsys, 1)
        waits[0].set_result(None)  # the thread goes on into the second wait
        reports_after(capsys, 1)  # not five minutes later
    finally:
        watchdog.stop()
        waits[1].set_result(None)


def test_a_thread_in_its_own_code_has_no_operation_and_its_caller_is_the_users_line():
    operation, caller = locate(sys._getframe(), Places())
    assert operation is None
    assert caller is sys._getframe()
    assert describe(caller).startswith("tests/test_watchdog.py:")
    assert "in test_a_thread_in_its_own_code" in describe(caller)


@pytest.mark.parametrize("strategy", [DDPStrategy, FSDPStrategy])
@pytest.mark.parametrize("value", [0, -1.0, "60", True])
def test_a_stall_timeout_that_is_not_a_positive_number_is_refused(strategy, value):
    with pytest.raises(ValueError, match=f"stall_timeout={value!r} must be a number of seconds > 0, or None"):
        strategy(stall_timeout=value)


# ---------------------------------------------------------------------- a call made on some ranks only
def counted(calls, groups, operation="Fabric.backward", caller="train.py:9 in main", **extra):
    """A heartbeat with collective counts: ``calls`` on the calls group, ``groups`` (name -> count) in training."""
    state = {"operation": operation, "caller": caller, "since": 0.0, "beat": 0.0}
    return {**state, "calls": calls, "groups": groups, **extra}


def test_a_rank_behind_on_the_calls_group_and_ahead_in_training_went_past_the_call():
    saving = counted(7, {"0": 40}, "Fabric.save", "train.py:12 in main")
    verdict = skipped_call({0: saving, 1: counted(6, {"0": 41}), 2: counted(7, {"0": 40})})
    assert verdict is not None and verdict["call"] == "Fabric.save" and list(verdict["made"]) == [0, 2]
    message = skipped_message(json.loads(json.dumps(verdict)))  # as the other ranks read it from the store
    assert message.startswith("fabric.save() was called on ranks 0, 2 only (rank 0 at train.py:12 in main; rank 2")
    assert "every rank must call it: rank 1 went on without it and is now in Fabric.backward, at train.py:9" in message


def test_a_rank_behind_on_both_may_be_on_its_way_and_ranks_level_skipped_nothing():
    assert skipped_call({0: counted(7, {"0": 40}, "Fabric.save"), 1: counted(6, {"0": 40})}) is None  # slow
    assert skipped_call({0: counted(7, {"0": 40}, "Fabric.save"), 1: counted(7, {"0": 41})}) is None  # level
    assert skipped_call({0: counted(7, {"0": 40}, "Fabric.save"), 1: counted(8, {"0": 41})}) is None  # ahead


def test_a_rank_that_ended_before_the_call_skipped_it():
    verdict = skipped_call({0: counted(7, {"0": 40}, "Fabric.barrier"), 1: counted(6, {"0": 40}, None, ended=True)})
    assert "fabric.barrier() was called on rank 0 only" in skipped_message(verdict)
    assert "rank 1 ended without calling it" in skipped_message(verdict)


def test_only_groups_both_ranks_belong_to_and_heartbeats_with_counts_prove_anything():
    # Tensor parallel: ranks 0 and 1 count different subgroups ("2", "3"); rank 2's heartbeat has no counts (it was
    # read while the rank issued collectives, or by a fabriclite without them).
    states = {0: counted(7, {"0": 40, "2": 9}, "Fabric.save"), 1: counted(6, {"0": 40, "3": 12}), 2: {"caller": "x"}}
    assert skipped_call(states) is None


def called_on_rank_0_only(tmp_path, *args):
    result = run_python(str(SCRIPTS / "one_rank_calls.py"), str(tmp_path), *args, timeout=240, check=False)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize(
    "strategy, call",
    [("ddp", "save"), ("fsdp", "save"), ("ddp", "barrier"), ("ddp", "all_reduce"), ("ddp", "load"), ("fsdp", "load")],
)
def test_a_call_every_rank_must_make_made_on_rank_0_only_ends_the_run_naming_it_and_where_rank_1_went(
    tmp_path, strategy, call
):
    # Before: gloo's "op.preamble.length <= op.nbytes ... Received data size doesn't match expected size" (a rank
    # aborted), or every rank waiting for the collective timeout (30 min).
    code, output = called_on_rank_0_only(tmp_path, strategy, call)
    assert code == 1, output[-3000:]
    said = rf"fabric\.{call}\(\) was called on rank 0 only \(rank 0 at \S*one_rank_calls\.py:\d+"
    assert re.search(said, output), output[-3000:]
    went = r"rank 1 went on without it and is now in (Fabric\.backward|_FabricModule\.__call__), at \S*one_rank_calls"
    assert re.search(went, output) and "outside any `if fabric.global_rank == ...:` branch" in output, output[-3000:]
    assert "CALLED" not in output
    for riddle in ("preamble", "Received data size", "Connection reset", "Connection closed", "Timed out"):
        assert riddle not in output, output[-3000:]


@pytest.mark.parametrize("strategy, call", [("ddp", "save"), ("fsdp", "barrier")])
def test_a_call_made_on_rank_0_only_after_rank_1_ended_says_so(tmp_path, strategy, call):
    code, output = called_on_rank_0_only(tmp_path, strategy, call, "end")
    assert code == 1, output[-3000:]
    assert f"fabric.{call}() was called on rank 0 only" in output and "rank 1 ended without calling it" in output
    for riddle in ("preamble", "Received data size", "Connection reset", "Connection closed", "Timed out"):
        assert riddle not in output, output[-3000:]
