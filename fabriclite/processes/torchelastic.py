"""Ranks that torchrun (torchelastic's agent) started, and restarts: what fabriclite adds so that a restarted group
reconnects, and so that the group's end after one rank's failure is said as what it is.

- **A fresh generation for every group** (``join``). Under torchrun's defaults every worker's process group meets
  in the agent's key-value store (``TORCHELASTIC_USE_AGENT_STORE=True``), which the agent creates once and keeps
  across restarts, and torch's ``env://`` rendezvous adds no prefix of its own there: a restarted group reads the dead
  group's keys (gloo's addresses of ranks that are gone: "connectFullMesh failed ... Connection refused", or a join
  that waits for ever). The restart count cannot name the group: with several agents, only the agent whose worker
  failed counts a restart, the others restart theirs on the membership change. So the ranks of one group agree on a
  generation no earlier group used: rank 0 draws a random one and publishes it; every other rank registers under the
  generation it reads, then waits until rank 0 admits the generation. A generation admitted before the rank
  registered is a dead group's: the rank waits for rank 0 to publish the next one, and registers again. Everything
  of the group (its process group, the stall watchdog, the failure record) lives under that generation's prefix.
- **The first failure, recorded** (``Generation.watch``). An exception that ends a rank is recorded in the group's
  store (the first one only) and in torchelastic's error file (``TORCHELASTIC_ERROR_FILE``, the JSON that torch's
  ``@record`` writes), so torchrun's summary shows the exception. A rank whose exception followed another rank's
  (its collective broke when that rank died) says so, and waits a moment for torchrun to stop it, so torchrun names
  the rank that failed first, not the one whose error came out first.
- **Stopped after a failure is no preemption** (the same). torchrun stops every worker with SIGTERM when one fails,
  which fabriclite otherwise takes for a preemption notice (a save, then exit 75): a SIGTERM that comes while the
  group's store records another rank's failure ends the rank at once, saying why.

Usage (``ParallelStrategy.setup_environment``)::

    if uses_agent_store():
        generation = join(store, rank, world_size, timeout)
        store = generation.store
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
import uuid
from datetime import timedelta
from functools import partial
from typing import Any

from fabriclite.processes import signals
from fabriclite.processes.failures import Failure, current_progress

AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
AGENT_PID_ENV = "FABRICLITE_AGENT_PID"  # set by `fabriclite run --num-nodes`: the process its ranks die with
NODE_RANK_ENV = "FABRICLITE_NODE_RANK"  # and the node's --node-rank, which names it (torch orders ranks its own way)
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_GENERATION_KEY = "fabriclite/generation"
_POLL_S = 0.05
_POLL_MAX_S = 0.5
FOLLOWER_WAIT_S = 5.0  # how long a rank whose failure followed another's waits for torchrun to stop it
_STORE_TIMEOUT_S = 5.0


def die_with_agent() -> None:
    """Under ``fabriclite run --num-nodes``, end this rank when that process (its parent, which runs torch's agent)
    dies, however it dies: torch starts the ranks without asking for it. Usage: at the rank's start."""
    pid = os.environ.pop(AGENT_PID_ENV, "")  # a process this rank starts is not a rank of the agent's
    if not pid:
        return
    from fabriclite.processes.supervisor import die_with_parent

    die_with_parent()
    if os.getppid() != int(pid):  # it died before this rank asked
        signals.say(f"fabriclite: the `fabriclite run` that started this rank (pid {pid}) has ended; exiting.")
        os._exit(128 + signal.SIGKILL)


def uses_agent_store() -> bool:
    """Whether this process's ``env://`` store is torchelastic's agent store, kept across restarts."""
    return os.environ.get(AGENT_STORE_ENV) == str(True)


def join(store: Any, rank: int, world_size: int, timeout: timedelta) -> Generation:
    """Agree with the other ranks of this group on a generation no earlier group used, through ``store`` (the agent
    store); raise ``TimeoutError`` after ``timeout``. Usage: ``store = join(store, rank, world, timeout).store``."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        name = uuid.uuid4().hex[:16]
        store.set(_GENERATION_KEY, name)
        members = [f"{_prefix(name)}member/{other}" for other in range(1, world_size)]
        _wait_for(lambda: not members or store.check(members), deadline, rank, world_size)
        store.add(f"{_prefix(name)}admitted", 1)
        return Generation(store, name, rank)
    while True:
        _wait_for(lambda: store.check([_GENERATION_KEY]), deadline, rank, world_size)
        name = _text(store.get(_GENERATION_KEY))
        if not _admitted(store, name):  # rank 0 of this generation waits for this rank among others
            store.set(f"{_prefix(name)}member/{rank}", "")
            admitted_or_superseded = partial(_admitted_or_superseded, store, name)
            _wait_for(admitted_or_superseded, deadline, rank, world_size)
            if _admitted(store, name):
                return Generation(store, name, rank)
        else:  # admitted before this rank registered: a dead group's; rank 0 of this one publishes its own
            _wait_for(partial(_superseded, store, name), deadline, rank, world_size)


def _admitted(store: Any, name: str) -> bool:
    return store.add(f"{_prefix(name)}admitted", 0) > 0


def _superseded(store: Any, name: str) -> bool:
    return _text(store.get(_GENERATION_KEY)) != name


def _admitted_or_superseded(store: Any, name: str) -> bool:
    return _admitted(store, name) or _superseded(store, name)


def _wait_for(done: Any, deadline: float, rank: int, world_size: int) -> None:
    pause = _POLL_S
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank} of {world_size}: the other processes of this group did not join through torchrun's "
                "store in time; see the messages above for the ranks that have not joined."
            )
        time.sleep(pause)
        pause = min(pause * 1.5, _POLL_MAX_S)


class Generation:
    """One group's part of the agent store: ``store`` is the store under the generation's ``prefix``."""

    def __init__(self, store: Any, name: str, rank: int) -> None:
        import torch.distributed as dist

        self.name = name
        self.prefix = _prefix(name)
        self.rank = rank
        self.store = dist.PrefixStore(self.prefix, store)

    def watch(self) -> None:
        """Record this rank's failure for the group, the agents and torchrun, and take torchrun's stop after another
        rank's failure as that, not as a preemption notice. Once per process; a later group replaces the earlier."""
        global _watched
        if _watched is None:
            previous = sys.excepthook

            def record_then_report(kind: type, error: BaseException, tb: Any) -> None:
                first = None
                if _watched is not None and not issubclass(kind, KeyboardInterrupt):
                    try:
                        first = _watched.record(kind, error, tb)
                    except Exception:  # the report of a failure must never hide the failure itself
                        pass
                previous(kind, error, tb)
                if first is not None:
                    _watched.wait_to_be_stopped(first)
                    _write_error_file(kind, error, tb)  # not stopped: this failure is torchrun's to report

            sys.excepthook = record_then_report
        _watched = self
        signals.explain_stop(self.stopped_after_failure)

    def record(self, kind: type, error: BaseException, tb: Any) -> Failure | None:
        """Record the exception that ends this rank in the group's store, and in torchelastic's error file unless
        another rank's failure came first. Return that other rank's failure, or None when this rank failed first."""
        mine = Failure(self.rank, 1, f"{kind.__qualname__}: {error}", time.time(), current_progress())
        node = int(os.environ.get(NODE_RANK_ENV, os.environ.get("GROUP_RANK", "0")))
        first = publish(self._client(), mine, node)
        if first is not None:
            return first
        _write_error_file(kind, error, tb)
        return None

    def wait_to_be_stopped(self, first: Failure) -> None:
        """This rank failed after ``first`` did: say so, and give torchrun a moment to stop it (then the agent reports
        the rank that failed first alone); exit with this rank's failure only if it does not."""
        signals.say(
            f"fabriclite: rank {self.rank} failed after {first.describe()}, most likely because of it; waiting up "
            f"to {FOLLOWER_WAIT_S:g} s for torchrun to stop this group."
        )
        time.sleep(FOLLOWER_WAIT_S)

    def stopped_after_failure(self) -> str | None:
        """Why a SIGTERM now is torchrun stopping this group after another rank's failure, or None when it is not
        known to be (then it is a preemption notice)."""
        try:
            first = first_failure(self._client())
        except Exception:  # the store is gone (the agent is ending): a notice, as before
            return None
        return None if first is None or first.rank == self.rank else first.describe()

    def _client(self) -> Any:
        # A connection of its own: the main thread may be blocked in a call on the process group's.
        import torch.distributed as dist

        return dist.PrefixStore(self.prefix, connect(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))


_watched: Generation | None = None  # the group whose failures this process records (its newest)


def connect(address: str, port: int, timeout: float = _STORE_TIMEOUT_S) -> Any:
    """A client connection to the store at ``address:port``. Usage: ``store = connect("10.0.0.1", 29500)``."""
    import torch.distributed as dist

    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout))


