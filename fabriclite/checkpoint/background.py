"""Asynchronous checkpoints (``fabric.save(..., asynchronous=True)``): the checkpoint is the state at the call, bit
for bit, while training goes on. At the call (``_snapshot``) everything is copied that the loop may change before
the optimizer's next step: every value that is not a tensor (a deep copy), buffers (forward changes them), the
user's own tensors. The parameters and the optimizer state, nearly all the bytes, are copied to CPU memory by rank
0's writer thread, which then writes that copy. What could change them waits for that copy in ``check_copy``: the
wrapped optimizer's step and ``load_state_dict``, loading, the next save; it also compares each copied tensor's
version counter with the one at the call, and a tensor changed in place meanwhile (not by the step) makes that save
fail ("changed") instead of writing a copy that may hold half the change. The write begins after that check.

One save at a time: the next save, and ``load_latest``, first wait for the previous write to finish, and if it
failed, every rank raises its ``CheckpointError`` there. A save makes one collective (``settle``): rank 0's outcome
of the previous write, rank 0's verdict on the new target and every rank's random streams travel together, since
each collective waits for the slowest rank. The write is the atomic write of a synchronous save, so a
crash or SIGKILL during it leaves the previous checkpoint the newest complete one. A write still running when
the script ends is finished first, and a failure said on stderr. The CPU copy is kept and copied into again
at the next save: it costs one copy of the state in memory for the rest of the run.
"""

from __future__ import annotations

import atexit
import copy
import os
import queue
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from fabriclite._collections import map_with_path
from fabriclite.checkpoint.errors import CheckpointError, first_line, save_failure


class _Write:
    def __init__(self) -> None:
        self.done: threading.Event | None = None  # rank 0's: set when the write has ended
        self.error: CheckpointError | None = None
        self.path: Path | None = None


_pending: _Write | None = None  # set on every rank; only rank 0's writes (has `done`)


def check_strategy(strategy: Any) -> None:
    """``ValueError`` unless ``strategy`` saves one file, which an asynchronous save writes."""
    if getattr(strategy, "state_dict_type", "full") == "sharded":
        raise ValueError(
            "fabric.save(..., asynchronous=True) writes one file, and this strategy saves a sharded folder "
            "(state_dict_type='sharded'). Use asynchronous=False, or state_dict_type='full'."
        )


def start(strategy: Any, path: Any, state: Any, checkpoint: dict[str, Any], save_file: Any, after: Any = None) -> None:
    """Snapshot ``checkpoint`` (made from ``state``) as it is now (``_snapshot``; a collective for sharded tensors),
    then on rank 0, in a background thread, copy what the snapshot left to copy (the parameters and state of the
    optimizers in ``state`` whose step calls ``check_copy``), write it with ``save_file(checkpoint, path,
    checkpoint_io)`` and call ``after()``. Every rank calls it, after a ``settle`` that checked the target
    (``save_file`` checks it again before it writes)."""
    global _pending, _copying
    check_strategy(strategy)
    path = Path(path)
    io = strategy.checkpoint_io
    keep = strategy.is_global_zero
    snapshot, copying = _snapshot(checkpoint, str(path), keep, _stepped(state))
    write = _Write()
    write.path = path
    _pending = write
    if not keep:
        return

    def run() -> None:
        try:
            copying.run()
            copying.checked.wait()  # the loop's thread says whether a source changed while it was copied
            if copying.changed:
                raise CheckpointError(path, "changed", _changed_message(path, copying.changed))
            save_file(snapshot, path, io)
            if after is not None:
                after()
        except BaseException as error:  # reported at the next save, on every rank
            write.error = (
                save_failure(path, error)
                if isinstance(error, Exception)
                else CheckpointError(
                    path, "unwritable", f"Saving {str(path)!r} in the background was interrupted ({error!r})."
                )
            )
        finally:
            write.done.set()

    if copying.watched:
        _copying = copying  # the loop's thread checks it, in check_copy
        copying.forwards = _check_at_forward(state)
    else:
        copying.checked.set()  # nothing the loop can change is copied later
    write.done = threading.Event()
    _writer().put(run)
    _finish_at_exit()


_jobs: queue.SimpleQueue | None = None  # what the writer thread runs, one save after the other
_jobs_pid: int | None = None


def _writer() -> queue.SimpleQueue:
    # One thread writes every asynchronous save of the process, started at the first: starting a thread per save
    # held the loop for milliseconds on a loaded machine. A daemon, since the script's end waits for its last
    # write (_join_at_exit), not for the thread.
    global _jobs, _jobs_pid
    if _jobs is None or _jobs_pid != os.getpid():  # a forked child has no such thread
        _jobs, _jobs_pid = queue.SimpleQueue(), os.getpid()
        threading.Thread(target=_work, args=(_jobs,), name="fabriclite-async-save", daemon=True).start()
    return _jobs


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        jobs.get()()


