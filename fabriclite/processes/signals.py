"""What a signal does to a process of a run: one policy, one state machine (``_Policy``), driven by one thread that
takes every signal as an event (``_watch``), for preemption notices (SIGTERM, SIGUSR1) and interrupts (SIGINT).

``install`` runs when the process starts its part in a run (``Fabric`` creation, from the main thread), before
setup, compilation, ``load_latest`` or the first step, so that a notice at any of those moments is noted, not fatal.

- **A notice** (a first SIGTERM or SIGUSR1) is noted: ``fabric.preempted`` becomes True on every rank at the same
  step (``preemption.agreed``); the script saves and exits 75.
- **The same notice again** within ``SAME_NOTICE_S`` is one notice come twice (SLURM signals every process of a job
  step, and a launcher passes the signal on too): nothing more happens.
- **A second notice** later (SLURM's ``--signal=USR1@T``, then the time limit's SIGTERM) waits for the saves under
  way, a synchronous one on the main thread or an asynchronous write in the background (``saving``), then exits
  with ``PREEMPTED_EXIT_CODE`` (75): every checkpoint is complete or untouched, so the run resumes from the newest.
- **A third notice**, or ``GRACE_S`` after the first without the process having ended, ends it the hard way: the
  signal's default action (128 + its number).
- A notice never becomes a kill otherwise, whatever the main thread is doing (a long save, a collective waiting for
  a rank that saves).
- **SIGINT** stays Python's ``KeyboardInterrupt``. Python runs handlers only between bytecodes, so a main thread
  blocked in native code (a collective waiting for a hung rank) never sees it: while Python has not raised the
  ``KeyboardInterrupt``, once the main thread has stayed at the very same instruction for ``INTERRUPT_GRACE_S``
  (counted again wherever it stops within ``INTERRUPT_WATCH_S`` of the SIGINT), the process exits with 130. Once
  Python has raised it (``_on_interrupt``, the SIGINT handler in place of Python's own, notes when), what the
  user's ``except KeyboardInterrupt:`` does is the user's: a last save may block anywhere for as long as it takes.
  The same SIGINT come twice within ``SAME_NOTICE_S`` (a terminal signals every process of its job, and a
  launcher passes it on too) is raised once; a SIGINT after that is raised again, and ends the process after
  ``INTERRUPT_AGAIN_S`` where Python cannot raise it. Under a SIGINT handler of the user's own, this process
  cannot know when it ran: the 130 rule holds as for a main thread that never took the interrupt.
- Every signal is passed on to the ranks this process started (``forward_to``) as it arrives.
- A process forked from this one (a DataLoader worker) inherits handlers that ignore notices: its rank decides. One
  that takes a part in the run itself (a rank of ``ddp_fork``) installs a policy of its own.

The C-level handler writes each signal's number to the wakeup fd even while the main thread is blocked; the
watching thread reads it. Where someone else owns the wakeup fd (asyncio, an IDE), the Python handler hands each
notice to a thread of its own instead.

Usage: ``install(rank)`` once per process; ``with saving(): ...`` around a save; ``noticed()`` for the notice,
``interrupted()`` for a Ctrl-C.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from fabriclite.processes.failures import exit_now

NOTICES = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 75  # sysexits.h's EX_TEMPFAIL: "a temporary failure; the user is invited to retry"
SAME_NOTICE_S = 2.0
GRACE_S = 300.0  # after a notice, how long a process may take to save and exit before it is ended
INTERRUPT_GRACE_S = 10.0  # how long a main thread blocked in native code gets to take an interrupt itself
INTERRUPT_WATCH_S = 60.0  # how long after a SIGINT a main thread that stops somewhere is still counted as blocked
INTERRUPT_AGAIN_S = 1.0  # the same, for a SIGINT after Python raised one: the user asks to stop the cleanup


class _Policy:
    """The signal state of this process. ``on_notice`` is the one place that decides what a notice means; the
    watching thread acts on it. ``saves`` counts the saves under way (any thread)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.rank = 0
        self.notice: int | None = None  # the first notice
        self.noticed_at = 0.0
        self.notices = 0  # notices counted (one come twice counts once)
        self.leaving = False  # a second notice came: exit once no save is under way
        self.saves = 0
        # Asked at a SIGTERM: why it is a launcher stopping the group after a failure (then no notice), or None.
        self.stop_reason: Callable[[], str | None] | None = None
        self.stop_code: int | None = None  # set when this process leaves stopped, not preempted
        self.lock = threading.Lock()

    def on_notice(self, signum: int) -> str:
        """What the notice ``signum`` means now: "note", "same", "leave" (after the saves under way), "hard"."""
        with self.lock:
            now = time.monotonic()
            if self.notice is None:
                self.notice, self.noticed_at, self.notices = signum, now, 1
                return "note"
            if self.notices == 1 and now - self.noticed_at < SAME_NOTICE_S:
                return "same"
            self.notices += 1
            if self.notices == 2 and now - self.noticed_at < GRACE_S:
                self.leaving = True
                return "leave"
            return "hard"

    def grace_left(self) -> float | None:
        return None if self.notice is None else self.noticed_at + GRACE_S - time.monotonic()


