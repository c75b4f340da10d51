"""The sharded checkpoint folder: every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP), beside
``structure.pt``, the checkpoint with every tensor replaced by a meta placeholder (loaded with ``weights_only``).
It loads into any number of processes, with or without a process group: tensors are read into the live (possibly
sharded) tensors of the objects being loaded, each rank reading only its slices.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from fabriclite._collections import map_with_path
from fabriclite.checkpoint.files import CheckpointError, atomic_save, fsync_dir, remove, replace, safe_load

# The file beside DCP's shards that holds a sharded checkpoint's structure (tensors replaced by meta placeholders).
STRUCTURE_FILE = "structure.pt"


def save_sharded(checkpoint: dict[str, Any], path: Path, strategy: Any) -> None:
    """Every rank writes its shards of ``checkpoint`` into a new folder beside ``path``, which then replaces ``path``
    atomically; ``strategy`` gives the rank and the collectives (``broadcast``, ``barrier``)."""
    import torch.distributed.checkpoint as dcp

    tensors: dict[str, torch.Tensor] = {}

    def placeholder(key_path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        tensors[_tensor_key(len(tensors), key_path)] = tensor
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    structure = map_with_path(checkpoint, torch.Tensor, placeholder)
    tmp = None
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a save that was killed
            remove(stale)
        tmp = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-")
        atomic_save(structure, Path(tmp) / STRUCTURE_FILE)
    tmp = strategy.broadcast(tmp)
    dcp.save(tensors, checkpoint_id=tmp)  # every rank writes its own shards; returns once the metadata is written
    strategy.barrier("save")
    if strategy.is_global_zero:
        fsync_dir(Path(tmp))
        replace(Path(tmp), path)


def _tensor_key(index: int, path: tuple) -> str:
    # Unique through the index; the path makes the DCP metadata readable.
    return f"{index}:" + "/".join(str(p) for p in path)


def load_sharded(path: Path, state: dict[str, Any] | None, weights_only: bool) -> dict[str, Any]:
    """Read a sharded folder, into the live shards of ``state`` where there are some (each rank reads only its
    slices), else into full tensors; works in any number of processes, also without a process group."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    structure_file = path / STRUCTURE_FILE
    if not structure_file.exists():
        raise CheckpointError(
            f"Checkpoint directory {str(path)!r} has no {STRUCTURE_FILE}; it was not written by fabriclite's "
            "FSDPStrategy (or the save was interrupted before finishing)."
        )
    structure = safe_load(structure_file, weights_only=weights_only)
    live = LiveState(state)
    targets: dict[str, torch.Tensor] = {}

    def target(key_path: tuple, placeholder: torch.Tensor) -> torch.Tensor:
        tensor = live.tensor(key_path) if state is not None else None
        if tensor is None or tensor.shape != placeholder.shape:
            tensor = torch.empty(placeholder.shape, dtype=placeholder.dtype)
        elif tensor.dtype != placeholder.dtype:
            tensor = torch.empty_like(tensor, dtype=placeholder.dtype)
        targets[_tensor_key(len(targets), key_path)] = tensor
        return tensor

    checkpoint = map_with_path(structure, torch.Tensor, target)
    distributed = dist.is_available() and dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            dcp.load(targets, checkpoint_id=str(path), no_dist=not distributed)
    except Exception as err:
        raise CheckpointError(
            f"Checkpoint directory {str(path)!r} could not be read: it is incomplete or corrupt ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''})."
        ) from err
    return checkpoint


class LiveState:
    """Finds, for a path in a checkpoint, the tensor of the object in ``state`` it will be loaded into: an entry of
    a module's state dict, or an optimizer's state (which may not exist yet: then a new tensor shaped and sharded
    like its parameter, or with ``templates_only``, where only shape and sharding are read, the parameter itself)."""

    def __init__(self, state: Mapping[str, Any] | None, templates_only: bool = False) -> None:
        self.state = state or {}
        self.templates_only = templates_only
        self.module_tensors: dict[str, dict[str, torch.Tensor]] = {}

    def tensor(self, path: tuple) -> torch.Tensor | None:
        if not path or path[0] not in self.state:
            return None
        obj, rest = self.state[path[0]], path[1:]
        if isinstance(obj, torch.nn.Module) and len(rest) == 1:
            if path[0] not in self.module_tensors:
                self.module_tensors[path[0]] = obj.state_dict()
            return self.module_tensors[path[0]].get(rest[0])
        if isinstance(obj, torch.optim.Optimizer) and len(rest) == 3 and rest[0] == "state":
            params = [p for group in obj.param_groups for p in group["params"]]
            index, name = rest[1], rest[2]
            if not isinstance(index, int) or not 0 <= index < len(params):
                return None
            existing = obj.state.get(params[index], {}).get(name)
            if isinstance(existing, torch.Tensor):
                return existing
            return params[index] if self.templates_only else torch.empty_like(params[index].detach())
        return None


def slice_like(full: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(live, DTensor) or isinstance(full, DTensor) or full.shape != live.shape:
        return full
    device = live.device_mesh.device_type
    # src_data_rank=None: every rank has the full tensor and keeps its own slice, without communication.
    return distribute_tensor(full.to(device), live.device_mesh, live.placements, src_data_rank=None)
