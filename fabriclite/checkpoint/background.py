"""Asynchronous checkpoints (``fabric.save(..., asynchronous=True)``): the state is copied to CPU memory while
training waits (a copy, not a write), then rank 0 writes that copy to disk in a background thread while training
goes on.

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
import re
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from fabriclite._collections import map_with_path
from fabriclite.checkpoint.errors import CheckpointError, save_failure


class _Write:
    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: CheckpointError | None = None
        self.path: Path | None = None


_pending: _Write | None = None  # set on every rank; only rank 0's has a thread


def check_strategy(strategy: Any) -> None:
    """``ValueError`` unless ``strategy`` saves one file, which an asynchronous save writes."""
    if getattr(strategy, "state_dict_type", "full") == "sharded":
        raise ValueError(
            "fabric.save(..., asynchronous=True) writes one file, and this strategy saves a sharded folder "
            "(state_dict_type='sharded'). Use asynchronous=False, or state_dict_type='full'."
        )


def start(strategy: Any, path: Any, checkpoint: dict[str, Any], save_file: Any, after: Any = None) -> None:
    """Snapshot ``checkpoint`` (a collective for sharded tensors), then write it on rank 0 in a background thread
    with ``save_file(checkpoint, path, checkpoint_io)``, then call ``after()`` there. Every rank calls it, after a
    ``settle`` that checked the target (``save_file`` checks it again before it writes)."""
    global _pending
    check_strategy(strategy)
    path = Path(path)
    io = strategy.checkpoint_io
    keep = strategy.is_global_zero
    snapshot = map_with_path(checkpoint, torch.Tensor, lambda key, tensor: _copied(tensor, keep, (str(path), key)))
    write = _Write()
    write.path = path
    _pending = write
    if not keep:
        return

    def run() -> None:
        try:
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

    write.thread = threading.Thread(target=run, name="fabriclite-async-save", daemon=False)
    write.thread.start()
    _finish_at_exit()


_registered = False


def _finish_at_exit() -> None:
    # When the script ends, Python stops thread pools (the checksums are computed on one) before it joins threads
    # like ours: finish the write first, and say if it failed, since no later save will.
    global _registered
    if _registered:
        return
    _registered = True
    register = getattr(threading, "_register_atexit", None)  # runs before thread pools stop; Python >= 3.9
    (register or atexit.register)(_join_at_exit)


def _join_at_exit() -> None:
    write = _pending
    if write is None or write.thread is None:
        return
    write.thread.join()
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
        if write is not None and write.thread is not None:
            write.thread.join()
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


# The CPU copies of the last snapshot, by checkpoint name pattern and place in the state: the next save copies into
# them (its previous write has ended by then), which costs a third of copying into fresh memory (no page faults).
_buffers: dict[tuple, torch.Tensor] = {}


def _copied(tensor: torch.Tensor, keep: bool, key: tuple) -> torch.Tensor | None:
    if type(tensor).__name__ == "DTensor":
        tensor = tensor.full_tensor()  # a collective: every rank walks the same tensors in the same order
    if not keep:
        return None
    key = (re.sub(r"\d+", "#", key[0]), key[1])
    buffer = _buffers.get(key)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        buffer = _buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    return buffer.copy_(tensor.detach())
