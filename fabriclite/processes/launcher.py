"""Starting the processes of a multi-process run. Every launcher has one method, ``launch(function, *args,
**kwargs)``: it makes sure the processes exist, runs ``function`` in each one this launcher is responsible for, and
returns what this process's (or rank 0's) call returned.

- ``InProcessLauncher``: the processes exist already (one process, or started by torchrun, SLURM, ``fabriclite
  run`` or one of the launchers below): run ``function`` here.
- ``SubprocessLauncher``: re-runs the script once per extra process (the way Lightning does), with the rank in the
  environment; the original process becomes rank 0. With ``FABRICLITE_MAX_RESTARTS=N`` in the environment it runs
  every rank as a child instead and restarts them all when one dies (``supervisor``). A watchdog thread in rank 0 ends every sibling as soon as one
  exits with an error, and each child dies with rank 0, so a failure never leaves processes hanging.
- ``MultiprocessingLauncher`` ("ddp_spawn", "ddp_fork", "ddp_notebook"): runs ``function`` in new processes and
  returns rank 0's result. Spawned processes get ``function`` and its arguments pickled, and unpickle them once
  their rank is in the environment; forked ones (notebooks) get copies of this process's objects.

Signals: SIGINT, SIGTERM or SIGUSR1 to the process the user started reaches every rank (``signals.forward_to``), and
each rank takes it by ``fabriclite.processes.signals``'s policy: an interrupt ends even a rank blocked in a collective within
seconds, a preemption notice lets every rank save first. After an interrupt, a rank that ended by it (130) is no
failure of the others: each rank runs its own ``except KeyboardInterrupt:`` to its end; a second Ctrl-C kills.
"""

from __future__ import annotations

import atexit
import inspect
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from fabriclite.processes import signals
from fabriclite.processes.failures import FAILURE_FILE_ENV, Failure, exit_now, how_it_ended, records_folder
from fabriclite.processes.failures import read as read_failure
from fabriclite.plugins.environments import free_port
from fabriclite.processes.supervisor import (  # what every way of starting processes shares
    _ENDED,
    LAUNCHER_ENV,
    SIBLING_EXIT_GRACE_S,
    Supervisor,
    die_with_parent,
    _exit_code,
    _rank_env,
    max_restarts,
)


def do_nothing(fabric: Any) -> None:
    """What ``fabric.launch()`` runs when given no function (defined here, so it pickles for spawned processes)."""


def check_launch_function(function: Any, launcher: Any) -> None:
    """Refuse, before any process starts, what ``fabric.launch(function)`` could not run in them: no function where
    the launcher needs one, something not callable (often ``launch(train(fabric))``, which ran ``train`` here
    and passed its result), or a function that cannot take the Fabric. Errors have Lightning's types and phrases."""
    if function is do_nothing:
        if launcher.needs_function:
            raise TypeError(
                f"This strategy starts new processes by {launcher.start_method}: `.launch()` needs to be called with a "
                "function that contains the code to run in them, taking the Fabric first: fabric.launch(train)."
            )
        return
    if not callable(function):
        raise TypeError(
            f"`Fabric.launch(...)` needs to be a callable, but got {function!r} ({type(function).__name__}). HINT: do "
            "`.launch(train)` instead of `.launch(train(fabric))`: the launcher calls it with the Fabric first."
        )
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature: let the call decide
        return
    if not parameters:
        name = getattr(function, "__qualname__", repr(function))
        raise TypeError(
            f"`Fabric.launch(function={name})` needs to take at least one argument: the launcher passes the Fabric "
            f"first. Write def {getattr(function, '__name__', 'train')}(fabric, ...)."
        )


class InProcessLauncher:
    """The processes exist already: ``launch`` runs the function in this process. Usage: ``InProcessLauncher().launch(f)``."""

    starts_processes = False
    needs_function = False

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)


def stop_on_interrupt(children: list[subprocess.Popen]) -> None:
    """Take signals by fabriclite's policy in this process (``signals.install``) and pass each one on to ``children``
    (the ranks this process started). Usage: ``stop_on_interrupt(launcher.children)`` in each rank once it runs."""
    signals.install()
    signals.forward_to(children)


