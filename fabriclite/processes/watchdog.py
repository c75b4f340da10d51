"""Stall detection: a rank that waits too long says which ranks have not arrived, and where each one is.

A collective waits for every rank. When one rank hangs outside any collective (a deadlocked data loader worker, an
``input()``, a rank-0-only branch that never returns), the others wait in theirs until the collective timeout (30
minutes by default), printing nothing. Here every rank runs a daemon thread that looks at its main thread's stack
once a second and publishes, through a connection of its own to the job's key-value store (the one
``torch.distributed`` rendezvoused through), a heartbeat: which library call the main thread is inside (the call the
user's code made into fabriclite or torch: ``Fabric.backward``, ``Metric.compute``, a model forward...), since when,
and the user's line that made it. A rank that has been inside one such call longer than ``stall_timeout`` reads every
heartbeat and, when some rank is elsewhere, prints which ranks have not arrived and where they are; it repeats every
few minutes while the wait lasts. The stack is read from outside, so training steps pay nothing for this.

The same heartbeats end a call that every rank must make but some did not (``if fabric.global_rank == 0:
fabric.save(...)``). Fabric's own collectives (save, load, barrier, the collectives) run over a process group of
their own (``ParallelStrategy.calls_group``), so such a call waits instead of pairing with the other ranks'
training collectives; each heartbeat carries how many collectives its rank has issued on that group and on the
groups the training runs on (torch counts them). A rank that is behind on the calls group and ahead on a training
group went past the call without making it: that is proof, never a guess from time (``skipped_call``). The rank
that finds it publishes it; every rank says which call, which ranks made it and where the others are, and ends
(exit code 1) once all have read it, instead of waiting for the collective timeout.

Usage (the parallel strategies do this after joining the process group)::

    watchdog = StallWatchdog(rank, world_size, stall_timeout=60.0, collective_timeout=timeout)
    watchdog.start()
    ...
    watchdog.stop()
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from types import FrameType
from typing import Any, Callable

from fabriclite._versions import collective_count
from fabriclite.plugins.environments import ProcessEnvironment
from fabriclite.processes.failures import exit_now, record_now

_KEY = "fabriclite/watchdog/rank{}"
_VERDICT = "fabriclite/watchdog/skipped"  # a call some ranks skipped, once a rank proved it
_READ = "fabriclite/watchdog/skipped-read"  # how many ranks have read it
_SAMPLE_S = 1.0
_REPEAT_S = 300.0  # while a wait lasts, the report comes again every five minutes
_STORE_TIMEOUT_S = 5.0  # one store call, at most
_STORE_GIVE_UP_S = 30.0  # how long the store may fail (or not be reached) before the watchdog ends
_MAX_LISTED = 8  # ranks listed by name in one report; the rest are counted

# The call the user's code made into fabriclite or torch is "the operation" a rank is in.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fabriclite/, not processes/


class Places:
    """Which files are library code (fabriclite, its kernels, torch) and which are the user's.

    Usage: ``Places().is_user(frame)``.
    """

    def __init__(self) -> None:
        import torch

        library = [_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep]
        kernels = sys.modules.get("fabriclite.kernels")
        if kernels is not None and getattr(kernels, "__file__", None):  # a separate folder in editable installs
            library.append(os.path.dirname(os.path.abspath(kernels.__file__)) + os.sep)
        self.library = tuple(library)
        self.stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep

    def is_library(self, frame: FrameType) -> bool:
        return os.path.abspath(frame.f_code.co_filename).startswith(self.library)

    def is_user(self, frame: FrameType) -> bool:
        filename = frame.f_code.co_filename
        if filename.startswith("<frozen") or self.is_library(frame):
            return False
        return "site-packages" in filename or not os.path.abspath(filename).startswith(self.stdlib)


def locate(frame: FrameType | None, places: Places) -> tuple[FrameType | None, FrameType | None]:
    """``(operation, caller)`` for a thread's innermost ``frame``: ``caller`` is the innermost frame of user code,
    ``operation`` the library frame it called (the fabriclite or torch call the thread is inside), or None when the
    thread runs the user's own code.

    Usage: ``operation, caller = locate(sys._current_frames()[thread_id], Places())``.
    """
    operation = None
    while frame is not None:
        if places.is_user(frame):
            return operation, frame
        if places.is_library(frame):
            operation = frame
        frame = frame.f_back
    return operation, None


def describe(frame: FrameType | None) -> str:
    """One line naming a frame's file, line, function and source text. Usage: ``describe(caller)``."""
    if frame is None:
        return "outside any user code"
    filename = frame.f_code.co_filename
    try:
        shown = os.path.relpath(filename)
    except ValueError:  # another drive (Windows)
        shown = filename
    if shown.startswith(".."):
        shown = filename
    source = linecache.getline(filename, frame.f_lineno).strip()
    text = f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}"
    return f"{text}: `{source}`" if source else text


