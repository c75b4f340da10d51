"""The supervisors of one run on several machines, kept in step: ``fabriclite run --num-nodes N`` starts one
``Supervisor`` per node, and they agree through a small key-value store (``torch.distributed.TCPStore``) that node
0's supervisor hosts on the main port. The ranks never touch it: their rendezvous is on a fresh port per attempt.

For attempt k (the first is 0), under the store's keys ``k/...``:

- node 0 picks a free port for the ranks' rendezvous and publishes it (``k/port``); every node starts its ranks on it;
- a node whose rank dies stops its ranks, reports which died and how (``k/report/<node>``, numbered in the order
  they came) and raises the stop flag (``k/stop``); every node that sees it stops its ranks too. Then all wait until
  every node has stopped them (``k/stopped`` = N), so the next group finds no rank of the dead one to connect to, and
  all name the same rank, the one that failed first (``failures.first``), and know every rank's failure;
- a node whose ranks all exited 0 counts itself finished (``k/finished``); the run succeeded once every node has.

A preemption notice on one node is published (``preempted``), so every node ends "preempted" too. Every supervisor
adds to its heartbeat (``beat/<node>``) each second from a thread; one silent for ``timeout`` seconds, or a store that
no longer answers (node 0's supervisor died), makes the others stop their ranks and exit. A node that ends the run
on its own (a second signal, a lost node) says so (``abort``), and the others end with its exit code.

Usage: ``Supervisor(command, processes=8, nodes=NodeGroup(2, node_rank, "10.0.0.1", 29500, processes=8)).run()``.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

from fabriclite.plugins.environments import free_port
from fabriclite.processes.failures import Failure, first

NODE_TIMEOUT_S = 60.0  # a node whose supervisor is silent this long is taken for dead
JOIN_TIMEOUT_S = 600.0  # how long the first node waits for the last one to start (a cluster starts them apart)
BEAT_S = 1.0
POLL_S = 0.1
LOST_EXIT_CODE = 1


class NodeGroupError(RuntimeError):
    """The nodes cannot go on together: a node is lost, ended the run, or was started with other settings. ``code``
    is the exit code for ``fabriclite run``."""

    def __init__(self, message: str, code: int = LOST_EXIT_CODE) -> None:
        super().__init__(message)
        self.code = code


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class NodeGroup:
    """This node's part in a run on ``num_nodes`` machines, each running ``processes`` ranks; ``address:port`` is
    where node 0's supervisor hosts the store. Call ``join()`` first and ``leave(code)`` last."""

    def __init__(
        self,
        num_nodes: int,
        node_rank: int,
        address: str,
        port: int,
        processes: int,
        timeout: float = NODE_TIMEOUT_S,
        join_timeout: float = JOIN_TIMEOUT_S,
    ) -> None:
        if not 0 <= node_rank < num_nodes:
            raise ValueError(f"node_rank={node_rank} must be in 0 .. num_nodes-1 = {num_nodes - 1}.")
        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.address = address
        self.port = port
        self.processes = processes
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.store: Any = None
        self.lost: str | None = None  # set by the heartbeat thread
        self.lost_nodes: set[int] = set()
        self._finished: set[int] = set()  # attempts this node counted itself finished in
        self._closing = threading.Event()

    # ------------------------------------------------------------------------------------------ joining, leaving
    def join(self) -> None:
        """Host (node 0) or reach the store, check that every node runs the same settings, and wait for them all."""
        from torch.distributed import TCPStore

        where = f"{self.address}:{self.port}"
        try:
            self.store = TCPStore(
                self.address, self.port, None, self.node_rank == 0, timedelta(seconds=self.join_timeout),
                wait_for_workers=False,
            )  # fmt: skip
        except RuntimeError as error:
            if self.node_rank == 0:
                raise NodeGroupError(
                    f"node 0 cannot host the run's store on port {self.port} ({_first_line(error)}); "
                    "choose a free --main-port, the same on every node"
                ) from None
            raise NodeGroupError(
                f"node {self.node_rank} could not reach node 0's supervisor at {where} within "
                f"{self.join_timeout:g} s ({_first_line(error)}); start `fabriclite run --node-rank 0` there with "
                "the same --main-address and --main-port"
            ) from None
        self.store.set_timeout(timedelta(seconds=self.timeout))
        # Node 0's settings are the run's. A node started with others is refused before it counts as joined, on its
        # own (no "abort" to the others, no "left"): the run goes on waiting for the right node.
        if self.node_rank == 0:
            self._call("set", "settings", f"{self.num_nodes} {self.processes}")
        else:
            theirs, ours = self._call("get", "settings").decode(), f"{self.num_nodes} {self.processes}"
            if theirs != ours:
                nodes, processes = theirs.split()
                self._refuse(
                    f"node 0 runs --num-nodes {nodes} with {processes} device(s) per node, this node --num-nodes "
                    f"{self.num_nodes} with {self.processes}; give every node the same --num-nodes and number of "
                    "--devices"
                )
        if self._call("add", f"node/{self.node_rank}", 1) > 1:  # the first to claim a node rank holds it
            self._refuse(f"another node already joined this run as --node-rank {self.node_rank}", code=2)
        self._call("add", f"beat/{self.node_rank}", 1)
        self._call("add", "joined", 1)
        self._wait(
            lambda: self._call("add", "joined", 0) == self.num_nodes,
            self.join_timeout,
            lambda: (
                f"only {self._call('add', 'joined', 0)} of {self.num_nodes} nodes joined within "
                f"{self.join_timeout:g} s; start `fabriclite run` on every node, each with its --node-rank"
            ),
        )
        threading.Thread(target=self._beat, name="fabriclite-heartbeat", daemon=True).start()

    def _refuse(self, message: str, code: int = LOST_EXIT_CODE) -> None:
        """Leave the run's store untouched from here on (``leave`` has nothing to tell) and raise ``message``."""
        self._closing.set()
        self.store = None
        raise NodeGroupError(f"this node is refused: {message}", code=code)

    def leave(self, code: int, reason: str | None = None) -> None:
        """Say goodbye: with a ``reason``, this node ends the run on its own and the others end with ``code`` too.
        Node 0 waits (a while) for the others to leave before its store goes away."""
        self._closing.set()
        if self.store is None:
            return
        try:
            if reason is not None:  # the first node to end the run alone is the one the others name
                self.store.compare_set("abort", "", f"{code} {self.node_rank} {reason}")
            if self.node_rank != 0:
                self.store.add("left", 1)
                return
            expected = self.num_nodes - 1 - len(self.lost_nodes)
            deadline = time.monotonic() + self.timeout
            while self.store.add("left", 0) < expected and time.monotonic() < deadline:
                time.sleep(POLL_S)
        except RuntimeError:
            pass  # the others are gone already, or the store is: nothing left to tell
        finally:
            self.store = None

    # ------------------------------------------------------------------------------------------ one attempt
    def rendezvous_port(self, attempt: int) -> int:
        """The port of attempt ``attempt``'s rendezvous: node 0 picks a free one, the others wait for it."""
        if self.node_rank == 0:
            self._call("set", f"{attempt}/port", str(free_port("")))
        key = f"{attempt}/port"
        self._wait(lambda: self._call("check", [key]), self.timeout, lambda: f"node 0 did not start attempt {attempt}")
        return int(self._call("get", key))

    def check(self) -> None:
        """Raise ``NodeGroupError`` when a node is lost or ended the run on its own; else return."""
        if self.lost:
            raise NodeGroupError(self.lost)
        if self._call("check", ["abort"]):
            code, node, reason = self._call("get", "abort").decode().split(" ", 2)
            self.lost = f"node {node} ended the run with exit code {code} ({reason})"
            raise NodeGroupError(self.lost, code=int(code))

    def publish_preemption(self, signum: int) -> None:
        self._call("compare_set", "preempted", "", str(signum))

    def preempted(self) -> int:
        """The signal number of the preemption notice some node got, or 0 while none has."""
        return int(self._call("get", "preempted")) if self._call("check", ["preempted"]) else 0

    def finish(self, attempt: int) -> bool:
        """Count this node finished in ``attempt`` (every rank exited well); True once every node is."""
        if attempt not in self._finished:
            self._finished.add(attempt)
            self._call("add", f"{attempt}/finished", 1)
        return self._call("add", f"{attempt}/finished", 0) == self.num_nodes

    def stop_requested(self, attempt: int) -> bool:
        return bool(self._call("check", [f"{attempt}/stop"]))

    def stop(self, attempt: int, failures: list[Failure]) -> tuple[int, Failure, list[Failure]]:
        """This node stopped its ranks in ``attempt``, ``failures`` (by global rank) among them: tell the others, wait
        until every node has stopped its ranks, and return the failure every node names, as (node, failure), and the
        failures of every node."""
        if failures:
            order = self._call("add", f"{attempt}/reports", 1)
            listed = json.dumps([list(failure) for failure in failures])
            self._call("set", f"{attempt}/report/{self.node_rank}", f"{order} {listed}")
            self._call("set", f"{attempt}/stop", "1")
        self._call("add", f"{attempt}/stopped", 1)
        self._wait(
            lambda: self._call("add", f"{attempt}/stopped", 0) == self.num_nodes,
            None,
            lambda: "unreachable: a node that does not stop is lost",
        )
        reports = []
        for node in range(self.num_nodes):
            key = f"{attempt}/report/{node}"
            if self._call("check", [key]):
                order, listed = self._call("get", key).decode().split(" ", 1)
                reports.extend((int(order), node, Failure(*failure)) for failure in json.loads(listed))
        if not reports:
            raise NodeGroupError(f"the nodes stopped attempt {attempt}, but none said which rank failed")
        reports.sort(key=lambda report: report[:2])  # in the order the nodes reported
        named = first([failure for _, _, failure in reports])
        node = next(node for _, node, failure in reports if failure == named)
        return node, named, [failure for _, _, failure in reports]

    # ------------------------------------------------------------------------------------------ plumbing
    def _call(self, method: str, *args: Any) -> Any:
        """One store operation; a store that no longer answers means node 0's supervisor is gone."""
        try:
            return getattr(self.store, method)(*args)
        except RuntimeError as error:
            self.lost = (
                f"lost the connection to node 0's supervisor at {self.address}:{self.port} ({_first_line(error)})"
            )
            raise NodeGroupError(self.lost) from None

    def _wait(self, done: Any, timeout: float | None, what: Any) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done():
            self.check()  # a lost node, or one that ended the run, never arrives
            if deadline is not None and time.monotonic() > deadline:
                raise NodeGroupError(what())
            time.sleep(POLL_S)

    def _beat(self) -> None:
        """Add to this node's heartbeat every second, and watch the others' (on a connection of its own)."""
        from torch.distributed import TCPStore

        others = [node for node in range(self.num_nodes) if node != self.node_rank]
        seen = {node: (-1, time.monotonic()) for node in others}
        try:
            store = TCPStore(self.address, self.port, None, False, timedelta(seconds=self.timeout))
            while not self._closing.wait(BEAT_S):
                store.add(f"beat/{self.node_rank}", 1)
                beats = store.multi_get([f"beat/{node}" for node in others]) if others else []
                now = time.monotonic()
                for node, beat in zip(others, beats):
                    if beat != seen[node][0]:
                        seen[node] = (beat, now)
                    elif now - seen[node][1] > self.timeout:
                        self.lost_nodes.add(node)
                        self.lost = (
                            f"node {node}'s supervisor stopped answering (no heartbeat for {self.timeout:g} s): "
                            "it died or its machine is unreachable"
                        )
                        return
        except RuntimeError as error:
            if not self._closing.is_set():
                self.lost = (
                    f"lost the connection to node 0's supervisor at {self.address}:{self.port} ({_first_line(error)})"
                )
