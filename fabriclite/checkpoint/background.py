"""Asynchronous checkpoints (``fabric.save(..., asynchronous=True)``) in two stages, as DCP's ``async_save`` and
torchtitan's checkpointer do, each in one visible place of ``Checkpointer``:

1. **Stage**, at the call (``Checkpointer.stage``, then ``Staging.wait``): once the previous write has ended, every
   tensor of the checkpoint is copied into host buffers kept from the previous save, every other value is
   deep-copied. The CPU copies run on threads of their own (GPU copies on a side stream) while the loop's thread
   makes the save's one collective; the call returns once they have landed. Tensors that share memory (tied
   weights) share it in the copy, so they are written once and load tied. Under FSDP each sharded tensor is gathered
   and copied to the host one at a time (full checkpoints) or its local shard copied (sharded checkpoints). Once the
   call returns, nothing the loop does can change the checkpoint: no rule to follow, no change to detect.
2. **Write**, on the checkpointer's thread (``Checkpointer.start``): the staged checkpoint is written with the atomic
   write of a synchronous save, by rank 0 (one file) or by every rank (a sharded folder, whose collectives run on a
   process group of the checkpointer's own, so they never meet the loop's), then ``keep_last`` runs. It gives a
   future.

That future is waited for at the next save's stage and at ``load_latest``; its outcome is shared in one place,
``Checkpointer.settle``: one collective then carries every rank's outcome, so a write that failed on any rank raises
its ``CheckpointError`` (its cause chained) on every rank. The end of the process waits for a write still running
and says if it failed.

One set of host buffers serves every save, whatever its name: each place in the state (``("model", "0.weight")``)
keeps its buffer, reused while its size fits, so host memory holds one copy of the state (pinned off a GPU).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

from fabriclite.processes import signals
from fabriclite._collections import map_with_path
from fabriclite.checkpoint.errors import CheckpointError, first_line, save_failure
from fabriclite.checkpoint.staging import PIECE, Copies, Staging, cores, deep_copy, shard_key

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensors whose memory is staged as it is; others are copied whole


class Checkpointer:
    """The checkpoints of one Fabric: the run's series (``series``: which run, which save of it), and asynchronous
    saves (``start`` stages a checkpoint and writes it in the background, ``settle`` waits for that write, on every
    rank, before the next save or ``load_latest``).

    Usage: ``checkpointer.start(strategy, path, checkpoint, write_file, sharded=False)``, later
    ``checkpointer.settle(strategy, path)``.
    """

    def __init__(self) -> None:
        # The run: named from outside where the scheduler gives it one (a requeued SLURM job keeps its id), else
        # taken over from the checkpoint load_latest resumes, else new. Its saves count up across restarts.
        self._named_run = os.environ.get("FABRICLITE_RUN_ID") or signals.slurm_job_id()
        self.run = self._named_run or uuid.uuid4().hex[:16]
        self._sequence = 0
        self._buffers: dict[tuple, torch.Tensor] = {}  # host bytes, by the place in the state that first needed them
        self._pending: tuple[Path, Future | None] | None = None  # on every rank; the future where this rank writes
        self._executor: ThreadPoolExecutor | None = None
        self._group: _Group | None = None  # the sharded writes' own process group, made at the first
        self._streams: dict[torch.device, Any] = {}  # per GPU, the side stream its copies are queued on
        self._cpu_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (source bytes, host bytes), this stage
        self._copiers: ThreadPoolExecutor | None = None  # the threads that copy while the loop's thread goes on
        self._outcome: CheckpointError | None = None  # this rank's failure of the last write, until shared

    # ------------------------------------------------------------------ the run's series
    def series(self) -> dict[str, Any]:
        """What the next checkpoint records of its place in the run (``latest.Series``); every rank calls it at
        every save, so the numbers agree."""
        self._sequence += 1
        return {"run": self.run, "sequence": self._sequence, "saved_at": time.time()}

    def last_sequence(self) -> int:
        """The number of the run's last checkpoint this process saved or loaded (0: none yet): how far it got."""
        return self._sequence

    def resume(self, path: Path) -> None:
        """Go on with the run that wrote the checkpoint at ``path``, which ``load_latest`` resumed from, unless the
        scheduler names this run; later saves are numbered after it."""
        from fabriclite.checkpoint.latest import series_of

        series = series_of(Path(path))
        if series is None or series.run is None:
            return
        if not self._named_run:
            self.run = series.run
        self._sequence = max(self._sequence, series.sequence)

    # ------------------------------------------------------------------ stage
    def stage(self, strategy: Any, checkpoint: dict[str, Any], sharded: bool) -> Staging:
        """Begin copying ``checkpoint`` as it is now into this checkpointer's host buffers (tensors) and deep copies
        (the rest), once the previous write has ended: sharded tensors are gathered (a collective: every rank calls
        it; the copy kept on rank 0 alone), or with ``sharded`` staged as their local shard, written by every rank.
        The copies of memory go on while the caller does other work; ``Staging.wait()`` gives the staged checkpoint
        (None where this rank writes nothing) and the first error that stopped it. An error does not stop the
        collectives, so the ranks stay in step."""
        self._wait()  # the previous write reads the same host buffers
        group = self._own_group(strategy) if sharded else None  # a collective: before anything is staged
        keep = strategy.is_global_zero or sharded
        copies: dict[tuple, torch.Tensor] = {}  # a source's storage (alive meanwhile) -> its host copy, in this call
        gathered: dict[tuple, torch.Tensor | None] = {}  # a sharded tensor's local shard -> its staged full value
        failed: list[Exception] = []

        def stage_tensor(key: tuple, tensor: torch.Tensor, shared: dict | None) -> torch.Tensor | None:
            if failed:
                return None
            try:
                return self._stage_tensor(key, tensor, shared)
            except Exception as error:  # a pinned allocation that failed, say: on this rank alone
                failed.append(error)
                return None

        def tensor_copy(key: tuple, tensor: torch.Tensor) -> torch.Tensor | None:
            if type(tensor).__name__ != "DTensor":
                return stage_tensor(key, tensor, copies) if keep else None
            local = tensor.to_local()
            if sharded:
                from torch.distributed.tensor import DTensor

                shard = stage_tensor(key, local, copies)
                return DTensor.from_local(
                    shard, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                    stride=tensor.stride(),
                ) if shard is not None else None  # fmt: skip
            shard = shard_key(tensor)  # a tied weight appears twice: gathered once
            if shard is None or shard not in gathered:
                full = tensor.full_tensor()  # a collective, in the same order on every rank
                # Staged at once and let go, so a GPU holds one gathered tensor at a time, never the whole state;
                # not shared through `copies`, since the next gathered tensor may reuse its freed address.
                staged = stage_tensor(key, full, None) if keep else None
                if shard is None:
                    return staged
                gathered[shard] = staged
            return gathered[shard]

        def value_copy(key: tuple, value: Any) -> Any:
            return deep_copy(value, key, failed) if keep else None

        staged = map_with_path(checkpoint, torch.Tensor, tensor_copy, value_copy)
        if failed:
            self._cpu_copies = []
        copying = self._copy_on_cores()
        return Staging(staged if keep else None, failed, copying, list(self._streams.values()), group)

    def _stage_tensor(self, key: tuple, tensor: torch.Tensor, copies: dict[tuple, torch.Tensor] | None) -> torch.Tensor:
        # `copies`: None for a temporary (gathered) tensor, copied at once and shared with nothing.
        if tensor.is_conj() or tensor.is_neg():
            tensor, copies = tensor.resolve_conj().resolve_neg(), None
        if tensor.layout is not torch.strided or type(tensor) not in _PLAIN or tensor.device.type == "meta":
            return tensor.detach().clone() if tensor.device.type == "meta" else tensor.detach().to("cpu", copy=True)
        # The whole storage, as torch.save writes it: views of one storage stay views of one copy.
        storage = tensor.untyped_storage()
        source = (storage.device, storage.data_ptr(), storage.nbytes())
        host = copies.get(source) if copies is not None else None
        if host is None:
            host = self._buffer(key, storage.nbytes(), pin=storage.device.type == "cuda")
            self._copy(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage), host, copies is None)
            if copies is not None:
                copies[source] = host
        staged = torch.empty(0, dtype=tensor.dtype).set_(
            host.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride()
        )
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(staged, requires_grad=tensor.requires_grad)
        return staged.requires_grad_(tensor.requires_grad)

    def _buffer(self, key: tuple, nbytes: int, pin: bool) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != nbytes or buffer.is_pinned() != pin:
            buffer = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        return buffer

    def _copy(self, source: torch.Tensor, host: torch.Tensor, at_once: bool) -> None:
        if at_once:
            host.copy_(source)
            return
        if not source.is_cuda:
            self._cpu_copies.append((source, host))  # all at once at the end of stage, on every core
            return
        stream = self._streams.get(source.device)
        if stream is None:
            stream = self._streams[source.device] = torch.cuda.Stream(source.device)
        stream.wait_stream(torch.cuda.current_stream(source.device))  # after the work queued before the call
        with torch.cuda.stream(stream):
            host.copy_(source, non_blocking=True)  # into pinned memory: the host goes on queueing

    def _copy_on_cores(self) -> Copies:
        # Copying memory is all a CPU save holds the loop for: in pieces, taken in turn by as many threads as this
        # process has cores while the loop's thread makes the save's collective, then by the loop's thread too (a
        # rank of a run with one thread per core: the other ranks mostly wait meanwhile, at that collective).
        # torch's copy lets go of the interpreter lock.
        copies = Copies(
            (host[start : start + PIECE], source[start : start + PIECE])
            for source, host in self._cpu_copies
            for start in range(0, host.numel(), PIECE)
        )
        self._cpu_copies = []
        if copies.pieces:
            if self._copiers is None:
                self._copiers = ThreadPoolExecutor(cores(), thread_name_prefix="fabriclite-stage")
            copies.helpers = [self._copiers.submit(copies.take) for _ in range(min(len(copies.pieces), cores()))]
        return copies

    # ------------------------------------------------------------------ write
    def start(
        self,
        strategy: Any,
        path: Path,
        staging: Staging,
        extra: dict[str, Any],
        write_file: Callable[[Any, Path, Any], None],
        after: Callable[[], None] | None = None,
    ) -> None:
        """Write what ``staging`` copied, with the entries of ``extra`` (copied now), in the background: with
        ``write_file(staged, path, checkpoint_io)`` on rank 0, or for a sharded stage, as a sharded folder by every
        rank; then ``after()`` on rank 0. Every rank calls it, after ``settle``."""
        failed: list[Exception] = []
        if staging.keeps:  # copied while the copies of memory run
            extra = {key: deep_copy(value, (key,), failed) for key, value in extra.items()}
        staged, error = staging.wait()
        error = error or (failed[0] if failed else None)
        if staged is not None and error is None:
            staged.update(extra)
        if staging.group is not None:
            last = after if strategy.is_global_zero else None
            # Every rank's write begins by agreeing on how staging went: one rank's error fails it on all.
            future = self._submit(_write_sharded, staged, path, staging.group, last, error)
        elif error is not None and strategy.world_size == 1:
            raise error
        elif error is not None:  # on this rank alone, maybe: the next save or load_latest raises it on every rank
            future = Future()
            future.set_exception(_failure(path, error, None))  # nothing was written
        elif strategy.is_global_zero:
            future = self._submit(_write_file, staged, path, strategy.checkpoint_io, write_file, after)
        else:
            future = None
        self._pending = (path, future)

    def _submit(self, write: Callable, *args: Any) -> Future:
        if self._executor is None:
            # Not a daemon thread: the process's end waits for the write (a daemon thread inside torch's C++ code
            # when the interpreter shuts down can abort the process: "terminate called without an active exception").
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="fabriclite-checkpoint")
        future = self._executor.submit(write, *args)
        _finish_at_exit(future)
        return future

    def _own_group(self, strategy: Any) -> _Group:
        if self._group is None:
            import torch.distributed as dist

            group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._group = _Group(group, strategy.global_rank, strategy.world_size)
        return self._group

    # ------------------------------------------------------------------ wait
    def settle(
        self,
        strategy: Any,
        path: Any,
        rank_zero_work: Callable[[], Any] | None = None,
        mine: Any = None,
        fail: Callable = save_failure,
        doing: str = "",
        refusal: Exception | None = None,
    ) -> tuple[Any, list[Any]]:
        """Wait for the previous write, run ``rank_zero_work`` on rank 0, and share, in one collective, every rank's
        outcome of that write, the work's outcome, every rank's ``mine`` and its ``refusal`` (why this rank cannot go
        on with the call, e.g. a value of the state it could not stage): return (``rank_zero_work()``'s result, every
        rank's ``mine`` in rank order). If the write failed on any rank, every rank raises its ``CheckpointError``,
        saying that ``doing`` (what called, e.g. "the save of 'step-2.ckpt'") did not happen; else if the work
        failed, every rank raises ``fail(path, error)``; else if a rank refused, it raises its ``refusal`` and the
        others a ``CheckpointError`` naming it. Every rank calls it.

        Usage: ``_, rng_per_rank = checkpointer.settle(strategy, path, lambda: check_replaceable(path), rng)``.
        """
        self._wait()
        failure, self._outcome = self._outcome, None
        outcome: tuple[str, Any] = ("ok", None)
        if strategy.is_global_zero and rank_zero_work is not None and failure is None:
            try:
                outcome = ("ok", rank_zero_work())
            except Exception as error:
                problem = fail(Path(path), error)
                if problem is not error:
                    problem.__cause__ = error
                outcome = ("failed", problem)
        said = None if refusal is None else f"{type(refusal).__name__}: {first_line(refusal)}"
        gathered = strategy.all_gather_object((failure, outcome, mine, said))
        failed = next((theirs for theirs, *_ in gathered if theirs is not None), None)
        if failed is not None:
            raise _not_done(failure or failed, doing)  # this rank's own error, where it has one: its cause is here
        status, value = gathered[0][1]
        if status == "failed":
            raise outcome[1] if strategy.is_global_zero else value
        refused = next(((rank, theirs[3]) for rank, theirs in enumerate(gathered) if theirs[3] is not None), None)
        if refused is not None:
            if refusal is not None:
                raise refusal
            rank, said = refused
            raise CheckpointError(path, "unwritable", f"Could not save {str(path)!r}: on rank {rank}, {said}.")
        return value, [theirs[2] for theirs in gathered]

    def _wait(self) -> None:
        # Wait for the previous write; its outcome on this rank is kept for `settle` to share.
        pending, self._pending = self._pending, None
        if pending is None or pending[1] is None:
            return
        error = pending[1].exception()
        if error is not None and not isinstance(error, CheckpointError):
            problem = save_failure(pending[0], error)  # not raised by our writers, but never lose a failure
            problem.__cause__ = error
            error = problem
        self._outcome = self._outcome or error


