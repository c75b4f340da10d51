"""What tests need to run real processes: one place, every call with a timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def passed(output: str) -> set[tuple[str, str]]:
    """The ``(rank, check name)`` pairs of the "PASS <rank> <name>" lines a check script printed (ranks share one
    pipe, so a line may run into the next one's PASS or DONE)."""
    return set(re.findall(r"PASS ([01]) ([^\n]+?)(?=PASS |DONE |\n|$)", output))


def assert_passed(output: str, names: list[str] | tuple[str, ...], ranks: tuple[str, ...] = ("0", "1")) -> None:
    """Every rank in ``ranks`` printed PASS for every check in ``names``; else fail showing the output's end."""
    found = passed(output)
    for name in names:
        assert {(rank, name) for rank in ranks} <= found, output[-3000:]


def python_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this checkout importable, one thread, no buffering."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_python(*args: str, timeout: float = 120, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    """Run ``python *args`` to completion and return the result (stdout and stderr as text).

    The child gets its own process group, and on timeout the whole group is killed, so processes it started
    (DDP ranks, torchrun workers) never outlive the test.
    """
    child = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env(**env),
        start_new_session=True,
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        raise AssertionError(
            f"python {' '.join(args)} ran past {timeout} s and was killed\n{stdout}\n{stderr}"
        ) from None
    result = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"python {' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def start_python(*args: str, **env: str) -> subprocess.Popen:
    """Start ``python *args`` with stdout as a pipe of lines; the caller must wait or kill it (with a timeout)."""
    return subprocess.Popen(
        [sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=python_env(**env)
    )


def sigkill(child: subprocess.Popen) -> None:
    """SIGKILL a child from ``start_python`` (unless it already ended) and reap it; for ``finally`` blocks."""
    if child.poll() is None:
        child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
