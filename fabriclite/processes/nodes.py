"""A run on several machines: ``fabriclite run --num-nodes N`` runs, on every node, torch's elastic agent (torchrun's
``LocalElasticAgent``) with the c10d rendezvous that node 0 hosts at ``--main-address:--main-port``. torch starts
the ranks, watches them, and restarts the ranks of every node when one fails (``--max-restarts``, counted by each
node whose ranks failed), as under ``torchrun --rdzv-backend c10d``. On top, what torch's agent does not do:

- **A check before anything starts** (``check_nodes``): every node runs the same ``--num-nodes`` and ``--devices``,
  no node rank joins twice, and a node that cannot reach node 0 says where it looked.
- **Preemption notices** (SIGTERM, SIGUSR1): passed to every rank of this node, which save (``fabric.preempted`` is
  agreed on every node) and exit 75. That exit is no failure here: no restart, and every node exits 75 (node 0
  requeues the SLURM job where allowed). torch's agent would give the ranks 30 s after a SIGTERM, and SIGUSR1 would
  kill it. The agent runs on a thread of its own, so torch installs no signal handlers: this process's main thread
  takes every signal. A notice come twice within ``SAME_NOTICE_S`` counts once; a second one is passed on too (the
  ranks leave once their saves end); a third, a second SIGINT, or ``deadline`` seconds without the ranks ending kill
  them. After a SIGINT nothing is restarted.
- **The failure named on every node**: each rank records the exception that ends it in its group's store, and the
  agent of a node whose rank a signal killed records that (``torchelastic.publish``); every node says which rank
  failed first, and how, at the restart or at the end. A failure that repeats an earlier attempt's from the same
  checkpoint is not restarted (``failures.repeats``), as on one machine.
- **Ranks that die with their node's ``fabriclite run``**, however it dies: each rank asks for it itself
  (``torchelastic.die_with_agent``), since torch starts them.

Usage: ``NodeRun(command, processes=8, num_nodes=2, node_rank=0, address="10.0.0.1", port=29500).run()`` returns
the exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from fabriclite.processes import torchelastic
from fabriclite.processes.failures import Failure, first, repeats
from fabriclite.processes.signals import GRACE_S, NOTICES, PREEMPTED_EXIT_CODE, SAME_NOTICE_S, requeue

JOIN_TIMEOUT_S = 600.0  # how long the nodes wait for each other to (re)join: a cluster starts them apart
LEAVE_WAIT_S = 30.0  # how long node 0 keeps the rendezvous store up for the other nodes to end
SIGNAL_RECORD_WAIT_S = 1.0  # after a failure, how long to wait for another node's record of a rank a signal killed
_ENDED = (0, PREEMPTED_EXIT_CODE)  # how a rank ends well: a rank that saved after a preemption notice exits 75


def say(message: str) -> None:
    print(f"fabriclite: {message}", file=sys.stderr, flush=True)


class NodeGroupError(RuntimeError):
    """This node cannot join the run: node 0 unreachable, other settings, its node rank taken. ``code`` is the exit
    code for ``fabriclite run``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def check_nodes(num_nodes: int, node_rank: int, processes: int, address: str, port: int, timeout: float) -> None:
    """Meet the other nodes in node 0's rendezvous store and check that every node runs the same settings and no
    node rank twice; raise ``NodeGroupError`` saying what to change. Node 0's settings are the run's: a node started
    with others is refused alone, and the run goes on waiting for the right one.

    Usage: ``check_nodes(2, 1, 8, "10.0.0.1", 29500, timeout=600)`` on node 1.
    """
    try:
        store = torchelastic.connect(address, port, timeout)
    except (RuntimeError, ValueError) as error:
        raise NodeGroupError(
            f"node {node_rank} could not reach node 0's `fabriclite run` at {address}:{port} within {timeout:g} s "
            f"({_first_line(error)}); start `fabriclite run --node-rank 0` there with the same --main-address and "
            "--main-port"
        ) from None
    ours = f"{num_nodes} {processes}"
    if node_rank == 0:
        store.set("fabriclite/settings", ours)
    else:
        store.wait(["fabriclite/settings"], timedelta(seconds=timeout))
        theirs = store.get("fabriclite/settings").decode()
        if theirs != ours:
            nodes, devices = theirs.split()
            raise NodeGroupError(
                f"node 0 runs --num-nodes {nodes} with {devices} device(s) per node, this node --num-nodes "
                f"{num_nodes} with {processes}; give every node the same --num-nodes and number of --devices"
            )
    if store.add(f"fabriclite/node/{node_rank}", 1) > 1:  # the first to claim a node rank holds it
        raise NodeGroupError(f"another node already joined this run as --node-rank {node_rank}", code=2)


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _code(returncode: int) -> int:
    # A rank killed by signal N (returncode -N) makes this process exit the way shells report it: 128 + N.
    return returncode if returncode > 0 else 128 - returncode