def operation_name(frame: FrameType) -> str:
    """``Fabric.backward``-style name of a library frame. Usage: ``operation_name(operation)``."""
    return getattr(frame.f_code, "co_qualname", frame.f_code.co_name)


class StallWatchdog:
    """A daemon thread per rank: heartbeats through the job's store, and a report when this rank has waited inside
    one library call longer than ``stall_timeout`` seconds while some other rank is elsewhere.

    Usage: ``StallWatchdog(rank, world_size, 60.0).start()`` after ``dist.init_process_group``.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        stall_timeout: float,
        collective_timeout: timedelta | None = None,
        prefix: str = "",
        thread_id: int | None = None,
        groups: Callable[[], tuple[Any, list[Any]]] | None = None,
    ) -> None:
        self.rank = rank
        self.groups = groups  # () -> (the calls group, the training's groups): what the heartbeat counts
        self.world_size = world_size
        self.stall_timeout = stall_timeout
        self.collective_timeout = collective_timeout
        self.thread_id = thread_id if thread_id is not None else threading.get_ident()
        self.prefix = prefix  # the group's part of a store that outlives it (torchrun's agent store)
        self.publish_every = min(5.0, max(0.5, stall_timeout / 4))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Any = None

    def start(self) -> bool:
        """Start the thread, which connects to the job's store first; False (and nothing runs) without one
        (no ``MASTER_ADDR`` and ``MASTER_PORT``)."""
        if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
            return False
        self._places = Places()
        self._thread = threading.Thread(target=self._run, name="fabriclite-stall-watchdog", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """End the thread and wait for it: a daemon thread still inside a store call when the interpreter shuts
        down is ended in a way C++ code cannot survive (the process aborts), so this runs before that. A rank that
        ends without an error says so in a last heartbeat: a rank waiting in a call it never made learns why."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _STORE_TIMEOUT_S)
        if self._store is not None and getattr(sys, "last_value", None) is None:  # no uncaught exception
            try:
                ended = {"operation": None, "caller": "its end", "since": time.time(), "beat": time.time()}
                self._store.set(_KEY.format(self.rank), json.dumps({**ended, **self._counts(), "ended": True}))
            except Exception:
                pass

    def _run(self) -> None:
        held: FrameType | None = None  # holding the frame keeps its identity: a new call is a new frame object
        since = time.time()
        last_publish = last_report = last_check = 0.0
        failing_since = None  # when the store calls began to fail, while they do
        # On a loaded machine connecting may time out too: tried again, as a failed call is.
        while self._store is None:
            self._store = _connect_store(self.prefix)
            failing_since = failing_since or time.monotonic()
            if self._store is None and (time.monotonic() - failing_since > _STORE_GIVE_UP_S or self._stop.wait(1)):
                return
        try:
            while not self._stop.wait(_SAMPLE_S):
                frame = sys._current_frames().get(self.thread_id)
                if frame is None:
                    return  # the main thread has ended
                operation, caller = locate(frame, self._places)
                current = operation if operation is not None else caller
                if current is not held:
                    held, since = current, time.time()
                    last_report = 0.0  # a new wait gets its own report, even soon after one about the previous wait
                del frame
                now = time.time()
                state = {
                    "operation": operation_name(operation) if operation is not None else None,
                    "caller": describe(caller),
                    "since": since,
                    "beat": now,
                    **self._counts(),
                }
                try:
                    if self._store.check([_VERDICT]):  # another rank proved a call that some ranks skipped
                        self._end(json.loads(self._store.get(_VERDICT)))
                    if now - last_publish >= self.publish_every:
                        self._store.set(_KEY.format(self.rank), json.dumps(state))
                        last_publish = now
                    waited = now - since
                    # Stuck in a call for a while: maybe a call the others skipped (read their heartbeats now and
                    # then: they are published as often), or a stall to report.
                    check = operation is not None and waited >= self.publish_every
                    if check and now - last_check >= self.publish_every:
                        last_check = now
                        verdict = skipped_call({**self._others(), self.rank: state})
                        if verdict is not None:
                            self._store.set(_VERDICT, json.dumps(verdict))
                            self._end(verdict)
                    if operation is not None and waited >= self.stall_timeout and now - last_report >= _REPEAT_S:
                        if self._report(state, waited, now):
                            last_report = now
                    failing_since = None
                except Exception:
                    # A slow store call on a loaded machine is no reason to stop watching; failing for long means
                    # the store went away with rank 0: the run is ending, and the dead-rank path says why.
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > _STORE_GIVE_UP_S:
                        return
        except Exception:  # anything else: watching is a courtesy, never a reason to disturb the run
            pass

    def _counts(self) -> dict[str, Any]:
        """How many collectives this rank has issued on the calls group ("calls") and on each training group
        ("groups", by name), read at one moment: {} while the main thread is issuing some (read again later), and
        without groups to count."""
        calls, training = self.groups() if self.groups is not None else (None, [])
        if calls is None:
            return {}
        before = {group.group_name: collective_count(group) for group in training}
        count = collective_count(calls)
        after = {group.group_name: collective_count(group) for group in training}
        return {"calls": count, "groups": after} if before == after else {}

    def explain(self) -> str | None:
        """Why a collective over the calls group failed in the main thread, when the heartbeats prove it: a call
        some ranks did not make (one that ended meanwhile closed the group). None otherwise. Usage: in ``except``."""
        verdict = _said[0] if _said else None
        if verdict is None:
            frame = sys._current_frames().get(self.thread_id)
            operation, caller = locate(frame, Places())
            name = operation_name(operation) if operation is not None else None
            mine = {"operation": name, "caller": describe(caller), "since": time.time(), "beat": time.time()}
            try:
                verdict = skipped_call({**self._others(), self.rank: {**mine, **self._counts()}})
            except Exception:  # the store went away with its rank
                return None
        return None if verdict is None else skipped_message(verdict)

    def _end(self, verdict: dict[str, Any]) -> None:
        """Say ``verdict`` on this rank, record it as what ended this rank, and end it (exit code 1) once every rank
        has read it (a rank's exit would close the group, and the store with rank 0, before the others knew)."""
        if not _said:  # once, even if a store call below fails and the next sample comes here again
            _said[:] = [verdict]
            message = skipped_message(verdict)
            ending = f"Rank {self.rank} ends here (exit code 1) rather than wait for the collective timeout."
            print(f"fabriclite: {message} {ending}", file=sys.stderr, flush=True)
            record_now(RuntimeError(message))
            # From the first rank's exit on, the others' collectives fail ("Connection closed by peer"): said here
            # already, such an error ends this rank at once, not as a traceback in its place.
            sys.excepthook = lambda *exc_info: exit_now(1)
            self._store.add(_READ, 1)
        read, deadline = self._store.add(_READ, 0), time.monotonic() + 2 * self.publish_every + 2 * _SAMPLE_S
        while read < self.world_size and time.monotonic() < deadline:
            time.sleep(0.1)
            read = self._store.add(_READ, 0)
        exit_now(1)

    def _others(self) -> dict[int, dict[str, Any] | None]:
        keys = [_KEY.format(rank) for rank in range(self.world_size) if rank != self.rank]
        present = {key for key in keys if self._store.check([key])}
        states: dict[int, dict[str, Any] | None] = {}
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = _KEY.format(rank)
            states[rank] = json.loads(self._store.get(key)) if key in present else None
        return states

    def _report(self, mine: dict[str, Any], waited: float, now: float) -> bool:
        missing, waiting = [], []
        for rank, state in self._others().items():
            if state is None:
                missing.append(f"rank {rank}: no heartbeat yet (it has not joined the watchdog)")
            elif now - state["beat"] > 3 * self.publish_every + 10:
                missing.append(
                    f"rank {rank}: no heartbeat for {now - state['beat']:.0f} s (stuck in native code that holds "
                    f"the interpreter lock, or its host is unreachable); last seen {_doing(state, now)}"
                )
            elif state["operation"] != mine["operation"]:
                missing.append(f"rank {rank}: {_doing(state, now)}")
            else:
                waiting.append(rank)
        if not missing:
            return False  # every rank is in the same call: a slow collective or save, not a missing rank
        lines = [
            f"fabriclite: rank {self.rank} has waited {waited:.0f} s in {mine['operation']} (called at "
            f"{mine['caller']}); {len(missing)} of {self.world_size} ranks have not arrived:"
        ]
        lines += [f"  {line}" for line in missing[:_MAX_LISTED]]
        if len(missing) > _MAX_LISTED:
            lines.append(f"  ... and {len(missing) - _MAX_LISTED} more")
        also = f"ranks {_ranges(waiting)} wait in the same call; " if waiting else ""
        limit = "never"
        if self.collective_timeout is not None:
            limit = f"after the collective timeout of {_minutes(self.collective_timeout.total_seconds())}"
        lines.append(
            f"  ({also}the run fails {limit}; this report repeats every {_REPEAT_S / 60:.0f} min while the wait "
            f"lasts; stall_timeout={self.stall_timeout:g} s sets when it starts, None turns it off)"
        )
        print("\n".join(lines), file=sys.stderr, flush=True)
        return True


