"""Starting every rank of a run on one machine, watching them, and starting them all again when one dies: what
``fabriclite run`` does on one machine, and ``fabric.launch()`` with ``FABRICLITE_MAX_RESTARTS``. (Across machines,
``fabriclite run --num-nodes`` runs torch's elastic agent instead: ``nodes``.)

- Each rank runs in its own session, so stopping it stops what it started too (DataLoader workers), and dies
  within moments when this process dies, however it dies (``PR_SET_PDEATHSIG`` on Linux).
- When a rank dies (an error, a signal, the OOM killer), every rank is stopped and the whole group starts again
  on a fresh port, up to ``max_restarts`` times, each restart said in one line naming the rank that failed first
  and how (``failures``: each rank writes the exception that ended it to a file of this supervisor's). A failure
  that repeats an earlier attempt's, with no checkpoint saved in between, is not restarted: the run ends, saying so.
  The script resumes itself: ``fabric.load_latest(folder, state)`` at its top. ``FABRICLITE_RESTART_COUNT`` tells
  it which attempt it is.
- SIGTERM and SIGUSR1 (a preemption notice) are passed to every rank and end the restarts; once the ranks have
  saved and exited, this exits with ``PREEMPTED_EXIT_CODE`` or requeues the SLURM job (see ``preemption``). A rank
  that the notice itself ended (it came before the rank's Fabric took notices) had nothing to save: the same. The
  same notice again within ``SAME_NOTICE_S`` counts once; a second one is passed on (the ranks exit 75 once their
  saves under way end, see ``signals``); a third, or ``deadline`` seconds without the ranks ending, kills them.
  SIGINT is passed on likewise; a second SIGINT kills.

Usage: ``Supervisor([sys.executable, "train.py"], processes=2, max_restarts=1).run()`` returns the exit code.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

from fabriclite.plugins.environments import free_port
from fabriclite.processes.failures import FAILURE_FILE_ENV, Failure, first, how_it_ended, read, records_folder, repeats
from fabriclite.processes import signals
from fabriclite.processes.signals import GRACE_S, NOTICES as SIGNALS, PREEMPTED_EXIT_CODE, SAME_NOTICE_S, requeue

LAUNCHER_ENV = "FABRICLITE_LAUNCHER"  # who started a rank: our launchers set it, and ranks read it
SIBLING_EXIT_GRACE_S = 1.0  # after a rank's error, how long to wait for a dying sibling to show its exit
RESTART_ENV = "FABRICLITE_RESTART_COUNT"
MAX_RESTARTS_ENV = "FABRICLITE_MAX_RESTARTS"  # for fabric.launch(), which has no command line
DEFAULT_DEADLINE_S = GRACE_S  # after a preemption notice, how long the ranks may take to save and exit
_FORWARDED = (signal.SIGINT, *SIGNALS)
_ENDED = (0, PREEMPTED_EXIT_CODE)  # how a rank ends well: a rank that saved after a preemption notice exits 75


def die_with_parent() -> None:
    """Linux: ask the kernel to SIGKILL this process when the one that started it dies, however it dies. Usage: as
    ``preexec_fn`` of a child, or first thing in a process that another started."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_env(rank: int, local_rank: int, world_size: int, node_rank: int, address: str, port: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
    }


def _exit_code(returncode: int) -> int:
    # A child killed by signal N (returncode -N) makes this process exit the way shells report it: 128 + N.
    return returncode if returncode > 0 else 128 - returncode


def max_restarts() -> int:
    """``FABRICLITE_MAX_RESTARTS`` as a number (0 when unset): how often ``fabric.launch()`` restarts its ranks."""
    value = os.environ.get(MAX_RESTARTS_ENV, "0")
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{MAX_RESTARTS_ENV}={value!r} must be a whole number, 0 or more (how often to restart).")
    return count


def say(message: str) -> None:
    print(f"fabriclite: {message}", file=sys.stderr, flush=True)


