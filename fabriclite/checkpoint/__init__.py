"""Every checkpoint format, behind the one interface the strategies call (``save``, ``load``, ``consolidate``): a
single file (written by rank 0, sharded tensors gathered first; see ``files``), a sharded folder (every rank writes
its own shards; see ``sharded``), each replacing its target atomically, so a crash mid-save leaves the previous
checkpoint loadable. Plus what ``fabric.save`` adds to the user's state: every rank's global random streams (so a
resumed run draws exactly the numbers the uninterrupted run would have drawn) and the loss scaler.

Both formats load into any number of processes, with or without FSDP; both carry checksums that loading verifies
(``integrity``); a sharded folder is read without unpickling anything untrusted (``safe_dcp``); every failure is a
``CheckpointError`` saying what is wrong, raised on every rank (``errors``).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from fabriclite.processes import signals
from fabriclite._collections import map_with_path
from fabriclite._signatures import accepted_kwargs
from fabriclite.checkpoint.background import Checkpointer, refused
from fabriclite.checkpoint.staging import shard_key
from fabriclite.checkpoint.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    agreed,
    error_like,
    first_line,
    mismatch,
    read_failure,
    save_failure,
)
from fabriclite.checkpoint.files import (
    META_KEY,
    CheckpointIO,
    TorchCheckpointIO,
    atomic_save,
    check_replaceable,
    describe,
    is_checkpoint,
    lazy_load,
    partial_path,
    remove,
    replace,
    safe_load,
    series_tag,
    writes_atomically,
)
from fabriclite.checkpoint.latest import check_folder, check_keep_last, keep_last, newest_complete
from fabriclite.checkpoint.sharded import LiveState, load_sharded, save_sharded, slice_like
from fabriclite.seed import capture_rng_state, restore_rng_state

__all__ = [
    "META_KEY",
    "CheckpointError",
    "CheckpointIO",
    "CheckpointNotFoundError",
    "Checkpointer",
    "TorchCheckpointIO",
    "atomic_save",
    "check_replaceable",
    "consolidate",
    "describe",
    "is_checkpoint",
    "load",
    "newest_complete",
    "safe_load",
    "save",
]


# ---------------------------------------------------------------------- state <-> checkpoint
def check_state(state: Any, filter: Mapping[str, Callable] | None) -> None:
    """Raise a clear error unless ``state`` and ``filter`` are what ``fabric.save`` takes."""
    if not isinstance(state, Mapping):
        raise TypeError(f"fabric.save expects a dict of things to save, got {type(state).__name__}.")
    if META_KEY in state:
        raise ValueError(f"The key {META_KEY!r} is reserved by fabric.save; rename it in your state.")
    for key, fn in (filter or {}).items():
        if key not in state or not callable(fn):
            raise ValueError(f"filter[{key!r}] must name a key of state and be a callable (name, value) -> bool.")


def capture_meta(strategy: Any, precision: Any, rng_per_rank: list[Any] | None = None) -> dict[str, Any]:
    """What ``fabric.save`` adds: each rank's random streams, so every rank resumes drawing exactly what it would
    have drawn (gathered here, a collective, unless given), and the precision's state (the loss scaler)."""
    if rng_per_rank is None:
        rng_per_rank = strategy.all_gather_object(capture_rng_state())
    return {"rng_per_rank": rng_per_rank, "precision": precision.state_dict()}


def restore_meta(meta: dict[str, Any], precision: Any, rank: int, path: Any = "") -> None:
    """Put back what ``capture_meta`` saved; loaded into more ranks than saved it, the others take rank 0's streams.
    A damaged entry raises ``CheckpointError`` ("corrupt") naming ``path``."""
    try:
        precision.load_state_dict(meta.get("precision", {}))
        rng_per_rank = meta["rng_per_rank"]
        restore_rng_state(rng_per_rank[rank] if rank < len(rng_per_rank) else rng_per_rank[0])
    except Exception as error:
        message = f"Checkpoint {str(path)!r}: its {META_KEY!r} entry is damaged ({first_line(error)})."
        raise error_like(type(error))(path, "corrupt", message) from error