class NodeRun:
    """This node's part of a run on ``num_nodes`` machines, each running ``command`` as ``processes`` ranks; node 0
    hosts the rendezvous at ``address:port``. ``join_timeout``: how long the nodes wait for each other to (re)join
    (a lost node ends the run after it); ``deadline``: how long the ranks have to save after a preemption notice."""

    def __init__(
        self,
        command: list[str],
        processes: int,
        num_nodes: int,
        node_rank: int,
        address: str,
        port: int,
        max_restarts: int = 0,
        join_timeout: float = JOIN_TIMEOUT_S,
        deadline: float = GRACE_S,
    ) -> None:
        if not 0 <= node_rank < num_nodes:
            raise ValueError(f"node_rank={node_rank} must be in 0 .. num_nodes-1 = {num_nodes - 1}.")
        self.command = command
        self.processes = processes
        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.address = address
        self.port = port
        self.max_restarts = max_restarts
        self.join_timeout = join_timeout
        self.deadline = deadline
        self.signals: list[int] = []  # received, in order; one within SAME_NOTICE_S of the first is the same one
        self._first_signal_at = 0.0
        self.agent: Any = None
        self.stopped_because = ""  # why this node killed its ranks on its own

    @property
    def notice(self) -> int:
        """The first signal this node received (a preemption notice or SIGINT), or 0."""
        return self.signals[0] if self.signals else 0

    def run(self) -> int:
        """Run this node's ranks until the run ends; return the exit code: 0, ``PREEMPTED_EXIT_CODE`` after a
        preemption, or the failed rank's (128 + N for signal N) once the restarts are used up."""
        logs = tempfile.mkdtemp(prefix="fabriclite-agent-")  # torch's per-rank error files; they hold exceptions
        previous = {signum: signal.signal(signum, self._on_signal) for signum in (signal.SIGINT, *NOTICES)}
        try:
            try:
                # Node 0 hosts the rendezvous store first; the others wait for it there, then check the settings.
                handler = self._rendezvous() if self.node_rank == 0 else None
                check_nodes(self.num_nodes, self.node_rank, self.processes, self.address, self.port, self.join_timeout)
                handler = handler or self._rendezvous()
            except NodeGroupError as error:
                say(f"this node is refused: {error}.")
                return error.code
            self.agent = _agent(self, handler, logs)
            outcome = self._run_agent()
            code = self._exit_code(outcome)
            # After a rendezvous that timed out, the nodes it missed are gone or never came: none to wait for. After
            # node 0's store was lost, no one is left to tell (connecting to it would only time out, twice 5 s).
            lost = self.agent.lost or type(outcome).__name__ == "RendezvousConnectionError"
            if type(outcome).__name__ != "RendezvousTimeoutError" and not lost:
                self._leave()
            return code
        finally:
            for signum, before in previous.items():
                signal.signal(signum, before)
            shutil.rmtree(logs, ignore_errors=True)

    def _leave(self) -> None:
        """Say this node is done; node 0, whose process hosts the rendezvous store, waits (up to ``LEAVE_WAIT_S``)
        for the others to be done too, so that they can still read there why the run ended."""
        try:
            store = torchelastic.connect(self.address, self.port)
            store.add("fabriclite/left", 1)
            deadline = time.monotonic() + LEAVE_WAIT_S
            while self.node_rank == 0 and store.add("fabriclite/left", 0) < self.num_nodes:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception:  # node 0's store is gone already: nothing to wait for
            pass

    def _rendezvous(self) -> Any:
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

        parameters = RendezvousParameters(
            backend="c10d",
            endpoint=f"{self.address}:{self.port}",
            run_id="fabriclite",
            min_nodes=self.num_nodes,
            max_nodes=self.num_nodes,
            is_host=self.node_rank == 0,
            join_timeout=str(int(self.join_timeout)),
        )
        return registry.get_rendezvous_handler(parameters)

    def _run_agent(self) -> Any:
        """Run the agent on a thread of its own (so torch takes no signal handlers), watching the deadline after a
        notice here; return its result, or the exception that ended it (the rendezvous closed by a node that ended
        the run, a node lost)."""
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(self.agent.run())
            except Exception as error:
                outcome.append(error)
            finally:  # as torchrun does: the other nodes' agents learn that this one is done
                self.agent.get_worker_group().spec.rdzv_handler.shutdown()

        thread = threading.Thread(target=run, name="fabriclite-agent", daemon=True)
        thread.start()
        stop_by = None
        while thread.is_alive():
            thread.join(0.1)
            if self.notice and stop_by is None:
                stop_by = time.monotonic() + self.deadline
            if stop_by is not None and time.monotonic() > stop_by and self.agent.stopping is None:
                say(f"the ranks did not exit within {self.deadline:g} s of the preemption notice; killing them.")
                self._kill(128 + self.notice, f"node {self.node_rank}'s ranks missed the preemption deadline")
        return outcome[0]

    def _exit_code(self, outcome: Any) -> int:
        from torch.distributed.elastic.agent.server.api import WorkerState

        agent = self.agent
        if agent.stopping is not None:
            return agent.stopping
        if isinstance(outcome, BaseException):
            named = agent.named
            after = f" after {named[1].describe(named[0])}" if named else ""
            if type(outcome).__name__ == "RendezvousTimeoutError":
                say(
                    f"the nodes did not all join within {self.join_timeout:g} s (--node-timeout){after}: a node was "
                    "not started, or was lost; start `fabriclite run` on every node, each with its --node-rank."
                )
            else:
                say(f"the run ended on another node{after} ({type(outcome).__name__}: {_first_line(outcome)}).")
            return _code(named[1].code) if named else 1
        if self.notice == signal.SIGINT:
            return 128 + signal.SIGINT
        if outcome.state == WorkerState.SUCCEEDED:
            if not agent.preempted:
                return 0
            # One requeue for the whole job: node 0's.
            if self.node_rank != 0 or not requeue(say=lambda line: print(line, file=sys.stderr, flush=True)):
                say(
                    f"preempted; every rank exited after saving. Exit code {PREEMPTED_EXIT_CODE}: run it again to resume."
                )
            return PREEMPTED_EXIT_CODE
        named = agent.named
        if named is None and outcome.failures:
            named = (self.node_rank, first([Failure(rank, end.exitcode) for rank, end in outcome.failures.items()]))
        if named is None:  # another node ended the run, and recorded nothing that says why
            say(f"the run ended on another node ({agent.lost or 'it closed the rendezvous'}); stopping every rank.")
            return 1
        left = f" (no restarts left of --max-restarts {self.max_restarts})" if self.max_restarts else ""
        lost = f" ({agent.lost})" if agent.lost else ""
        say(f"{named[1].describe(named[0])}; stopping every rank{left}{lost}.")
        return _code(named[1].code)

    # ------------------------------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        again = len(self.signals) == 1 and {signum, self.signals[0]} <= set(NOTICES)
        if again and now - self._first_signal_at < SAME_NOTICE_S:
            return  # one notice come twice (SLURM signals every process of a job step)
        self.signals.append(signum)
        self._first_signal_at = self._first_signal_at or now
        if self.agent is None:  # not started yet: the ranks start no more
            raise SystemExit(128 + signum)
        name = signal.Signals(signum).name
        if len(self.signals) > 2 or (len(self.signals) > 1 and signal.SIGINT in self.signals):
            say(f"{name} received {'again' if len(self.signals) == 2 else 'a third time'}; killing every rank.")
            self._kill(128 + signum, f"node {self.node_rank} received {name} {len(self.signals)} times")
            return
        if len(self.signals) == 2:
            say(f"{name} received again; the ranks exit once their saves under way have ended.")
        self.agent.pass_on(signum)

    def _kill(self, code: int, because: str) -> None:
        self.stopped_because = because
        self.agent.stopping = code
        self.agent.pass_on(signal.SIGKILL)


