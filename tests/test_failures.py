"""What a rank that failed tells its supervisor (fabriclite/processes/failures.py): the exception that ended it,
when, and from which checkpoint; which rank failed first; whether a failure is an earlier attempt's over again. The
supervisor acting on it, with real ranks, is in test_long_runs.py."""

import json
import os
import subprocess
import sys
import textwrap

from helpers import run_python

from fabriclite.processes.failures import FAILURE_FILE_ENV, Failure, first, read, repeats


def test_a_rank_records_the_exception_that_ended_it_and_its_last_checkpoint(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        textwrap.dedent(f"""
        from fabriclite import Fabric
        fabric = Fabric(accelerator="cpu", devices=1)
        state = {{"step": 3}}
        fabric.save({str(tmp_path / "a.ckpt")!r}, state)
        fabric.save({str(tmp_path / "b.ckpt")!r}, state)
        raise ValueError("bad batch\\nsecond line")
    """)
    )
    record = tmp_path / "record.json"
    result = run_python(str(script), check=False, timeout=120, **{FAILURE_FILE_ENV: str(record)})
    assert result.returncode == 1
    assert "ValueError: bad batch" in result.stderr  # Python's own report is still printed
    content = json.loads(record.read_text())
    assert content["error"] == "ValueError: bad batch\nsecond line" and content["progress"] == 2
    failure = read(record, 1, 1)
    assert failure.describe() == "rank 1 exited with code 1 (ValueError: bad batch)"
    assert failure.describe(node=2) == "rank 1 on node 2 exited with code 1 (ValueError: bad batch)"


def test_without_a_record_a_failure_is_its_exit_alone():
    assert read("/nonexistent/record.json", 0, -9) == Failure(0, -9)
    assert Failure(0, -9).describe() == "rank 0 was killed by SIGKILL"


def test_the_rank_named_is_one_a_signal_killed_else_one_without_a_record_else_the_earliest_exception():
    killed, exited = Failure(2, -9), Failure(3, 2)
    raised_first, raised_later = Failure(1, 1, "ValueError: x", 10.0, 0), Failure(0, 1, "RuntimeError: closed", 11.0, 0)
    assert first([raised_later, raised_first]) == raised_first  # not the order seen: rank 0 failed because 1 did
    assert first([raised_later, raised_first, exited]) == exited
    assert first([raised_first, exited, killed, Failure(4, -15)]) == killed


def test_a_failure_repeats_only_with_the_same_error_on_a_rank_that_had_it_from_the_same_checkpoint():
    last = [Failure(1, 1, "ValueError: x", 10.0, 4), Failure(0, 1, "RuntimeError: closed", 11.0, 4)]
    assert repeats(Failure(1, 1, "ValueError: x", 50.0, 4), last)
    assert not repeats(Failure(1, 1, "ValueError: x", 50.0, 5), last)  # a checkpoint was saved since: progress
    assert not repeats(Failure(1, 1, "ValueError: y", 50.0, 4), last)
    assert not repeats(Failure(2, 1, "ValueError: x", 50.0, 4), last)
    assert not repeats(Failure(1, -9, None, None, None), [Failure(1, -9)])  # a signal says nothing of its cause
    assert not repeats(Failure(1, 1, "ValueError: x", 50.0, 4), [])  # the first failure is always restarted


EXIT_NOW = """
import os
from fabriclite.processes import failures
folder = failures.records_folder()
open(os.path.join(folder, "1.json"), "w").write("{}")
pid = os.fork()
if pid == 0:  # a forked child (a DataLoader worker) ending at once leaves its parent's folder alone
    failures.exit_now(3)
print("child", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), "folder kept", os.path.isdir(folder), flush=True)
failures.exit_now(4)  # no exit handlers run: exit_now deletes the folder itself
"""


def test_exit_now_deletes_the_records_folder_its_process_made_and_a_forked_child_leaves_it(tmp_path):
    result = run_python("-c", EXIT_NOW, timeout=60, check=False, TMPDIR=str(tmp_path))
    assert result.returncode == 4, result.stderr
    assert "child 3 folder kept True" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_run_deletes_the_record_folders_that_processes_killed_outright_left_and_no_others(tmp_path):
    ended = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60
    )
    dead = tmp_path / f"fabriclite-failures-{int(ended.stdout)}-abc123"  # a SIGKILLed launcher's, say
    living = tmp_path / f"fabriclite-failures-{os.getpid()}-def456"  # a run still going
    older = tmp_path / "fabriclite-failures-x1y2z3"  # a name without a PID: not known to be stale
    for folder in (dead, living, older):
        folder.mkdir()
        (folder / "1.json").write_text("{}")
    code = "from fabriclite.processes import failures; print(failures.records_folder())"
    made = run_python("-c", code, timeout=60, TMPDIR=str(tmp_path)).stdout.strip()
    assert os.path.basename(made).startswith("fabriclite-failures-")
    assert not dead.exists()
    assert (living / "1.json").exists() and (older / "1.json").exists()
    assert not os.path.exists(made)  # and the new one went with the process that made it