def to_checkpoint(
    state: Mapping[str, Any], meta: dict[str, Any] | None = None, filter: Mapping[str, Callable] | None = None
) -> dict[str, Any]:
    """The dict to write for ``fabric.save``: each object's ``state_dict()`` (filtered), plain values as they are,
    and fabriclite's ``meta`` under ``META_KEY``."""
    checkpoint: dict[str, Any] = {}
    for key, obj in state.items():
        value = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
        if filter and key in filter:
            value = {name: v for name, v in value.items() if filter[key](name, v)}
        checkpoint[key] = value
    if meta is not None:
        checkpoint[META_KEY] = meta
    return checkpoint


def checkpoint_into_state(checkpoint: dict[str, Any], state: dict[str, Any], strict: bool, path: Any) -> dict[str, Any]:
    """Load ``checkpoint`` into ``state`` in place (objects via ``load_state_dict``, plain values by assignment);
    return the entries ``state`` did not ask for. What does not fit raises ``CheckpointError`` ("mismatch"), also
    an instance of the type torch raised (``KeyError`` for a key the checkpoint lacks)."""
    missing = [key for key in state if key not in checkpoint]
    if strict and missing:
        raise mismatch(
            path,
            f"Checkpoint {str(path)!r} lacks the keys {missing}; it has {sorted(checkpoint)}. "
            "Pass strict=False to load what is there.",
            KeyError,
        )
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if callable(getattr(obj, "load_state_dict", None)):
            load_state_dict(obj, value, strict, path, f"state[{key!r}]")
        else:
            state[key] = value
    return checkpoint


def load_state_dict(obj: Any, value: Any, strict: bool, path: Any, what: str) -> None:
    """``obj.load_state_dict(value)`` (with ``strict`` for a module); a failure raises ``CheckpointError``
    ("mismatch"), also an instance of torch's error type, naming the parameters and shapes that differ."""
    try:
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(value, strict=strict)
        else:
            obj.load_state_dict(value)
    except Exception as error:
        if isinstance(error, CheckpointError):
            raise
        if isinstance(obj, torch.nn.Module) and isinstance(value, Mapping):
            detail = _module_differences(obj, value, strict)
        else:
            detail = None
        message = f"Checkpoint {str(path)!r} does not fit {what} ({type(obj).__name__}): "
        message += detail or f"{first_line(error)}."
        raise mismatch(path, message, type(error)) from error


def _module_differences(module: torch.nn.Module, value: Mapping[str, Any], strict: bool) -> str | None:
    # Only on the failure path: the module's own state dict, compared with the checkpoint's.
    own = module.state_dict()

    def listed(names: list[str]) -> str:
        return ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")

    shapes = [
        f"{name} is {list(value[name].shape)} in the checkpoint, {list(own[name].shape)} in the model"
        for name in own
        if isinstance(own[name], torch.Tensor)
        and isinstance(value.get(name), torch.Tensor)
        and value[name].shape != own[name].shape
    ]
    missing = [name for name in own if name not in value] if strict else []
    unexpected = [name for name in value if name not in own] if strict else []
    parts = []
    if shapes:
        parts.append(f"size mismatch: {'; '.join(shapes[:10])}{'; ...' if len(shapes) > 10 else ''}")
    if missing:
        parts.append(f"missing from the checkpoint: {listed(missing)}")
    if unexpected:
        parts.append(f"not in the model: {listed(unexpected)}")
    if not parts:
        return None
    if shapes:
        advice = "It was saved from a model of another shape; build the model as it was when saved."
    else:
        advice = "Pass strict=False to load the entries both have."
    return f"{'; '.join(parts)}. {advice}"