def _agent(node: NodeRun, handler: Any, logs: str) -> Any:
    """torch's agent for ``node``, with fabriclite's additions (see the module's text). Its ranks' environment says
    who started them (``FABRICLITE_LAUNCHER``) and which process to die with (``torchelastic.AGENT_PID_ENV``)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class Agent(LocalElasticAgent):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.stopping: int | None = None  # this node killed its ranks on its own: the exit code
            self.preempted = False  # every rank ended well after a preemption (exit 0 or 75)
            self.named: tuple[int, Failure] | None = None  # the failure that stopped the last attempt, on which node
            self.counted = False  # torch counts this attempt's failure as a restart of this node's
            self.previous: list[Failure] = []  # earlier attempts' failures: is the next one the same again?
            self.stale: str | None = None  # the newest group's generation when this node's ranks started
            self.finished = False  # this node's ranks of this attempt all ended well, and it said so
            self.said_why = False  # this node killed its ranks, and recorded that for the others
            self.next_look = 0.0  # when to look again whether another node ended the run
            self.lost: str | None = None  # why the rendezvous cannot go on, when it is lost

        def pass_on(self, signum: int) -> None:
            for worker in self.get_worker_group().workers:
                if worker.id:
                    try:
                        os.kill(worker.id, signum)
                    except (ProcessLookupError, PermissionError):
                        pass

        def _start_workers(self, worker_group: Any) -> Any:
            self.finished = False
            try:  # read before the ranks start: a group they form after this is new
                self.stale = torchelastic.current_generation(_store(worker_group))
            except Exception:
                self.stale = None
            return super()._start_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            codes = self._exit_codes()  # before torch, finding a failure, stops the others
            if self.stopping is not None or node.notice == signal.SIGINT:
                self._remaining_restarts = 0  # stopped on purpose: nothing to restart
                self._say_why_stopped(worker_group)
            elif node.notice or PREEMPTED_EXIT_CODE in codes:
                # A preempted rank exits 75 after saving: wait for the others (torch would stop them at once and
                # count a failure), and end well once all ended well. One that the notice itself ended (it came
                # before the rank's Fabric took notices) had nothing to save.
                if None in codes:
                    return self._unless_ended_elsewhere(worker_group)
                if all(code in _ENDED or (node.notice and -code in NOTICES) for code in codes):
                    self.preempted = True
                    return self._finished(worker_group)
            elif codes and all(code == 0 for code in codes):
                return self._finished(worker_group)
            elif codes and all(code is None for code in codes):
                return self._unless_ended_elsewhere(worker_group)
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED and self.stopping is None:
                self._after_failure(worker_group, result, codes)
            return result

        def _finished(self, worker_group: Any) -> Any:
            """This node's ranks all ended well. Said in this round of the rendezvous; until every node's have,
            they may still be needed: when a rank fails on another node, torch restarts this node's too (its own
            agent would wait at its exit barrier instead, and the failed node would wait for it to rejoin)."""
            if not self.finished:
                self.finished = True
                worker_group.store.add("fabriclite/finished", 1)
            if worker_group.store.add("fabriclite/finished", 0) < node.num_nodes:
                return self._unless_ended_elsewhere(worker_group)
            values = {worker.global_rank: None for worker in worker_group.workers}
            return RunResult(state=WorkerState.SUCCEEDED, return_values=values)

        def _unless_ended_elsewhere(self, worker_group: Any) -> Any:
            """Healthy, unless another node ended the run (it closed the rendezvous, or node 0's is gone): then
            failed, with no restart, naming why (torch stops this node's ranks). Looked at once a second."""
            if time.monotonic() < self.next_look:
                return RunResult(state=WorkerState.HEALTHY)
            self.next_look = time.monotonic() + 1.0
            try:
                if not worker_group.spec.rdzv_handler.is_closed():
                    return RunResult(state=WorkerState.HEALTHY)
            except Exception as error:  # node 0's rendezvous store is gone: no restart can meet there
                self.lost = f"lost the rendezvous at {node.address}:{node.port} ({_first_line(error)})"
            self._name(worker_group)
            self._remaining_restarts = 0
            return RunResult(state=WorkerState.FAILED)

        def _say_why_stopped(self, worker_group: Any) -> None:
            # This node killed its ranks: the other nodes name that, not their own ranks' broken collectives.
            if self.stopping is not None and not self.said_why:
                self.said_why = True
                for worker in worker_group.workers:
                    killed = Failure(worker.global_rank, -signal.SIGKILL, node.stopped_because, time.time())
                    _record(worker_group, killed, node.node_rank)

        def _restart_workers(self, worker_group: Any) -> None:
            if not self.counted:  # another node's rank failed: it rejoined the rendezvous, and torch restarts us too
                self.named = None
                self._name(worker_group)
            who = self.named[1].describe(self.named[0]) if self.named else "a rank on another node failed"
            spec = worker_group.spec
            count = spec.max_restarts - self._remaining_restarts
            which = f" (restart {count} of {spec.max_restarts})" if self.counted else ""
            say(f"{who}; stopping every rank on every node and starting them again{which}.")
            self.counted = False
            super()._restart_workers(worker_group)

        def _exit_codes(self) -> list[int | None]:
            # The processes belong to torch's process context; polling them does not take their exit from it.
            context = self._pcontext
            return [handler.proc.poll() for handler in context.subprocess_handlers.values()] if context else []

        def _after_failure(self, worker_group: Any, result: Any, codes: list[int | None]) -> None:
            """Record this node's failed ranks for the other nodes (exit codes, signals: what a rank cannot say
            itself), name the failure, and stop restarting when it repeats an earlier attempt's. Failed: those that
            had ended badly before torch stopped the others (newer torch lists those it stopped too)."""
            failed = {
                worker.global_rank: code
                for worker, code in zip(worker_group.workers, codes)
                if code not in (None, *_ENDED)
            } or {rank: failure.exitcode for rank, failure in result.failures.items()}
            for rank, code in failed.items():
                _record(worker_group, Failure(rank, code, at=time.time()), node.node_rank)
            self._name(worker_group)
            self.counted = True
            named = self.named[1] if self.named else None
            if named is not None and self._remaining_restarts > 0 and repeats(named, self.previous):
                newest = f"its newest is still save number {named.progress}" if named.progress else "it has none yet"
                say(
                    f"{named.describe(self.named[0])} again: the same failure as in an earlier attempt, with no "
                    f"checkpoint of the run saved in between ({newest}). Restarting would only repeat it, so every "
                    f"rank is stopped ({self._remaining_restarts} of --max-restarts {node.max_restarts} left unused)."
                )
                self._remaining_restarts = 0
            if named is not None:
                self.previous.append(named)

        def _name(self, worker_group: Any) -> None:
            """Name the failure that stopped this attempt, from every node's records: how each failed rank ended
            (its agent's record, in this round of the rendezvous), with the exception it recorded, if any. A rank
            killed by a signal counts first, so when the only failures so far are exceptions (most likely caused by
            it), another node's agent gets a moment to record one."""
            deadline = time.monotonic() + SIGNAL_RECORD_WAIT_S
            while True:
                seen = _round_failures(worker_group)
                if any(failure.code < 0 for _, failure in seen) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            try:
                recorded = torchelastic.group_failures(_store(worker_group), self.stale)
                raised = {failure.rank: failure for _, failure in recorded}
            except Exception:  # the ranks' store is gone: how they ended is known all the same
                raised = {}
            failures = [(where, _with_exception(failure, raised.get(failure.rank))) for where, failure in seen]
            if failures:
                named = first([failure for _, failure in failures])
                self.named = next(item for item in failures if item[1] == named)

    os.environ[torchelastic.AGENT_PID_ENV] = str(os.getpid())
    os.environ[torchelastic.NODE_RANK_ENV] = str(node.node_rank)
    os.environ["FABRICLITE_LAUNCHER"] = "fabriclite run"
    spec = WorkerSpec(
        role="default",
        local_world_size=node.processes,
        rdzv_handler=handler,
        entrypoint=node.command[0],
        args=tuple(node.command[1:]),
        max_restarts=node.max_restarts,
        monitor_interval=0.1,
    )
    return Agent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=logs), start_method="spawn")


