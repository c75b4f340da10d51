"""Checkpoint files that never lose work: atomic writes, safe loads with one clear error, and the global random
streams, so a resumed run draws exactly the numbers the uninterrupted run would have drawn.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch


# Where fabric.save keeps what it adds to the user's state: random streams, the loss scaler.
META_KEY = "__fabriclite__"


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be read: truncated, corrupt, or not a checkpoint."""


def capture_rng_state() -> dict[str, Any]:
    """Return the state of Python's, NumPy's, torch's and (when initialized) CUDA's global generators.

    Only tensors and plain Python values, so the result loads with ``torch.load(weights_only=True)``.
    Usage: ``state = capture_rng_state(); ...; restore_rng_state(state)``.
    """
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the global generators back to a state from ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """Write ``obj`` with ``torch.save`` so that ``path`` holds either the old file or the complete new one.

    The bytes go to a temporary file in the same folder, are flushed and fsynced, and the file is renamed over
    ``path`` (atomic on POSIX and Windows). A crash or SIGKILL mid-write leaves the previous checkpoint intact.
    Usage: ``atomic_save({"model": model.state_dict()}, "last.ckpt")``.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"Cannot save a checkpoint to {str(path)!r}: it is a directory; pass a file path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable; not every platform lets a directory be opened.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def safe_load(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """Load a file written by ``torch.save``; a missing, truncated or corrupt file raises one clear error naming it.

    ``weights_only=True`` (the default) refuses to run code from the file; pass ``False`` only for trusted files.
    Usage: ``checkpoint = safe_load("last.ckpt")``.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint file {str(path)!r} does not exist.")
    if path.is_dir():
        raise CheckpointError(f"Checkpoint path {str(path)!r} is a directory, expected a file written by fabric.save.")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        text = str(err)
        if weights_only and ("Weights only load failed" in text or "weights_only" in text):
            raise CheckpointError(
                f"Checkpoint {str(path)!r} holds objects that weights_only loading refuses. If you trust this file, "
                f"load it with weights_only=False. Original error: {text.splitlines()[0]}"
            ) from err
        raise CheckpointError(
            f"Checkpoint {str(path)!r} could not be read: it is truncated, corrupt or not a torch checkpoint "
            f"({type(err).__name__}: {text.splitlines()[0] if text else ''})."
        ) from err


def state_to_checkpoint(state: Mapping[str, Any], filter: Mapping[str, Callable] | None = None) -> dict[str, Any]:
    """The dict to write for ``fabric.save``: each object's ``state_dict()`` (filtered), plain values as they are."""
    checkpoint: dict[str, Any] = {}
    for key, obj in state.items():
        value = obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
        if filter and key in filter:
            value = {name: v for name, v in value.items() if filter[key](name, v)}
        checkpoint[key] = value
    return checkpoint


def checkpoint_into_state(checkpoint: dict[str, Any], state: dict[str, Any], strict: bool, path: Any) -> dict[str, Any]:
    """Load ``checkpoint`` into ``state`` in place (objects via ``load_state_dict``, plain values by assignment);
    return the entries ``state`` did not ask for."""
    missing = [key for key in state if key not in checkpoint]
    if strict and missing:
        raise KeyError(
            f"Checkpoint {str(path)!r} lacks the keys {missing}; it has {sorted(checkpoint)}. "
            "Pass strict=False to load what is there."
        )
    for key, obj in list(state.items()):
        if key not in checkpoint:
            continue
        value = checkpoint.pop(key)
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(value, strict=strict)
        elif callable(getattr(obj, "load_state_dict", None)):
            obj.load_state_dict(value)
        else:
            state[key] = value
    return checkpoint


def read_checkpoint(path: str | os.PathLike, weights_only: bool = True) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Read a file written by ``fabric.save``: (the user's entries, fabriclite's meta or None).

    Usage: ``checkpoint, meta = read_checkpoint("last.ckpt")``.
    """
    checkpoint = safe_load(path, weights_only=weights_only)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"Checkpoint {str(path)!r} holds a {type(checkpoint).__name__}, not the dict fabric.save writes."
        )
    return checkpoint, checkpoint.pop(META_KEY, None)