def _script_command() -> list[str]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name not in ("__main__", None):
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return [sys.executable, "-m", module, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or script == "-c" or not os.path.exists(script):
        raise RuntimeError(
            "fabric.launch() starts the other processes by running this script again, but this process was not "
            "started from a script file (an interactive session or `python -c`). Run a script, or use "
            "strategy='ddp_spawn' (or 'ddp_notebook' in a notebook) with fabric.launch(function)."
        )
    return [sys.executable, os.path.abspath(script), *sys.argv[1:]]


class SubprocessLauncher:
    """Re-runs the script for local ranks 1..N-1; this process is local rank 0. Usage: via ``fabric.launch()``."""

    starts_processes = True
    needs_function = False

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self.children: list[subprocess.Popen] = []
        self._started = False
        self._killing = False  # set once this process stops the children itself: their deaths are then expected
        self._failing = False  # set once the main thread handles its own error: it stops the children, then says why
        # The watching thread and an error on the main thread may both see a child die: one of them reports it.
        self._deciding = threading.Lock()
        self._reported: set[int] = set()
        self._records = ""  # where each child writes the exception that ends it (``failures.record``)

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start the other processes, put this one's rank in its environment, then run ``function`` here."""
        if self._started:
            raise RuntimeError(
                "fabric.launch() was already called; it starts the processes, so call it once per Fabric."
            )
        self._started = True
        if self.processes > 1 and max_restarts():
            # This process only watches: every rank is its child, so the whole group can be started again.
            sys.exit(Supervisor(_script_command(), self.processes, max_restarts()).run())
        self._start()
        return function(*args, **kwargs)

    def _start(self) -> None:
        command = _script_command() if self.processes > 1 else []  # one process runs the script it is in
        port = free_port()
        self._records = records_folder()  # deleted at exit after _wait_for_children, which is registered later
        for rank in range(1, self.processes):
            env = {
                **os.environ,
                **_rank_env(rank, rank, self.processes, 0, "127.0.0.1", port),
                LAUNCHER_ENV: "subprocess",
                FAILURE_FILE_ENV: os.path.join(self._records, f"{rank}.json"),
            }
            self.children.append(subprocess.Popen(command, env=env, preexec_fn=die_with_parent))
        os.environ.update(_rank_env(0, 0, self.processes, 0, "127.0.0.1", port))
        os.environ[LAUNCHER_ENV] = "subprocess"
        threading.Thread(target=self._watch, name="fabriclite-watchdog", daemon=True).start()
        atexit.register(self._wait_for_children)
        previous_hook = sys.excepthook

        def kill_children_then_report(*exc_info: Any) -> None:
            failed_at = time.time()
            with self._deciding:
                self._failing = True
            if issubclass(exc_info[0], KeyboardInterrupt):  # every rank took the Ctrl-C: each ends by its own policy
                _wait_or_kill(self.children)
            else:
                self._wait_for_a_child_to_fail(SIBLING_EXIT_GRACE_S)
            self.kill_children(failed_before=failed_at)
            previous_hook(*exc_info)

        sys.excepthook = kill_children_then_report

    def _watch(self) -> None:
        while True:
            for child in self.children:
                code = child.poll()
                if code is not None and not _ended_well(code):
                    with self._deciding:
                        if self._killing:
                            return  # this process is already stopping them (after its own error)
                        self._report(child, code, "stopping the other processes")
                        if self._failing:
                            return  # the main thread's error handler stops the others and shows its own error
                    self.kill_children()
                    exit_now(_exit_code(code))
            if all(child.poll() is not None and _ended_well(child.poll()) for child in self.children):
                return
            time.sleep(0.2)

    def _wait_for_a_child_to_fail(self, within: float) -> None:
        # A child that dies closes its sockets before the OS lets its parent see it exit, so this process's collective
        # can fail first. Waiting that moment lets the report name the rank that died (SIGKILL by the OOM killer,
        # say) instead of only the collective's "connection closed by peer". Costs `within` when no child fails.
        # A child whose exception is recorded failed too, even while it is still exiting.
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if any(child.poll() not in (None, *_ENDED) or self._failure(child).error for child in self.children):
                return
            time.sleep(0.02)

    def kill_children(self, failed_before: float | None = None) -> None:
        """Stop every child, first naming those that failed on their own: exited with an error, or (when this
        process fails at ``failed_before``) recorded an exception before that, and are still exiting."""
        with self._deciding:
            if not self._killing:
                for child in self.children:
                    code, failure = _returncode(child), self._failure(child)
                    if code is not None and not _ended_well(code):
                        self._report(child, code, "stopping the other processes")
                    elif failure.error and failed_before is not None and (failure.at or 0.0) < failed_before:
                        self._report(child, None, "stopping the other processes")
            self._killing = True
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _report(self, child: subprocess.Popen, code: int | None, action: str) -> None:
        """Say how ``child`` ended (``code``; None: it raised and is still exiting), with its exception if recorded."""
        if self._killing or child.pid in self._reported:
            return
        self._reported.add(child.pid)
        how = how_it_ended(code) if code is not None else "raised first"
        _tell(f"fabriclite: process {self.children.index(child) + 1} {how}{self._failure(child).headline()}; {action}.")

    def _failure(self, child: subprocess.Popen) -> Failure:
        rank = self.children.index(child) + 1
        return read_failure(os.path.join(self._records, f"{rank}.json"), rank, 1)

    def _wait_for_children(self) -> None:
        for child in self.children:
            code = child.wait()
            if code not in _ENDED and not self._killing:  # those this process stopped itself: its own error is the news
                if not _ended_well(code):
                    self._report(child, code, "this run failed")
                exit_now(_exit_code(code))


def _ended_well(code: int) -> bool:
    # After a Ctrl-C this process took too, a rank that the interrupt ended (130, or killed by SIGINT) did as asked.
    return code in _ENDED or (signals.interrupted() and code in (128 + signal.SIGINT, -signal.SIGINT))


def _returncode(child: subprocess.Popen) -> int | None:
    # Popen.poll() answers None, as if the child ran, while another thread is inside waitpid() for it (the watching
    # thread polls too); wait() retries for its timeout instead.
    try:
        return child.wait(timeout=0.05)
    except subprocess.TimeoutExpired:
        return None


def _tell(line: str) -> None:
    # Straight to file descriptor 2, not through sys.stderr: torch's excepthook (installed with the process group)
    # swaps sys.stderr for a buffer while the earlier hooks run, and a line written there by the watching thread was
    # lost when it then ended the process with os._exit.
    os.write(2, f"{line}\n".encode())


def _process_entry(local_rank: int, processes: int, port: int, start_method: str, payload: Any, results: Any) -> None:
    die_with_parent()
    os.environ.update(_rank_env(local_rank, local_rank, processes, 0, "127.0.0.1", port))
    os.environ[LAUNCHER_ENV] = start_method
    # A spawned process unpickles the work only now, with the rank in the environment: a Fabric in it is rebuilt as
    # a launched one. A forked process has the parent's objects as they were.
    function, args, kwargs = pickle.loads(payload) if start_method == "spawn" else payload
    result = function(*args, **kwargs)
    if local_rank == 0:
        results.put(result)


class MultiprocessingLauncher:
    """Runs ``function(*args, **kwargs)`` in N new processes and returns rank 0's result. ``start_method="spawn"``
    starts fresh interpreters (``function`` and its arguments are pickled); ``"fork"`` copies this process, so
    functions defined in a notebook work, but only while CUDA is not initialised here.

    Usage: ``MultiprocessingLauncher(2, "fork").launch(train, config)``.
    """

    starts_processes = True
    needs_function = True  # this process only waits: the work must come as a function

    def __init__(self, processes: int, start_method: str = "spawn") -> None:
        if start_method not in ("spawn", "fork"):
            raise ValueError(f"start_method={start_method!r} is not supported here. Valid choices: 'spawn', 'fork'.")
        self.processes = processes
        self.start_method = start_method

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        import torch.multiprocessing as mp

        if self.start_method == "spawn":
            payload: Any = pickle.dumps((function, args, kwargs))
        else:
            _check_forkable()
            payload = (function, args, kwargs)
        results = mp.get_context(self.start_method).SimpleQueue()
        processes = mp.start_processes(
            _process_entry,
            args=(self.processes, free_port(), self.start_method, payload, results),
            nprocs=self.processes,
            join=False,
            start_method=self.start_method,
        )
        signals.forward_to(processes.processes)  # a notice reaches every rank, which saves by its own policy
        try:
            while not processes.join(timeout=0.5):  # raises as soon as any process fails
                pass
        except KeyboardInterrupt:
            # The processes would go on training after this one stopped waiting (they are not daemons): pass the
            # interrupt on, and wait for each to end by its own policy (a rank blocked where Python cannot take it
            # exits 130; one running the user's `except KeyboardInterrupt:` finishes it). A second Ctrl-C kills them.
            for process in processes.processes:
                if process.is_alive():
                    os.kill(process.pid, signal.SIGINT)
            _wait_or_kill(processes.processes)
            raise
        return results.get()  # join raised if any process failed, so rank 0 has put its result


def _check_forkable() -> None:
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(
            "strategy='ddp_fork' / 'ddp_notebook' starts the processes by forking this one, and CUDA is already "
            "initialised here (something ran on a GPU or called torch.cuda before launch()); a forked process "
            "cannot use CUDA then. Restart the kernel or process and call fabric.launch(function) before any CUDA "
            "work, or in a script use strategy='ddp' or 'ddp_spawn'."
        )


def _wait_or_kill(processes: list[Any]) -> None:
    """After a Ctrl-C: wait for ``processes`` (``subprocess.Popen`` or multiprocessing ones) to end, each by its
    own policy, for as long as they take; a second Ctrl-C kills those still running."""
    popen = [hasattr(process, "wait") for process in processes]
    try:
        for process, is_popen in zip(processes, popen):
            process.wait() if is_popen else process.join()
    except KeyboardInterrupt:
        for process, is_popen in zip(processes, popen):
            process.kill()
            process.wait(timeout=10) if is_popen else process.join(10)