_said: list[dict[str, Any]] = []  # the verdict this rank ends for (``StallWatchdog._end``)


def skipped_call(states: dict[int, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The call some ranks made and others went past without making, proven by the heartbeats ``states`` (rank ->
    heartbeat), or None. Collectives on one group are issued in the same order on every rank; so a rank behind on
    the calls group (it has not issued the call's collective) and ahead on a training group (it issued one the
    callers issue only after the call) skipped the call; so did one that ended. Ranks behind without proof may
    still be on their way: they are listed, never the reason.

    Usage: ``verdict = skipped_call({0: heartbeat_0, 1: heartbeat_1})``.
    """
    counted = {rank: state for rank, state in states.items() if state and "calls" in state}
    if len(counted) < 2:
        return None
    latest = max(state["calls"] for state in counted.values())
    made = sorted(rank for rank, state in counted.items() if state["calls"] == latest)

    def went_past(state: dict[str, Any]) -> bool:
        return state.get("ended", False) or any(
            count > counted[rank]["groups"][name]
            for rank in made
            for name, count in state["groups"].items()
            if name in counted[rank]["groups"]
        )

    behind = {rank: state for rank, state in counted.items() if state["calls"] < latest}
    if not any(went_past(state) for state in behind.values()):
        return None
    return {
        "call": next((counted[rank]["operation"] for rank in made if counted[rank]["operation"]), None),
        "made": {rank: counted[rank]["caller"] for rank in made},
        "behind": {rank: [state, went_past(state)] for rank, state in sorted(behind.items())},
        "unseen": sorted(set(states) - set(counted)),
    }


def skipped_message(verdict: dict[str, Any]) -> str:
    """``skipped_call``'s verdict in words. Usage: ``raise RuntimeError(skipped_message(verdict))``."""
    made = {int(r): caller for r, caller in verdict["made"].items()}  # JSON keys are strings
    call = verdict["call"] or "a collective"
    if call.startswith("Fabric."):  # the name the user wrote
        call = f"fabric.{call[len('Fabric.') :]}"
    call = call if call == "a collective" else f"{call}()"
    where = "; ".join(f"rank {r} at {caller}" for r, caller in made.items())
    others = []
    for other, (state, past) in verdict["behind"].items():
        if state.get("ended"):
            others.append(f"rank {other} ended without calling it")
        elif past:
            doing = f"in {state['operation']}" if state["operation"] else "in its own code"
            others.append(f"rank {other} went on without it and is now {doing}, at {state['caller']}")
        else:
            others.append(f"rank {other} has not called it yet ({_doing(state, time.time())})")
    others += [f"rank {other} sent no heartbeat" for other in verdict["unseen"]]
    ranks = f"rank {_ranges(sorted(made))}" if len(made) == 1 else f"ranks {_ranges(sorted(made))}"
    return (
        f"{call} was called on {ranks} only ({where}), but every rank must call it: {'; '.join(others)}. "
        "Call it on every rank, outside any `if fabric.global_rank == ...:` branch."
    )


def _doing(state: dict[str, Any], now: float) -> str:
    duration = f"{now - state['since']:.0f} s"
    if state["operation"] is None:
        return f"running its own code for {duration}, at {state['caller']}"
    return f"in {state['operation']} for {duration}, called at {state['caller']}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 60 else f"{seconds:g} s"


def _ranges(ranks: list[int]) -> str:
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ", ".join(parts)


def _connect_store(prefix: str = "") -> Any:
    """A client connection of our own to the store at MASTER_ADDR:MASTER_PORT (the main thread may be blocked in
    a call on the process group's own), under ``prefix``, or None when there is none."""
    import torch.distributed as dist

    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not address or not port:
        return None
    try:
        store = dist.TCPStore(address, int(port), is_master=False, timeout=timedelta(seconds=_STORE_TIMEOUT_S))
    except (RuntimeError, ValueError, OSError):
        return None
    return dist.PrefixStore(f"{prefix}fabriclite-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/", store)


@contextmanager
def saying_who_has_not_joined(environment: ProcessEnvironment | None, stall_timeout: float | None) -> Iterator[None]:
    """Run the block (joining the process group); while it takes longer than ``min(stall_timeout, 30)`` seconds,
    say so every few minutes, and when the launch variables came from outside (no launcher of fabriclite, no
    torchrun, no SLURM), what usually causes it: variables left over from another job or a shell, with nobody
    starting the other processes. Without an environment (one plain process) or with ``stall_timeout=None`` it
    says nothing.

    Usage: ``with saying_who_has_not_joined(env, 60.0): dist.init_process_group(...)``.
    """
    if environment is None or stall_timeout is None:
        yield
        return
    joined = threading.Event()
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    advice = ""
    if environment.external and environment.source == "env":
        values = ", ".join(f"{name}={os.environ[name]}" for name in names if name in os.environ)
        advice = (
            f" This process was told it is rank {environment.global_rank} of {environment.world_size} by "
            f"environment variables that no launcher set ({values}). If they are left over from another job or "
            f"your shell, unset them (unset {' '.join(names)}) and Fabric starts its processes itself; to start "
            "the processes yourself, use torchrun or `fabriclite run`."
        )

    def warn() -> None:
        waited, wait = 0.0, min(stall_timeout, 30.0)
        while not joined.wait(wait):
            waited += wait
            print(
                f"fabriclite: rank {environment.global_rank} has waited {waited:.0f} s for the other processes of "
                f"the job ({environment.world_size} in all) to join at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')}.{advice}",
                file=sys.stderr,
                flush=True,
            )
            wait = _REPEAT_S

    threading.Thread(target=warn, name="fabriclite-join-warning", daemon=True).start()
    try:
        yield
    finally:
        joined.set()