def _not_done(error: CheckpointError, doing: str) -> CheckpointError:
    if not doing:
        return error
    # Said at the next call, which itself did not happen: say both, so nobody takes that call for done.
    message = f"{error} Because of it, {doing} did not happen either: call it again."
    try:
        raised = type(error)(error.path, error.reason, message)
    except TypeError:
        return error
    raised.__cause__ = error
    return raised


def _write_file(staged: Any, path: Path, io: Any, write_file: Callable, after: Callable[[], None] | None) -> None:
    with signals.saving():  # a second preemption notice waits for this write
        try:
            write_file(staged, path, io)
        except BaseException as error:
            raise _failure(path, error, io) from error
        if after is not None:
            after()


def _write_sharded(
    staged: Any, path: Path, group: _Group, after: Callable[[], None] | None, error: Exception | None
) -> None:
    from fabriclite.checkpoint.sharded import save_sharded

    with signals.saving():
        failures = group.all_gather_object(None if error is None else first_line(error))
        if any(failures):
            if error is not None:
                raise _failure(path, error, None) from error
            rank = next(rank for rank, failure in enumerate(failures) if failure)
            raise CheckpointError(
                path, "unwritable", f"Could not save {str(path)!r}: on rank {rank}, {failures[rank]}."
            )
        try:
            save_sharded(staged, path, group)
        except BaseException as error:
            raise _failure(path, error, None) from error
        if after is not None:
            after()