_policy = _Policy()
_installed = False
_watching = False  # the watching thread reads the wakeup fd
_write_fd = -1  # the wakeup fd's writing end, ours
_children: list[list[Any]] = []  # lists of the processes this one started (subprocess.Popen): signals go on to them
_notices = list(NOTICES)  # and the run's own requeue signal, SLURMEnvironment(requeue_signal=...)
_auto_requeue = True  # SLURMEnvironment(auto_requeue=False): a preempted run exits 75 without requeuing its job


def install(rank: int = 0, environment: Any = None) -> None:
    """Take notices (SIGTERM, SIGUSR1) by this module's policy, and start the thread that watches every signal;
    ``rank`` names this process in what it says. A ``SLURMEnvironment`` as ``environment`` (Fabric's plugin) adds
    its ``requeue_signal`` to the notices, and its ``auto_requeue=False`` keeps ``requeue`` from requeuing. From the
    main thread only (Python's rule for signal handlers); elsewhere, and a second time, it only updates ``rank`` and
    takes ``environment``'s settings. Usage: ``install(global_rank)``."""
    global _installed, _policy, _watching
    if _policy.pid != os.getpid():  # forked, and taking a part in the run itself (ddp_fork): a policy of its own
        _policy, _installed, _watching = _Policy(), False, False
        _children.clear()
    _policy.rank = rank
    _take_requeue(environment)
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed = True
    for signum in _notices:
        signal.signal(signum, _on_notice)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # never a handler of the user's, nor SIG_IGN
        signal.signal(signal.SIGINT, _on_interrupt)
    _start_watching()