def _changed_message(path: Path, changed: list[str]) -> str:
    names = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
    return (
        f"{str(path)!r} was not saved: {names} changed in place after fabric.save(..., asynchronous=True) and "
        "before the background copy of it could be checked (at the optimizer's next step), so the copy may not be "
        "the state at the save. Change parameters and optimizer state only in the optimizer's step until then, or "
        "save with asynchronous=False. The previous checkpoint is still the newest complete one."
    )


_registered = False


def _finish_at_exit() -> None:
    # When the script ends, Python stops thread pools (the checksums are computed on one) and then daemon threads
    # like the writer: finish the write first, and say if it failed, since no later save will.
    global _registered
    if _registered:
        return
    _registered = True
    register = getattr(threading, "_register_atexit", None)  # runs before thread pools stop; Python >= 3.9
    (register or atexit.register)(_join_at_exit)


def _join_at_exit() -> None:
    write = _pending
    if write is None or write.done is None:
        return
    check_copy()
    write.done.wait()
    if write.error is not None:
        print(f"fabriclite: the last asynchronous checkpoint was not saved: {write.error}", file=sys.stderr, flush=True)


def settle(
    strategy: Any,
    path: Any,
    rank_zero_work: Callable[[], Any] | None = None,
    mine: Any = None,
    fail: Callable = save_failure,
) -> tuple[Any, list[Any]]:
    """Wait for the previous asynchronous write, run ``rank_zero_work`` on rank 0, and share, in one collective,
    both outcomes and every rank's ``mine``: return (``rank_zero_work()``'s result, every rank's ``mine`` in rank
    order). If the write failed, every rank raises its ``CheckpointError``; else if the work failed, every rank
    raises ``fail(path, error)``. Every rank calls it, before each save and ``load_latest``.

    Usage: ``_, rng_per_rank = settle(strategy, path, lambda: check_replaceable(path), capture_rng_state())``.
    """
    global _pending
    write, _pending = _pending, None
    outcome: tuple[str, Any] = ("ok", None)
    if strategy.is_global_zero:
        if write is not None and write.done is not None:
            check_copy()
            write.done.wait()
        if write is not None and write.error is not None:
            outcome = ("failed", write.error)
        elif rank_zero_work is not None:
            try:
                outcome = ("ok", rank_zero_work())
            except Exception as error:
                failure = fail(Path(path), error)
                if failure is not error:
                    failure.__cause__ = error
                outcome = ("failed", failure)
    gathered = strategy.all_gather_object((outcome, mine))
    status, value = gathered[0][0]
    if status == "failed":
        raise value
    return value, [theirs for _, theirs in gathered]


def wait(strategy: Any) -> None:
    """Wait for the previous asynchronous save to finish; if it failed, raise its error on every rank. Every rank
    calls it; without an asynchronous save since the last call, it does nothing."""
    if _pending is not None:  # set on every rank at the same saves: the collective lines up
        settle(strategy, _pending.path)


def check_copy(block: bool = True) -> None:
    """Call on the training loop's thread before anything may change what the last asynchronous save copies in the
    background (the wrapped optimizer's step and ``load_state_dict``, loading a checkpoint, the next save): wait for
    that copy to end, then check that nothing it copied changed in place since the save call (the tensors' version
    counters), which lets the writer go on or makes the save fail. ``block=False`` only checks a copy that has
    ended. Without a copy under way it does nothing. Usage: ``background.check_copy()`` first thing in ``step``."""
    global _copying
    copying = _copying
    if copying is None or not (block or copying.copied.is_set()):
        return
    copying.copied.wait()
    copying.changed = [name for name, tensor, version in copying.watched if tensor._version != version]
    _copying = None
    copying.checked.set()
    for module, forward, checking in copying.forwards:
        if vars(module).get("_fabric_forward") is checking:  # else something has replaced it since
            module._fabric_forward = forward


def _check_at_forward(state: Any) -> list[tuple[Any, Callable, Callable]]:
    # A loop may not step again soon (a last save, then a long evaluation): until the copy is checked, the forward of
    # each model in `state` from fabric.setup checks it if it has ended, so the write begins then. Its
    # `_fabric_forward` is put back at the check: no cost to forward at any other time.
    forwards = []
    for module in state.values():
        forward = vars(module).get("_fabric_forward") if isinstance(module, torch.nn.Module) else None
        if forward is None:
            continue

        def checking(*args: Any, _forward: Callable = forward, **kwargs: Any) -> Any:
            check_copy(block=False)
            return _forward(*args, **kwargs)

        module._fabric_forward = checking
        forwards.append((module, forward, checking))
    return forwards