class Supervisor:
    """Runs ``command`` as ranks 0..processes-1 of one group (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ... in
    their environment, on top of ``env``) and restarts the group up to ``max_restarts`` times. ``port`` fixes the
    main port (else each attempt takes a free one), ``address`` the main address (default: loopback)."""

    def __init__(
        self,
        command: list[str],
        processes: int,
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
        deadline: float = DEFAULT_DEADLINE_S,
        port: int | None = None,
        address: str = "127.0.0.1",
    ) -> None:
        if processes < 1 or max_restarts < 0:
            raise ValueError(f"processes={processes} must be 1 or more and max_restarts={max_restarts} 0 or more.")
        self.command = command
        self.processes = processes
        self.max_restarts = max_restarts
        self.env = dict(os.environ if env is None else env)
        self.deadline = deadline
        self.port = port  # None: a free one for every attempt
        self.address = address
        self.ranks: list[subprocess.Popen] = []
        self.signals: list[int] = []  # received, in order; one within SAME_NOTICE_S of the first is the same one
        self._first_signal_at = 0.0
        self.notice = 0  # the first signal this run got (a preemption notice, or SIGINT)
        self.failures: list[Failure] = []  # every earlier attempt's: is the next one the same again?
        self._records = ""  # the folder where each rank writes the exception that ended it (``failures``)
        self._held: list[int] | None = None  # signals come while ranks are being started: passed on once all are

    def run(self) -> int:
        """Start the ranks and return the run's exit code: 0, the failed rank's (128 + N for signal N) once the
        restarts are used up, or ``PREEMPTED_EXIT_CODE`` after a preemption notice."""
        signals.uninstall()  # a rank's policy (this process made a Fabric before?) must not take the notices too
        previous = {signum: signal.signal(signum, self._on_signal) for signum in _FORWARDED}
        self._records = records_folder()
        try:
            for attempt in range(self.max_restarts + 1):
                if self.signals:  # a notice came while the group was being restarted: do not start it again
                    return 128 + self.signals[0]
                self._start(attempt)
                code = self._watch(attempt)
                if code is not None:
                    return code
            raise AssertionError("unreachable: the last attempt always returns")
        finally:
            self._stop()
            shutil.rmtree(self._records, ignore_errors=True)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _start(self, attempt: int) -> None:
        # A fresh rendezvous each time (a free port): nothing of the dead group is reused.
        port = self.port or free_port()
        self.ranks = []
        # A signal that comes meanwhile reaches every rank once all are started: passed on at once, it would miss the
        # ranks started after it, which would then run on alone (a notice during a slow start, then exit 143).
        self._held = []
        try:
            self._start_ranks(attempt, port)
        finally:
            held, self._held = self._held, None
            for signum in held:
                self._pass_on(signum)

    def _start_ranks(self, attempt: int, port: int) -> None:
        for rank in range(self.processes):
            env = {
                **self.env,
                **_rank_env(rank, rank, self.processes, 0, self.address, port),
                LAUNCHER_ENV: "fabriclite run",
                "LOCAL_WORLD_SIZE": str(self.processes),  # as torchrun sets them, for scripts that read them
                "GROUP_RANK": "0",
                RESTART_ENV: str(attempt),
                FAILURE_FILE_ENV: self._record(attempt, rank),
            }
            self.ranks.append(
                subprocess.Popen(self.command, env=env, start_new_session=True, preexec_fn=die_with_parent)
            )

    def _watch(self, attempt: int) -> int | None:
        """Wait until the group ends: its exit code, or None to start it again."""
        handled = 0
        stop_by = None
        while True:
            # Before the signals: a rank that a last signal killed is then always seen after that signal.
            codes = [rank.poll() for rank in self.ranks]
            if len(self.signals) > handled:
                name = signal.Signals(self.signals[-1]).name
                # The third notice, or a second interrupt (both may come before this loop looks): the hard way.
                if len(self.signals) > 2 or (len(self.signals) > 1 and signal.SIGINT in self.signals):
                    say(f"{name} received {'again' if len(self.signals) == 2 else 'a third time'}; killing every rank.")
                    self._stop()
                    return 128 + self.signals[-1]
                if len(self.signals) == 2 and handled < 2:  # the ranks take it too: they leave after their saves
                    say(f"{name} received again; the ranks exit once their saves under way have ended.")
                handled = len(self.signals)
                self.notice = self.signals[0]
            if self.notice and stop_by is None:
                stop_by = time.monotonic() + self.deadline
            # A rank that saved after a notice exits 0 or 75; 75 also when the notice reached the ranks, not this. One
            # that the notice itself ended (it came before the rank's Fabric took notices) had nothing to save yet.
            ended_well = all(code in _ENDED or self._ended_by_notice(code) for code in codes)
            if ended_well:
                return self._after_notice() if self.notice or PREEMPTED_EXIT_CODE in codes else 0
            if self.notice and all(code is not None for code in codes):
                self._stop()
                return _first(codes)  # a rank failed after the preemption notice
            if not self.notice and any(code not in (None, *_ENDED) for code in codes):
                return self._after_failure(attempt)
            if stop_by is not None and time.monotonic() > stop_by:
                say(f"the ranks did not exit within {self.deadline:g} s of the preemption notice; killing them.")
                self._stop()
                return 128 + self.notice
            time.sleep(0.1)

    def _after_failure(self, attempt: int) -> int | None:
        """Stop every rank after one died: the exit code of the rank that failed first, or None to start the group
        again. A failure that repeats an earlier attempt's ends the run."""
        codes = self._codes_after_a_failure()
        failures = [
            read(self._record(attempt, rank), rank, code)
            for rank, code in enumerate(codes)
            if code not in (None, *_ENDED)
        ]
        self._stop()
        failure = first(failures)
        who = failure.describe()
        previous, self.failures = self.failures, self.failures + failures
        if attempt < self.max_restarts and repeats(failure, previous):
            newest = f"its newest is still save number {failure.progress}" if failure.progress else "it has none yet"
            say(
                f"{who} again: the same failure as in an earlier attempt, with no checkpoint of the run saved in between "
                f"({newest}). Restarting would only repeat it, so every rank is stopped "
                f"({self.max_restarts - attempt} of --max-restarts {self.max_restarts} left unused)."
            )
            return _exit_code(failure.code)
        if attempt < self.max_restarts:
            say(f"{who}; stopping every rank and starting them again (restart {attempt + 1} of {self.max_restarts}).")
            return None
        left = f" (no restarts left of --max-restarts {self.max_restarts})" if self.max_restarts else ""
        say(f"{who}; stopping every rank{left}.")
        return _exit_code(failure.code)

    def _record(self, attempt: int, rank: int) -> str:
        return os.path.join(self._records, f"{attempt}-{rank}.json")

    def _codes_after_a_failure(self) -> list[int | None]:
        # When one rank dies, the others' collectives fail a moment later, and they exit with errors of their own.
        # Wait that moment, so that a rank killed by a signal (the OOM killer, a SIGKILL) is seen and named first.
        deadline = time.monotonic() + SIBLING_EXIT_GRACE_S
        codes = [rank.poll() for rank in self.ranks]
        while not any(code is not None and code < 0 for code in codes) and time.monotonic() < deadline:
            time.sleep(0.02)
            codes = [rank.poll() for rank in self.ranks]
        return codes

    def _ended_by_notice(self, code: int | None) -> bool:
        return code is not None and self.notice in SIGNALS and -code in SIGNALS

    def _after_notice(self) -> int:
        if self.notice == signal.SIGINT:
            return 128 + signal.SIGINT
        for local, rank in enumerate(self.ranks):
            if self._ended_by_notice(rank.poll()):
                how = how_it_ended(rank.poll())
                say(
                    f"rank {local} {how} before it took notices (its Fabric did not "
                    "exist yet), so it had nothing to save; the newest complete checkpoint is the one to resume from."
                )
        if not requeue(say=lambda message: print(message, file=sys.stderr, flush=True)):
            say(f"preempted; every rank exited after saving. Exit code {PREEMPTED_EXIT_CODE}: run it again to resume.")
        return PREEMPTED_EXIT_CODE

    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        again = len(self.signals) == 1 and {signum, self.signals[0]} <= set(SIGNALS)
        if not (again and now - self._first_signal_at < SAME_NOTICE_S):  # else one notice come twice
            self.signals.append(signum)
            self._first_signal_at = self._first_signal_at or now
        if self._held is not None:
            self._held.append(signum)
        else:
            self._pass_on(signum)

    def _pass_on(self, signum: int) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                try:
                    rank.send_signal(signum)  # the rank only: its DataLoader workers are its business
                except ProcessLookupError:
                    pass

    def _stop(self) -> None:
        """SIGKILL every rank's whole session (a rank stuck in a collective ignores anything gentler) and reap."""
        for rank in self.ranks:
            try:
                os.killpg(rank.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for rank in self.ranks:
            try:
                rank.wait(timeout=30)
            except subprocess.TimeoutExpired:
                say(f"rank {self.ranks.index(rank)} (pid {rank.pid}) did not end after SIGKILL.")


def _first(codes: list[int | None]) -> int:
    return next((_exit_code(code) for code in codes if code not in (None, *_ENDED)), 0)