def uninstall() -> None:
    """Give the signals back (a process that becomes a supervisor of others has its own policy): the notices their
    default action, the wakeup fd to nobody. ``Supervisor.run`` calls it. Usage: ``uninstall()``."""
    global _installed, _watching
    if not _installed:
        return
    for signum in _notices:
        signal.signal(signum, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is _on_interrupt:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if _watching and _wakeup_is_ours():
        signal.set_wakeup_fd(-1)
    _installed = _watching = False
    _children.clear()


def explain_stop(reason: Callable[[], str | None]) -> None:
    """Ask ``reason()`` at the first SIGTERM whether it is the launcher stopping this group after another rank
    failed (torchrun does so with SIGTERM): a text saying why ends this process after the saves under way, with
    code 143 and no requeue; None keeps it a preemption notice. Usage: ``explain_stop(generation.stopped_after_failure)``.
    """
    _policy.stop_reason = reason


def _take_requeue(environment: Any) -> None:
    # SLURMEnvironment(requeue_signal=..., auto_requeue=...), read by its names (importing the plugins here would
    # make a cycle): one more notice, and whether `requeue` may requeue.
    global _auto_requeue
    signum = getattr(environment, "requeue_signal", None)
    if signum is None:
        return
    _auto_requeue = environment.auto_requeue
    if signum not in _notices:
        _notices.append(signum)
        if _installed and threading.current_thread() is threading.main_thread():
            signal.signal(signum, _on_notice)


def noticed() -> int | None:
    """The first notice this process received (``signal.SIGTERM``, ``SIGUSR1``, a requeue signal), or None."""
    return _policy.notice


def forward_to(children: list[Any]) -> None:
    """Pass every signal this process receives from now on to ``children`` (a list of ``subprocess.Popen`` or
    ``multiprocessing`` processes, read at each signal, so ranks started later count).
    Usage: ``forward_to(launcher.children)``."""
    if not any(known is children for known in _children):
        _children.append(children)


@contextmanager
def saving() -> Iterator[None]:
    """Mark a save under way (on any thread): a second notice waits for it. Usage: ``with saving(): write()``."""
    with _policy.lock:
        _policy.saves += 1
    try:
        yield
    finally:
        with _policy.lock:
            _policy.saves -= 1


def _on_notice(signum: int, frame: Any) -> None:
    if os.getpid() != _policy.pid:  # a forked child (a DataLoader worker): its rank decides for it
        signal.signal(signum, signal.SIG_IGN)
        return
    if not (_watching and _wakeup_is_ours()):  # else the watching thread has it: decide on a thread of its own
        threading.Thread(target=_leave_when_done, args=(_event(signum),), daemon=True).start()


def _event(signum: int) -> bool:
    """Act on one signal (on the watching thread); True once this process is to leave after its saves."""
    _pass_on(signum)
    if signum not in _notices:
        return _policy.leaving
    name, rank = signal.Signals(signum).name, _policy.rank
    why = _policy.stop_reason() if signum == signal.SIGTERM and _policy.stop_reason and not _policy.notice else None
    if why:
        say(
            f"fabriclite: rank {rank} received {name} after {why}: the launcher is stopping the group, which is no "
            f"preemption; exiting without a save (exit code {128 + signum})."
        )
        with _policy.lock:
            _policy.leaving, _policy.stop_code = True, 128 + signum
        return True
    action = _policy.on_notice(signum)
    if action == "note":
        say(
            f"fabriclite: rank {rank} received {name}; fabric.preempted becomes True on every rank within two reads "
            f"(a second signal, {SAME_NOTICE_S:g} s or more later, ends the run with exit code {PREEMPTED_EXIT_CODE} "
            "once the save under way, if any, has finished)."
        )
    elif action == "leave":
        say(
            f"fabriclite: rank {rank} received {name} again; exiting with code {PREEMPTED_EXIT_CODE} once no save is under way."
        )
    elif action == "hard":
        say(f"fabriclite: rank {rank} received {name} a third time; ending it at once (exit code {128 + signum}).")
        _kill_children()
        exit_now(128 + signum)  # as a shell reports the signal's default action; this may not be the main thread
    return _policy.leaving


def _leave_when_done(leaving: bool) -> None:
    while leaving:
        if _leave_if_done():
            return
        time.sleep(0.1)


def _leave_if_done() -> bool:
    with _policy.lock:
        if _policy.saves:
            return False
    # The ranks this process started got the notice too, and leave once their own saves are done: they die with
    # this process, so let them finish first (within the grace period).
    while _running_children() and (_policy.grace_left() or 0) > 0:
        time.sleep(0.1)
    if _policy.stop_code is None:
        _end_as_preempted()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    exit_now(PREEMPTED_EXIT_CODE if _policy.stop_code is None else _policy.stop_code)


def _end_as_preempted() -> None:
    # Ranks with a fabriclite launcher above them are requeued by it; others (srun's tasks) by global rank 0 here, as
    # the end of a preempted script does (preemption._end), without its barrier: every rank is leaving anyway.
    if _policy.rank == 0 and os.environ.get("FABRICLITE_LAUNCHER") != "fabriclite run":
        requeue(say=say)


def say(message: str) -> None:
    """Write one line to standard error from any thread, even while the main thread is inside a print."""
    os.write(2, f"{message}\n".encode())  # not print(): the main thread may be inside a print right now


# ---------------------------------------------------------------------- SLURM
def slurm_job_id() -> str | None:
    """The id under which SLURM requeues this job, or None outside SLURM: ``<array job>_<task>`` in an array job
    (``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``; the task, not the whole array, is what was preempted), else
    ``SLURM_JOB_ID``. Usage: ``scontrol requeue <slurm_job_id()>``."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID")


def requeue(say: Any = print) -> bool:
    """In a SLURM job, ask SLURM to requeue it (``scontrol requeue`` with ``slurm_job_id()``); True when it did. A
    job that may not be requeued (``--no-requeue``, the cluster's policy) makes scontrol fail: False, and the reason
    said; likewise without ``scontrol`` on the PATH (the command to run is said), or after
    ``SLURMEnvironment(auto_requeue=False)``."""
    job = slurm_job_id()
    scontrol = shutil.which("scontrol")
    if job is None:
        return False
    if not _auto_requeue:
        say(f"fabriclite: not requeuing SLURM job {job}, as SLURMEnvironment(auto_requeue=False) asks.")
        return False
    if scontrol is None:
        say(
            f"fabriclite: could not requeue SLURM job {job}: `scontrol` is not on the PATH here. Run `scontrol requeue "
            f"{job}` where SLURM's commands are (a login node; a batch job can be requeued after it ended), or submit "
            "it again: it resumes from its latest checkpoint."
        )
        return False
    try:
        result = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        say(f"fabriclite: could not requeue SLURM job {job} ({error}).")
        return False
    if result.returncode != 0:
        reason = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        say(f"fabriclite: SLURM did not requeue job {job}: {reason}.")
        return False
    say(f"fabriclite: requeued SLURM job {job}; it resumes from its latest checkpoint when it starts again.")
    return True


# ---------------------------------------------------------------------- the watching thread
def _start_watching() -> None:
    global _watching, _write_fd
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    if previous != -1:  # someone else's: leave it to them
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)
        return
    _watching, _write_fd = True, write_fd
    os.register_at_fork(after_in_child=_forget_wakeup_fd)  # DataLoader workers must not write into this pipe
    main_id = threading.get_ident()
    threading.Thread(target=_watch, args=(read_fd, main_id), name="fabriclite-signals", daemon=True).start()


def _wakeup_is_ours() -> bool:
    # Something may have taken the wakeup fd since (asyncio's add_signal_handler does): then nobody reads ours.
    current = signal.set_wakeup_fd(-1)
    ours = current == _write_fd
    if current != -1:
        signal.set_wakeup_fd(current, warn_on_full_buffer=not ours)
    return ours


def _forget_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one: the child has no wakeup fd to clear
        pass


def _watch(read_fd: int, main_id: int) -> None:
    """The loop: every signal is an event; between events, the timers (an interrupt the main thread cannot take, the
    grace after a notice) and a pending exit after the saves under way."""
    interrupt = _Interrupt()
    while True:
        timers = [t for t in (interrupt.until, _deadline()) if t is not None]
        wait = min(timers) - time.monotonic() if timers else None
        if _policy.leaving or interrupt.until is not None:
            wait = 0.1 if wait is None else min(wait, 0.1)  # poll the saves, and the main thread's place
        ready, _, _ = select.select([read_fd], [], [], None if wait is None else max(0.0, wait))
        if ready:
            received = os.read(read_fd, 64)
            if not received:
                return
            for signum in dict.fromkeys(received):  # in arrival order, once each
                _event(signum)
                if signum == signal.SIGINT:
                    interrupt.arm(_main_position(main_id))
        if _policy.leaving:
            _leave_if_done()
        if interrupt.until is not None and interrupt.blocked(_main_position(main_id)):
            say(
                f"fabriclite: SIGINT received{' again' if interrupt.again else ''}, and this process stayed blocked "
                f"for {interrupt.grace:g} s in {interrupt.blocked_at[2]} (most often a collective waiting for "
                f"another rank), where Python cannot stop it; exiting with code {128 + signal.SIGINT}."
            )
            _kill_children()
            exit_now(128 + signal.SIGINT)
        left = _policy.grace_left()
        if left is not None and left <= 0:
            notice = _policy.notice or signal.SIGTERM
            say(
                f"fabriclite: rank {_policy.rank} has not ended {GRACE_S:g} s after the preemption notice; ending it "
                f"(exit code {128 + notice})."
            )
            _kill_children()
            exit_now(128 + notice)


# ---------------------------------------------------------------------- interrupts
_raised_at: float | None = None  # when Python last raised KeyboardInterrupt for a SIGINT (time.monotonic())


def _on_interrupt(signum: int, frame: Any) -> None:
    """SIGINT's handler in place of Python's own (``signal.default_int_handler``), which it does as that does,
    noting when: Python runs it in the main thread between two bytecodes, so from then on the main thread is the
    user's code handling the interrupt, not native code that cannot take it."""
    global _raised_at
    now = time.monotonic()
    if _raised_at is not None and now - _raised_at < SAME_NOTICE_S:
        return  # the same SIGINT come twice (the terminal's, and a launcher's copy): raised once
    _raised_at = now
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether Python raised a KeyboardInterrupt for a SIGINT (Ctrl-C) in this process: then a rank it started that
    ended by the same interrupt did as asked. Usage: ``if code == 130 and interrupted(): ...``."""
    return _raised_at is not None


class _Interrupt:
    """The watching thread's side of a SIGINT: armed when one comes that Python has not raised, it says the main
    thread is ``blocked`` once it has stayed at one instruction for ``grace`` seconds (counted again wherever it
    stops within ``INTERRUPT_WATCH_S``), and stands down once Python raises the KeyboardInterrupt."""

    def __init__(self) -> None:
        self.until: float | None = None  # when the main thread counts as blocked, while armed
        self.armed_at = 0.0
        self.blocked_at: tuple[int, int, str] | None = None  # where the main thread stands
        self.grace = INTERRUPT_GRACE_S
        self.again = False  # a SIGINT after Python had raised one

    def arm(self, position: tuple[int, int, str] | None) -> None:
        now = time.monotonic()
        if self.until is not None or self._raised_since(now - SAME_NOTICE_S):
            return  # armed already, or Python raised this SIGINT (or the same one come twice) before we read it
        self.again = _raised_at is not None
        self.grace = INTERRUPT_AGAIN_S if self.again else INTERRUPT_GRACE_S
        self.armed_at, self.blocked_at, self.until = now, position, now + self.grace

    def blocked(self, position: tuple[int, int, str] | None) -> bool:
        now = time.monotonic()
        # Python raised it (this SIGINT, or one the handler took for it come twice): the user's code decides now.
        if self._raised_since(self.armed_at - SAME_NOTICE_S):
            self.until = None
        elif self.blocked_at is None or position != self.blocked_at:
            # The main thread moved without raising it: a SIGINT that came just before it entered native code (a
            # collective) is raised only once that returns, so a stop there counts again from where it stopped.
            if now - self.armed_at < INTERRUPT_WATCH_S:
                self.blocked_at, self.until = position, now + self.grace
            else:
                self.until = None
        return self.until is not None and now >= self.until

    @staticmethod
    def _raised_since(moment: float) -> bool:
        return _raised_at is not None and _raised_at >= moment


def _deadline() -> float | None:
    left = _policy.grace_left()
    return None if left is None else time.monotonic() + left


def _pass_on(signum: int) -> None:
    for child in _running_children():
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass


def _kill_children() -> None:
    for child in _running_children():
        child.kill()


def _running_children() -> list[Any]:
    running = []
    for children in _children:
        for child in list(children):
            alive = child.poll() is None if hasattr(child, "poll") else child.is_alive()
            if alive:
                running.append(child)
    return running


def _main_position(main_id: int) -> tuple[int, int, str] | None:
    from fabriclite.processes.watchdog import Places, describe, locate, operation_name

    frame = sys._current_frames().get(main_id)
    if frame is None:
        return None
    operation, caller = locate(frame, Places())
    where = f"{operation_name(operation)}, called at {describe(caller)}" if operation else describe(caller)
    return id(frame), frame.f_lasti, where