class _Copy:
    """What rank 0's writer thread copies before it writes: ``pairs`` of (source, CPU buffer), and ``watched``, the
    (name, source, version at the save call) that the loop's thread checks in ``check_copy`` once ``copied`` is set,
    setting ``changed`` and then ``checked``."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], watched: list[tuple[str, torch.Tensor, int]]):
        self.pairs = pairs
        self.watched = watched
        self.copied = threading.Event()
        self.checked = threading.Event()
        self.changed: list[str] = []
        self.forwards: list[tuple[Any, Callable, Callable]] = []  # see _check_at_forward
        # A GPU copy starts after the work queued before the save call: it waits for this event on its own stream.
        cuda = [source.device for source, _ in pairs if source.is_cuda]
        self.device = cuda[0] if cuda else None
        self.ready = torch.cuda.current_stream(self.device).record_event() if cuda else None

    def run(self) -> None:
        try:
            if self.ready is None:
                for source, buffer in self.pairs:
                    buffer.copy_(source)  # large tensors copy on torch's intra-op threads
                return
            stream = torch.cuda.Stream(self.device)
            stream.wait_event(self.ready)
            with torch.cuda.stream(stream):
                for source, buffer in self.pairs:
                    buffer.copy_(source, non_blocking=True)  # into pinned memory: asynchronous
            stream.synchronize()
        finally:
            self.copied.set()


_copying: _Copy | None = None  # rank 0's copy under way, until the loop's thread has checked it


def _snapshot(checkpoint: dict[str, Any], path: str, keep: bool, stepped: frozenset[int]) -> tuple[Any, _Copy]:
    # Everything but tensors is copied now: containers, and each other value that is not a number or a string (a
    # deep copy: arrays, sets, user objects, with any tensor inside them). Tensors go three ways: a sharded one is
    # gathered now (a collective, so on every rank, in the same order) into a new tensor nobody else holds, copied
    # later; one that only a wrapped optimizer's step changes (`stepped`) is copied later on the writer's thread,
    # and watched; any other (buffers, which forward changes; the user's own tensors) is copied now.
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    watched: list[tuple[str, torch.Tensor, int]] = []

    def tensor_copy(key: tuple, tensor: torch.Tensor) -> torch.Tensor | None:
        gathered = type(tensor).__name__ == "DTensor"
        if gathered:
            tensor = tensor.full_tensor()  # a collective
        if not keep:
            return None
        buffer = _buffer((path, key), tensor)
        if gathered:
            pairs.append((tensor, buffer))
        elif _start(tensor) in stepped:
            pairs.append((tensor.detach(), buffer))
            watched.append((_name(key), tensor, tensor._version))
        else:
            buffer.copy_(tensor.detach())
        return buffer

    def value_copy(key: tuple, value: Any) -> Any:
        try:
            return copy.deepcopy(value)
        except Exception as error:
            raise TypeError(
                f"fabric.save(..., asynchronous=True) copies the state as it is at the call, and {_name(key)} "
                f"({type(value).__name__}) cannot be copied ({first_line(error)}). Make it "
                "copyable (copy.deepcopy), or save with asynchronous=False."
            ) from error

    return map_with_path(checkpoint, torch.Tensor, tensor_copy, value_copy), _Copy(pairs, watched)


def _name(key: tuple) -> str:
    return "state" + "".join(f"[{part!r}]" for part in key)


def _stepped(state: Any) -> frozenset[int]:
    # Where the tensors start (data_ptr) that only the step of an optimizer in `state` changes, for the optimizers
    # whose step and load_state_dict call check_copy (those from fabric.setup): their parameters and their state.
    # A checkpoint's tensor found here is one of them or a view of one, which shares its version counter.
    tensors = []
    for optimizer in (value for value in state.values() if getattr(type(value), "checks_async_copy", False)):
        tensors += [parameter for group in optimizer.param_groups for parameter in group["params"]]
        tensors += [value for per_parameter in optimizer.state.values() for value in per_parameter.values()]
    return frozenset(_start(tensor) for tensor in tensors if isinstance(tensor, torch.Tensor)) - {None}


def _start(tensor: torch.Tensor) -> int | None:
    # None for what has no version counter to watch or no memory of its own: inference tensors, sparse, subclasses.
    if tensor.layout is not torch.strided or tensor.is_inference() or type(tensor) not in _PLAIN:
        return None
    return tensor.data_ptr() or None  # 0: empty


_PLAIN = (torch.Tensor, torch.nn.Parameter)


# The CPU copies of the last snapshot, by checkpoint name pattern and place in the state: the next save copies into
# them (its previous write has ended by then), which costs a third of copying into fresh memory (no page faults).
# For a GPU's tensors they are pinned, so the copy off the GPU is asynchronous.
_buffers: dict[tuple, torch.Tensor] = {}


def _buffer(key: tuple, tensor: torch.Tensor) -> torch.Tensor:
    key = (re.sub(r"\d+", "#", key[0]), key[1])
    buffer = _buffers.get(key)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        pin = tensor.is_cuda
        buffer = _buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    return buffer