# ---------------------------------------------------------------------- saving and loading, both formats
def save(path: str | os.PathLike, checkpoint: dict[str, Any], strategy: Any, sharded: bool) -> None:
    """Write ``checkpoint`` to ``path``, replacing what is there atomically: a folder of shards written by every rank
    (``sharded``), else one file written by rank 0 (sharded tensors gathered first). Every rank calls it;
    ``strategy`` gives the collectives (``broadcast``, ``barrier``), the rank and the ``checkpoint_io``."""
    path = Path(path)
    if sharded:
        save_sharded(checkpoint, path, strategy)
    else:
        io = strategy.checkpoint_io
        gathered: dict[tuple, Any] = {}
        full = map_with_path(checkpoint, torch.Tensor, lambda _, t: _gathered(t, strategy.is_global_zero, gathered))
        fail = functools.partial(save_failure, plugin=not writes_atomically(io))
        agreed(strategy, lambda: _save_file(full, path, io), path, fail)  # a failure raises on all ranks


def save_state(
    strategy: Any,
    precision: Any,
    path: str | os.PathLike,
    state: Mapping[str, Any],
    checkpointer: Checkpointer,
    filter: Mapping[str, Callable] | None = None,
    keep: int | None = None,
    asynchronous: bool = False,
) -> None:
    """What ``fabric.save`` does on every rank: wait for the previous asynchronous save, add the random streams and
    the loss scaler, write through the strategy (or stage it now and write it in the background with
    ``checkpointer``), then remove the checkpoints beyond the ``keep`` newest complete ones named like ``path``
    (``latest.keep_last``; a failure there is said, and the saved checkpoint stays saved). Before the write, one
    collective (``Checkpointer.settle``) says on every rank how the previous asynchronous write ended, whether an
    asynchronous save may replace what is at ``path``, and gathers the random streams."""
    check_keep_last(keep)
    with signals.saving():  # a second preemption notice waits for this save
        _save_state(strategy, precision, Path(path), state, checkpointer, filter, keep, asynchronous)


def _save_state(
    strategy: Any,
    precision: Any,
    path: Path,
    state: Mapping[str, Any],
    checkpointer: Checkpointer,
    filter: Mapping[str, Callable] | None,
    keep: int | None,
    asynchronous: bool,
) -> None:
    io = strategy.checkpoint_io
    # A synchronous save checks on its own when it writes; a plugin's own file format is its own to judge.
    check = asynchronous and (isinstance(io, TorchCheckpointIO) or not path.is_file())
    staging = None
    if asynchronous:  # the copies of the state go on during the collective below
        sharded = getattr(strategy, "state_dict_type", "full") == "sharded"
        staging = checkpointer.stage(strategy, to_checkpoint(state, None, filter), sharded)
    try:
        _, rng_per_rank = checkpointer.settle(
            strategy,
            path,
            (lambda: check_replaceable(path)) if check else None,
            capture_rng_state(),
            doing=f"the save of {str(path)!r}",
            refusal=None if staging is None else refused(path, staging.refusal),
        )
    except BaseException:
        if staging is not None:
            staging.wait()  # no copy into the host buffers outlives the call
        raise
    meta = {**capture_meta(strategy, precision, rng_per_rank), "series": checkpointer.series()}
    after = None if keep is None else functools.partial(_keep_last, path, keep, checkpointer.run)
    if staging is not None:
        checkpointer.start(strategy, path, staging, {META_KEY: meta}, _save_file, after)
        return
    strategy.save_checkpoint(path, state, meta, filter)
    if after is not None and strategy.is_global_zero:
        after()


def _keep_last(path: Path, count: int, run: str) -> None:
    # The checkpoint at `path` is saved whatever happens here: a failure to remove older ones is said, not raised
    # (raised on rank 0 alone it would also leave the other ranks waiting at the next collective).
    try:
        keep_last(path, count, run)
    except Exception as error:
        print(
            f"fabriclite: {str(path)!r} is saved, but removing the checkpoints beyond keep_last={count} beside it "
            f"failed ({first_line(error)}); they stay.",
            file=sys.stderr,
            flush=True,
        )