# ---------------------------------------------------------------------- failures, in a group's part of the store
def publish(group_store: Any, failure: Failure, node: int) -> Failure | None:
    """Add ``failure`` (on ``node``) to the group's failures; return the group's first recorded one when it is
    another rank's (this one then most likely followed from it), else None."""
    line = json.dumps({**failure._asdict(), "node": node})
    group_store.append("failures", line + "\n")
    first = _text(group_store.compare_set("failed", "", line))
    if not first or first == line:
        return None
    earlier = _failure(json.loads(first))
    return None if earlier.rank == failure.rank else earlier


def first_failure(group_store: Any) -> Failure | None:
    """The group's first recorded failure (a rank's exception), or None."""
    if not group_store.check(["failed"]):
        return None
    return _failure(json.loads(_text(group_store.get("failed"))))


def group_failures(store: Any, stale: str | None = None) -> list[tuple[int, Failure]]:
    """Every failure the ranks of the newest group that met in ``store`` (the agent store, no prefix) recorded, as
    (node, failure), unless that group is ``stale`` (the name ``current_generation`` gave before the group started).

    Usage: ``failures.first([failure for _, failure in group_failures(store)])``."""
    name = current_generation(store)
    if name is None or name == stale:
        return []
    group_store = _group_store(store, name)
    if not group_store.check(["failures"]):
        return []
    lines = _text(group_store.get("failures")).splitlines()
    return [(int(record["node"]), _failure(record)) for record in map(json.loads, filter(None, lines))]


def current_generation(store: Any) -> str | None:
    """The name of the newest group's generation in the agent ``store``, or None before any group met there."""
    return _text(store.get(_GENERATION_KEY)) if store.check([_GENERATION_KEY]) else None


def _group_store(store: Any, name: str) -> Any:
    import torch.distributed as dist

    return dist.PrefixStore(_prefix(name), store)


def _prefix(name: str) -> str:
    return f"fabriclite/{name}/"


def _failure(record: dict[str, Any]) -> Failure:
    return Failure(
        int(record["rank"]), int(record["code"]), record.get("error"), record.get("at"), record.get("progress")
    )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _write_error_file(kind: type, error: BaseException, tb: Any) -> None:
    """torchelastic's error file, as ``@record`` writes it, unless ``@record`` (or torch) already wrote one: torchrun's
    summary shows its traceback, and names the rank with the earliest timestamp the root cause."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or os.path.exists(path):
        return
    stack = "".join(traceback.format_exception(kind, error, tb))
    message = {
        "message": f"{kind.__qualname__}: {error}",
        "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
    }
    with open(path, "w") as f:
        json.dump({"message": message}, f)