def _with_exception(seen: Failure, raised: Failure | None) -> Failure:
    """How a rank ended (its agent's record), with the exception it recorded when it exited with an error."""
    if raised is None or seen.code < 0:
        return seen
    return seen._replace(error=raised.error, at=raised.at, progress=raised.progress)


def _record(worker_group: Any, failure: Failure, node: int) -> None:
    """Record how a rank of ``node`` ended badly, for every node, in this round of the rendezvous."""
    try:
        worker_group.store.append("fabriclite/failures", json.dumps({**failure._asdict(), "node": node}) + "\n")
    except Exception:  # the rendezvous store is gone: each node names what it saw itself
        pass


def _round_failures(worker_group: Any) -> list[tuple[int, Failure]]:
    """The failed ranks every node's agent recorded in this round of the rendezvous, as (node, failure)."""
    try:
        if not worker_group.store.check(["fabriclite/failures"]):
            return []
        lines = worker_group.store.get("fabriclite/failures").decode().splitlines()
    except Exception:
        return []
    records = [json.loads(line) for line in lines if line]
    return [(record.pop("node"), Failure(**record)) for record in records]


def _store(worker_group: Any) -> Any:
    """The store the ranks of ``worker_group`` meet in (torch's agent store)."""
    return torchelastic.connect(worker_group.master_addr, int(worker_group.master_port))