def latest(
    strategy: Any, folder: str | os.PathLike, checkpointer: Checkpointer, keys: Any = (), weights_only: bool = True
) -> Path | None:
    """The newest complete checkpoint in ``folder`` holding every key of ``keys``, as rank 0 finds it, on every rank
    (None: a fresh start), once ``checkpointer``'s write still running has ended. The run ``checkpointer`` goes on
    with comes first."""
    keys = list(keys)
    found, _ = checkpointer.settle(
        strategy,
        check_folder(folder),
        lambda: newest_complete(folder, checkpointer.run, keys, weights_only),
        fail=lambda _, e: e,
        doing=f"load_latest({str(folder)!r})",
    )
    return found


def load(
    path: str | os.PathLike,
    state: dict[str, Any] | None,
    strict: bool = True,
    weights_only: bool = True,
    checkpoint_io: CheckpointIO | None = None,
    verify: bool = True,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load a checkpoint file or sharded folder, saved by any number of ranks, into ``state`` in place; return (what
    ``state`` did not consume, fabriclite's meta). Without ``state``, return the whole checkpoint. ``verify``
    checks the checksums before anything is loaded into ``state``.

    Usage: ``remainder, meta = load("last.ckpt", {"model": model})``.
    """
    if Path(path).is_dir():
        checkpoint = load_sharded(Path(path), state, weights_only, verify)
    else:
        io = checkpoint_io or TorchCheckpointIO()
        options = accepted_kwargs(io.load_checkpoint, {"weights_only": weights_only, "verify": verify})
        try:
            checkpoint = io.load_checkpoint(path, **options)
        except CheckpointError:
            raise
        except FileNotFoundError as error:  # from a CheckpointIO plugin: still the one error type
            raise CheckpointNotFoundError(path) from error
        except Exception as error:
            raise read_failure(Path(str(path)), error) from error
        if state is not None and "torch.distributed.tensor" in sys.modules:  # no DTensor can exist otherwise
            # Each rank cuts its own slice out of the full tensors: no communication.
            live = LiveState(state, templates_only=True)
            checkpoint = map_with_path(checkpoint, torch.Tensor, lambda p, t: slice_like(t, live.tensor(p)))
    meta = checkpoint.pop(META_KEY, None)
    if state is None:
        return checkpoint, meta
    return checkpoint_into_state(checkpoint, state, strict, path), meta


def consolidate(sharded_dir: str | os.PathLike, out_file: str | os.PathLike, verify: bool = True) -> None:
    """Turn a sharded checkpoint folder into one file that ``torch.load`` reads, in the form a one-file checkpoint
    has (plain tensors; optimizer states keyed by parameter index, as ``optimizer.load_state_dict`` wants).

    Runs in one process, without a process group. Usage: ``consolidate("last.ckpt", "last.pt")`` or
    ``fabriclite consolidate last.ckpt last.pt``.
    """
    sharded_dir = Path(sharded_dir)
    if not sharded_dir.is_dir():
        if not sharded_dir.exists():
            raise CheckpointNotFoundError(sharded_dir)
        raise CheckpointError(
            sharded_dir, "not a checkpoint", f"{str(sharded_dir)!r} is a file; consolidate takes a sharded folder."
        )
    check_replaceable(out_file)
    checkpoint = load_sharded(sharded_dir, None, weights_only=True, verify=verify)
    atomic_save(checkpoint, out_file)


def load_raw(
    path: str | os.PathLike,
    obj: Any,
    strict: bool = True,
    weights_only: bool = True,
    verify: bool = True,
    strategy: Any = None,
) -> None:
    """Load a plain state dict (e.g. ``torch.save(model.state_dict())``) into a module or an optimizer; the CRC-32s
    that ``torch.save`` stores in the file are checked first (``verify``).

    Into a model sharded across processes (FSDP, tensor parallel: DTensors), rank 0 reads the file and checks that
    it fits, as one process would; then each tensor goes from rank 0 to every rank, which keeps its slice, so no
    rank other than 0 ever holds more than one full tensor (``strategy`` gives the ranks and collectives). An
    optimizer of a sharded model cuts its slices out of the full states on every rank."""
    if not isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        raise TypeError(f"fabric.load_raw loads into a module or an optimizer, got {type(obj).__name__}.")
    what = "the " + ("module" if isinstance(obj, torch.nn.Module) else "optimizer")
    if _has_dtensors(obj):
        if isinstance(obj, torch.nn.Module):
            _load_raw_sharded(path, getattr(obj, "module", obj), strict, weights_only, verify, strategy)
            return
        state_dict = lazy_load(path, weights_only=weights_only, verify=verify)
        live = LiveState({"optimizer": obj}, templates_only=True)
        sliced = map_with_path({"optimizer": state_dict}, torch.Tensor, lambda p, t: slice_like(t, live.tensor(p)))
        load_state_dict(obj, sliced["optimizer"], strict, path, what)
        return
    state_dict = safe_load(path, weights_only=weights_only, verify=verify)
    load_state_dict(obj, state_dict, strict, path, what)


def _has_dtensors(obj: Any) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist otherwise
        return False
    from torch.distributed.tensor import DTensor

    if isinstance(obj, torch.optim.Optimizer):
        return any(isinstance(p, DTensor) for group in obj.param_groups for p in group["params"])
    return any(isinstance(t, DTensor) for t in obj.state_dict().values())


def _load_raw_sharded(
    path: Any, module: torch.nn.Module, strict: bool, weights_only: bool, verify: bool, strategy: Any
) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if strategy is None:
        raise ValueError(
            f"{type(module).__name__} is sharded across processes (its tensors are DTensors): load into it with "
            "fabric.load_raw(path, model), which knows the processes."
        )
    full: dict[str, Any] = {}

    def read_and_check() -> None:  # on rank 0: the file mapped, not read (one copy at most), then its fit
        state_dict = lazy_load(path, weights_only=weights_only, verify=verify)
        if not isinstance(state_dict, Mapping):
            raise mismatch(path, f"Checkpoint {str(path)!r} holds a {type(state_dict).__name__}, not a state dict.")
        problem = _module_differences(module, state_dict, strict)
        if problem is not None:
            message = f"Checkpoint {str(path)!r} does not fit the module ({type(module).__name__}): {problem}"
            raise mismatch(path, message, RuntimeError)
        own = module.state_dict()
        full.update((key, value) for key, value in state_dict.items() if key in own)  # non-strict: skip the rest

    agreed(strategy, read_and_check, path, fail=read_failure)  # every rank raises what rank 0 found
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(module, full, options=options)


def _gathered(tensor: torch.Tensor, keep: bool, gathered: dict[tuple, Any]) -> torch.Tensor | None:
    if type(tensor).__name__ != "DTensor":
        return tensor if keep else None
    shard = shard_key(tensor)  # a tied weight appears twice: gathered once, written once
    if shard is None or shard not in gathered:
        full = tensor.full_tensor()  # a collective: every rank walks the same tensors in the same order
        if shard is None:
            return full.cpu() if keep else None
        gathered[shard] = full.cpu() if keep else None
    return gathered[shard]


def _save_file(checkpoint: dict[str, Any], path: Path, checkpoint_io: CheckpointIO) -> None:
    # A plugin's own file format is its own to judge; anything else at the path must be a checkpoint we wrote.
    plugin_file = not isinstance(checkpoint_io, TorchCheckpointIO) and path.is_file() and not path.is_symlink()
    if not plugin_file:
        check_replaceable(path)
    if not path.is_dir():
        checkpoint_io.save_checkpoint(checkpoint, path)
        return
    tmp = partial_path(path, series_tag(checkpoint))  # a sharded checkpoint is there: replace it whole
    try:
        checkpoint_io.save_checkpoint(checkpoint, tmp)
        replace(tmp, path)
    except BaseException:
        remove(tmp)
        raise
