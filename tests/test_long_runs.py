"""Long runs on shared machines: `fabriclite run --max-restarts` restarts the whole group when a rank dies, a
preemption notice (SIGTERM, SIGUSR1) makes every rank save at the same step and the run exit "preempted,
resumable" (or requeue the SLURM job), and the resumed run ends bit-identical to one never interrupted. On one
machine; the same across two nodes is in test_long_runs_nodes.py."""

import atexit
import functools
import os
import re
import signal
import textwrap
import time

import pytest
import torch
from helpers import (
    LONG_RUN_SCRIPT,
    LONG_RUN_TIMEOUT,
    ROOT,
    SCRIPTS,
    assert_same_weights,
    fake_scontrol,
    finish,
    kill_rank,
    pids,
    read_until,
    run_python,
    send,
    sigkill,
    start_python,
    still_running,
)

from fabriclite.processes.preemption import PREEMPTED_EXIT_CODE

SCRIPT = LONG_RUN_SCRIPT
TIMEOUT = LONG_RUN_TIMEOUT


def run_args(folder, out, *flags, strategy="ddp", restarts=0):
    return [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--strategy", strategy,
        "--max-restarts", str(restarts), SCRIPT, str(folder), "--out", str(out), *flags,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(strategy)``: the final weights of the same run, never interrupted; run once per strategy for
    all the tests of this module."""

    @functools.cache
    def uninterrupted(strategy):
        folder = tmp_path_factory.mktemp(f"reference-{strategy}")
        run_python(*run_args(folder / "ref", folder / "ref.pt", strategy=strategy), timeout=TIMEOUT)
        return torch.load(folder / "ref.pt")

    return uninterrupted


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


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_rank_sigkilled_mid_run_restarts_the_group_which_ends_bit_identical(tmp_path, strategy, reference):
    expected = reference(strategy)
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


def test_fabric_launch_restarts_its_ranks_with_fabriclite_max_restarts(tmp_path, reference):
    expected = reference("ddp")
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
def test_a_preemption_notice_saves_every_rank_at_one_step_and_the_rerun_ends_bit_identical(
    tmp_path, signum, flags, reference
):
    expected = reference("ddp")
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


def test_ranks_that_do_not_exit_by_the_deadline_after_a_notice_are_killed():
    rank = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"
    supervise = textwrap.dedent(f"""\
        import sys
        from fabriclite.processes.supervisor import Supervisor
        sys.exit(Supervisor([sys.executable, "-c", {rank!r}], processes=2, deadline=3).run())
    """)
    code, output, _ = interrupted(["-c", supervise], "ready", send(signal.SIGTERM))
    assert code == 128 + signal.SIGTERM, output
    assert "the ranks did not exit within 3 s of the preemption notice; killing them." in output


@pytest.fixture
def preemption_reset():
    from fabriclite.processes import preemption, signals

    handlers = {signum: signal.getsignal(signum) for signum in signals.NOTICES}
    yield signals
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    signals._policy = signals._Policy()
    preemption._agreed, preemption._in_flight = False, None
    atexit.unregister(preemption._end)  # this process is pytest: nothing to requeue when it ends


def test_fabric_preempted_turns_true_after_sigusr1_and_stays_true(preemption_reset):
    from fabriclite import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)  # takes notices from here on
    assert fabric.preempted is False
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 60
    while preemption_reset.noticed() is None and time.monotonic() < deadline:  # the watching thread notes it
        time.sleep(0.01)
    assert fabric.preempted is True
    assert fabric.preempted is True
    assert preemption_reset.noticed() == signal.SIGUSR1


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
    expected, actual = (torch.load(tmp_path / name / "final.ckpt")["model"] for name in ("ref", "run"))
    assert expected.keys() == actual.keys() and all(torch.equal(expected[k], actual[k]) for k in expected)
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) == 3  # keep_last=3


def test_the_docs_script_under_fsdp_writes_full_checkpoints_with_state_dict_type_full(tmp_path):
    command = [
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--strategy", "fsdp",
        "--state-dict-type", "full", docs_script(tmp_path), str(tmp_path),
    ]  # fmt: skip
    output = run_python(*command, timeout=TIMEOUT).stdout
    assert "done after 256 steps" in output, output[-3000:]
    checkpoints = sorted((tmp_path / "checkpoints").iterdir())
    assert [path.name for path in checkpoints] == ["step-000200.ckpt", "step-000220.ckpt", "step-000240.ckpt"]
    assert all(path.is_file() for path in [*checkpoints, tmp_path / "final.ckpt"])  # one file each, not a folder
    weights = torch.load(tmp_path / "final.ckpt")["model"]  # plain, whole tensors: no DTensor, no process group
    shapes = {name: list(tensor.shape) for name, tensor in weights.items()}
    assert shapes == {"0.weight": [32, 8], "0.bias": [32], "2.weight": [4, 32], "2.bias": [4]}
    assert all(type(tensor) is torch.Tensor for tensor in weights.values())


def run_failing_at_step(mode, tmp_path):
    """``fails_at_step.py MODE`` on 2 ranks under ``fabriclite run --max-restarts 3``."""
    return run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", "--max-restarts", "3",
        str(SCRIPTS / "fails_at_step.py"), mode, str(tmp_path), check=False, timeout=TIMEOUT,
    )  # fmt: skip


def test_a_failure_that_repeats_at_the_same_step_is_not_restarted_again_and_the_first_rank_to_fail_is_named(
    tmp_path,
):
    # Rank 1 raises at step 7 of every attempt; rank 0, waiting for it in an all_reduce, fails a moment later.
    result = run_failing_at_step("same", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    raised = "rank 1 exited with code 1 (ValueError: this batch cannot be trained on)"
    assert f"fabriclite: {raised}; stopping every rank and starting them again (restart 1 of 3)." in output
    assert (
        f"fabriclite: {raised} again: the same failure as in an earlier attempt, with no checkpoint of the run saved in "
        "between (its newest is still save number 1). Restarting would only repeat it, so every rank is stopped (2 of "
        "--max-restarts 3 left unused)." in output
    ), output[-3000:]
    assert "attempt 1 resumed at step 5" in output and "attempt 2" not in output


def test_a_failure_alternating_with_another_is_stopped_at_its_second_time(tmp_path):
    # Rank 1 raises A, then B, then A again at step 7, with no checkpoint in between: the third attempt repeats the
    # first's, so the last restart is left unused.
    result = run_failing_at_step("alternating", tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "(ValueError: nor can this one); stopping every rank and starting them again (restart 2 of 3)." in output
    assert "(ValueError: this batch cannot be trained on) again: the same failure as in an earlier attempt" in output, (
        output[-3000:]
    )
    assert "(1 of --max-restarts 3 left unused)" in output
    assert "attempt 2 resumed at step 5" in output and "attempt 3" not in output
