"""The stage of an asynchronous save (``background.Checkpointer.stage``): a checkpoint being copied into host memory
(``Staging``), its CPU copies cut into pieces that any free thread takes (``Copies``), the deep copy of every
value that is not a tensor (``deep_copy``), and what names a sharded tensor, so that a tied one is gathered once
(``shard_key``).
"""

from __future__ import annotations

import collections
import copy
import os
from concurrent.futures import Future
from typing import Any, Iterable

import torch

from fabriclite._versions import inner_tensor
from fabriclite.checkpoint.errors import first_line


class Staging:
    """A checkpoint being copied into host buffers (``Checkpointer.stage``): ``wait()`` gives it once every copy has
    landed, and the first error that stopped it. Usage: ``staged, error = staging.wait()``."""

    def __init__(self, staged: Any, failed: list[Exception], copying: Copies, streams: list[Any], group: Any) -> None:
        self._staged = staged
        self.keeps = staged is not None  # False where this rank writes nothing
        self.refusal = failed[0] if failed else None  # known before the copies run: the call is to fail on all ranks
        self._failed = failed
        self._copying = copying
        self._streams = streams
        self.group = group  # the sharded write's process group; None: one file, written by rank 0

    def wait(self) -> tuple[Any, Exception | None]:
        try:
            self._copying.finish()
        except Exception as error:
            self._failed.append(error)
        try:
            for stream in self._streams:
                stream.synchronize()  # the copies off the GPU have landed: the loop may change the sources now
        except Exception as error:
            self._failed.append(error)
        self._streams = []
        return self._staged, (self._failed[0] if self._failed else None)


PIECE = 8 * 2**20  # bytes per piece of a parallel copy


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def deep_copy(value: Any, key: tuple, failed: list[Exception]) -> Any:
    # A value of the checkpoint that is not a tensor, as it is at the call; a failure is kept in `failed`.
    try:
        return copy.deepcopy(value)
    except Exception as error:
        failed.append(
            TypeError(
                f"fabric.save(..., asynchronous=True) copies the state as it is at the call, and {_name(key)} "
                f"({type(value).__name__}) cannot be copied ({first_line(error)}). Make it copyable "
                "(copy.deepcopy), or save with asynchronous=False."
            )
        )
        failed[-1].__cause__ = error
        return None


class Copies:
    """Pieces of memory to copy (host, source), taken one at a time by whichever thread is free: ``take()`` on each
    helper, then ``finish()`` on the loop's thread, which copies what is left and waits for the helpers."""

    def __init__(self, pieces: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.pieces = collections.deque(pieces)
        self.helpers: list[Future] = []

    def take(self) -> None:
        while True:
            try:
                host, source = self.pieces.popleft()  # atomic: no piece is copied twice
            except IndexError:
                return
            host.copy_(source)

    def finish(self) -> None:
        try:
            self.take()
        finally:
            helpers, self.helpers = self.helpers, []
            errors = [helper.exception() for helper in helpers]
        error = next((error for error in errors if error is not None), None)
        if error is not None:
            raise error


def shard_key(tensor: Any) -> tuple | None:
    """What names a sharded tensor (a DTensor) while it is alive: its local shard's place in memory, shape and
    placements. Two entries of a state with the same key are one tensor (a tied weight), to be gathered once; None
    for a shard without memory of its own (an empty optimizer state on a rank that holds none of the tensor, where
    every such shard has the same address), never one with another. Every rank must decide alike, since each key
    gathered is a collective: a tied parameter's memory is never empty on any rank (FSDP pads every rank's shard to
    the same size)."""
    local = inner_tensor(tensor.to_local())  # fp8's weights wrap their memory
    storage = local.untyped_storage()
    if storage.nbytes() == 0:
        return None
    return storage.data_ptr(), local.storage_offset(), tuple(local.shape), tuple(tensor.placements)


def _name(key: tuple) -> str:
    return "state" + "".join(f"[{part!r}]" for part in key)
