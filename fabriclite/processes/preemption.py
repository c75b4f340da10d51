"""Preemption notices: a scheduler that is about to take the machines away says so with a signal first (SLURM's
``--signal=USR1@90``, a spot instance's SIGTERM with a deadline, ``scancel --signal=TERM``). ``fabric.preempted``
turns that into a value the training loop checks once per step, so it can save and leave cleanly::

    if fabric.preempted:
        fabric.save(folder / f"step-{step}.ckpt", state)
        sys.exit(PREEMPTED_EXIT_CODE)  # 75, "preempted, resumable"

What a signal does to the process (noted from ``Fabric`` creation on; a second notice, a third, the grace period)
is ``fabriclite.processes.signals``'s policy. Here, the notice becomes a value every rank agrees on: the reads agree across
ranks with one tiny all-reduce each (the ranks may have received it at different steps, or only one of them did),
so every rank sees True at the same step. The all-reduce a read starts runs during the next step and its result is
taken at the next read: no read waits for the other ranks, and True comes one read after the signal was noted.
Reading it is therefore a collective: every rank reads it, at the same place in the loop. Once True it stays True.

After a preemption, under ``fabriclite run`` its launcher ends the run once the ranks have exited (with 0 or 75): it
requeues the SLURM job where that is allowed (``requeue``) and exits with ``PREEMPTED_EXIT_CODE``. Ranks with no
fabriclite launcher above them (srun's tasks, torchrun's workers, a plain ``python train.py``) end it themselves
when their script ends: every rank waits at a barrier until all have got there (so all have saved), then global
rank 0 requeues the SLURM job. Their exit code is the script's: ``sys.exit(PREEMPTED_EXIT_CODE)`` says it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from fabriclite.processes import signals
from fabriclite.processes.signals import (  # the names users and launchers know them by, here
    NOTICES as SIGNALS,
    PREEMPTED_EXIT_CODE,
    SAME_NOTICE_S,
    requeue,
    slurm_job_id,
)

__all__ = ["PREEMPTED_EXIT_CODE", "SAME_NOTICE_S", "SIGNALS", "agreed", "requeue", "settle", "slurm_job_id"]

_agreed = False
_in_flight: _Reduction | None = None  # the all-reduce the last read started


def agreed(strategy: Any) -> bool:
    """Whether any rank received a preemption signal, the same on every rank. With several ranks the answer comes
    one read late, so that no read waits: each read takes the result of the all-reduce started at the previous
    read (long finished: a training step ran since) and starts the next one. Every rank therefore sees True at the
    same read, the one after a rank noted the signal. Nothing is exchanged once every rank agreed on True.
    Usage: ``if agreed(fabric.strategy): ...``."""
    global _agreed, _in_flight
    if _agreed:
        return True
    signals.install(strategy.global_rank)  # done at Fabric creation already, unless that was not the main thread
    noticed = signals.noticed() is not None
    if strategy.world_size > 1 and dist.is_available() and dist.is_initialized():
        previous, _in_flight = _in_flight, None
        here, noticed = noticed, previous is not None and previous.result()
        if not noticed:
            _in_flight = _Reduction(here, strategy.root_device)
    elif strategy.world_size > 1:  # no process group to start an asynchronous collective on: the strategy's own
        flag = torch.full((1,), float(noticed), device=strategy.root_device)
        noticed = bool(strategy.all_reduce(flag, reduce_op="max").item())
    _agreed = noticed
    if noticed:
        _end_at_exit(strategy)
    return noticed


class _Reduction:
    """The maximum of every rank's flag, started now and read at the next ``agreed``."""

    def __init__(self, noticed: bool, device: torch.device) -> None:
        # Filled on the device, not copied from a host list: on a GPU that copy would wait for the step queued so far.
        self.flag = torch.full((1,), float(noticed), device=device)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, async_op=True)
        self.copied = None
        if self.flag.is_cuda:
            # On a GPU, reading the flag at the next read would wait for the whole step queued since. Queue the copy
            # to the host right behind the reduction instead, and mark that point: the next read waits for the mark.
            self.work.wait()  # the current stream waits for the reduction, the host does not
            self.flag = self.flag.to("cpu", non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def result(self) -> bool:
        if self.copied is not None:
            self.copied.synchronize()
        else:
            self.work.wait()
        return bool(self.flag.item())


def settle() -> None:
    """Wait for the all-reduce the last read started (every rank started it, so it ends), before the process group
    is destroyed; the next read starts afresh. A reduction that failed, because a rank died and the group with it,
    has nothing left to wait for: the failure is reported where the run met it, not again at exit. Usage:
    ``settle()`` in a strategy's teardown."""
    global _in_flight
    reduction, _in_flight = _in_flight, None
    if reduction is not None:
        try:
            reduction.result()
        except RuntimeError:  # the group is broken (a peer died): nothing of this read is left to end
            pass


def _end_at_exit(strategy: Any) -> None:
    # `fabriclite run` requeues once its ranks have exited. Ranks with no fabriclite launcher above them (srun's
    # tasks, torchrun's workers, a plain `python train.py`) end the run themselves, when their script ends.
    if os.environ.get("FABRICLITE_LAUNCHER") != "fabriclite run":  # supervisor.LAUNCHER_ENV, as it sets it
        atexit.register(_end, strategy)  # runs before the strategy's teardown, registered earlier, closes the group


def _end(strategy: Any) -> None:
    """At the end of a preempted script: wait until every rank got there (so every rank has saved; rank 0's
    background write has finished before any exit handler runs), then on rank 0 requeue the SLURM job."""
    if strategy.world_size > 1:
        try:
            strategy.barrier()
        except Exception as error:  # a rank died: the job is still worth resuming from its newest complete checkpoint
            _say(f"fabriclite: not every rank reached the end of the script after the preemption ({error}).")
    if not strategy.is_global_zero:
        return
    if requeue(say=_say):
        # SLURM now ends this job with SIGTERM, then SIGKILL after its KillWait: let the exit finish meanwhile (the
        # handlers above would take that SIGTERM for a second notice and cut it short).
        for signum in SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
    else:
        _say("fabriclite: preempted; every rank has saved and reached the end of its script: run it again to resume.")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