def refused(path: Path, error: Exception | None) -> Exception | None:
    """What a save call raises where its state could not be staged (None: it could): a value that cannot be copied
    as its ``TypeError``, anything else (host memory refused, say) as a ``CheckpointError`` with it chained."""
    if error is None or isinstance(error, (TypeError, CheckpointError)):
        return error
    problem = _failure(path, error, None)
    problem.__cause__ = error
    return problem


def _failure(path: Path, error: BaseException, io: Any) -> CheckpointError:
    from fabriclite.checkpoint.files import writes_atomically

    if isinstance(error, CheckpointError):
        return error
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit on this thread: rare, but say so
        return CheckpointError(
            path, "unwritable", f"Saving {str(path)!r} in the background was interrupted ({error!r})."
        )
    return save_failure(path, error, plugin=io is not None and not writes_atomically(io))


class _Group:
    """The collectives ``save_sharded`` makes (as a strategy's), on a process group of their own, so that a write on
    the checkpointer's thread never mixes its collectives with the loop's. Usage: ``save_sharded(c, path, group)``."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.global_rank = rank
        self.world_size = world_size
        self.is_global_zero = rank == 0

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered

    def barrier(self, name: str | None = None) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)


_writing: set[Future] = set()  # every write under way in this process, whoever still holds its Fabric
_registered = False


def _finish_at_exit(future: Future) -> None:
    # The end of the process waits for every write under way (even one whose Fabric is gone) before Python stops
    # thread pools (the checksums are computed on one), and says if it failed, since no later save will: registered
    # after concurrent.futures' own exit hook, so it runs first.
    global _registered
    _writing.add(future)
    future.add_done_callback(_writing.discard)
    if not _registered:
        _registered = True
        threading._register_atexit(_wait_at_exit)


def _wait_at_exit() -> None:
    for future in list(_writing):
        error = future.exception()
        if error is not None:
            print(f"fabriclite: the last asynchronous checkpoint was not saved: {error}", file=sys.stderr, flush=True)
