"""The sharded checkpoint folder: every rank writes its own shards with ``torch.distributed.checkpoint`` (DCP), beside
``structure.pt``, the checkpoint with every tensor replaced by a meta placeholder (loaded with ``weights_only``).
It loads into any number of processes, with or without a process group: tensors are read into the live (possibly
sharded) tensors of the objects being loaded, each rank reading only its slices.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any, Mapping

import torch

from fabriclite._collections import map_with_path
from fabriclite.checkpoint.errors import (
    CheckpointError,
    agreed,
    dcp_failures,
    first_line,
    is_dcp_failure,
    read_failure,
    save_failure,
)
from fabriclite.checkpoint.files import (
    atomic_save,
    atomic_write,
    check_replaceable,
    fsync_dir,
    partial_path,
    remove,
    remove_stale_partials,
    replace,
    safe_load,
    series_tag,
)
from fabriclite.checkpoint.integrity import MANIFEST_FILE, digest, manifest_bytes, read_manifest, verify_folder

# The file beside DCP's shards that holds a sharded checkpoint's structure (tensors replaced by meta placeholders).
STRUCTURE_FILE = "structure.pt"


def save_sharded(checkpoint: dict[str, Any], path: Path, strategy: Any) -> None:
    """Every rank writes its shards of ``checkpoint`` into a new folder beside ``path``; rank 0 writes the manifest
    of every file's checksum last, and the folder replaces ``path`` atomically. ``strategy`` gives the rank and the
    collectives (``broadcast``, ``barrier``, ``all_gather_object``). Any failure raises ``CheckpointError`` on every
    rank and leaves neither a partial folder nor a changed ``path``."""
    import torch.distributed.checkpoint as dcp

    tensors: dict[str, torch.Tensor] = {}

    def placeholder(key_path: tuple, tensor: torch.Tensor) -> torch.Tensor:
        tensors[_tensor_key(len(tensors), key_path)] = tensor
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    structure = map_with_path(checkpoint, torch.Tensor, placeholder)

    def start() -> str:
        check_replaceable(path)  # never replace what a user put there
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_partials(path, series_tag(checkpoint))
        folder = partial_path(path, series_tag(checkpoint))
        os.mkdir(folder)  # follows the umask, as the files DCP writes into it do
        try:
            atomic_save(structure, folder / STRUCTURE_FILE)
        except BaseException:
            remove(folder)
            raise
        return str(folder)

    tmp = Path(agreed(strategy, start, path))
    try:
        # Every rank writes its own shards; DCP raises on every rank if any failed, and returns once .metadata is.
        # On a background thread, `strategy` carries a process group of the writer's own (background._Group).
        dcp.save(tensors, checkpoint_id=tmp, process_group=getattr(strategy, "group", None))
        mine: Any = digest(tmp, _files_of_rank(tmp, strategy.global_rank, strategy.world_size))
    except BaseException as error:
        if not (isinstance(error, Exception) or is_dcp_failure(error)):
            raise
        mine = save_failure(path, error)
        if mine is not error:
            mine.__cause__ = error
    parts = strategy.all_gather_object(mine)
    failed = next((part for part in parts if isinstance(part, CheckpointError)), None)
    if failed is not None:
        if strategy.is_global_zero:
            remove(tmp)
        raise mine if isinstance(mine, CheckpointError) else failed  # this rank's own keeps its cause
    digests = {name: entry for part in parts for name, entry in part.items()}

    def finish() -> None:
        try:
            atomic_write(tmp / MANIFEST_FILE, lambda f: f.write(manifest_bytes(digests)))
            fsync_dir(tmp)
            replace(tmp, path)
        except BaseException:
            remove(tmp)
            raise

    agreed(strategy, finish, path)


def _files_of_rank(folder: Path, rank: int, world_size: int) -> list[str]:
    # DCP names rank r's shard files __r_*; rank 0 takes the rest too (.metadata, structure.pt, anything else).
    def owner(name: str) -> int:
        match = re.match(r"__(\d+)_", name)
        return int(match[1]) if match and int(match[1]) < world_size else 0

    return sorted(entry.name for entry in folder.iterdir() if entry.is_file() and owner(entry.name) == rank)


def _tensor_key(index: int, path: tuple) -> str:
    # Unique through the index; the path makes the DCP metadata readable.
    return f"{index}:" + "/".join(str(p) for p in path)


def load_sharded(path: Path, state: dict[str, Any] | None, weights_only: bool, verify: bool = True) -> dict[str, Any]:
    """Read a sharded folder, into the live shards of ``state`` where there are some (each rank reads only its
    slices), else into full tensors; works in any number of processes, also without a process group.

    ``verify`` checks every file against the manifest first (each rank a share of the files), so nothing is loaded
    from a damaged folder. ``weights_only`` (always honoured for DCP's own files) governs ``structure.pt``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from fabriclite.checkpoint.safe_dcp import SafeReader

    distributed = dist.is_available() and dist.is_initialized()
    if verify:
        _verify_shared(path, distributed)
    structure_file = path / STRUCTURE_FILE
    if not structure_file.exists():
        raise CheckpointError(
            path,
            "not a checkpoint",
            f"Checkpoint folder {str(path)!r} has no {STRUCTURE_FILE}; it was not written by fabriclite's "
            "FSDPStrategy (or the save was interrupted before finishing).",
        )
    structure = safe_load(structure_file, weights_only=weights_only, verify=not verify)  # verified with the folder
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
    reader = None
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
            reader = SafeReader(path)
            reader.read_metadata()  # refuse a bad .metadata here, before DCP falls back to other files and logs
            dcp.load(targets, storage_reader=reader, no_dist=not distributed)
    except CheckpointError:
        raise
    except BaseException as error:
        if not (isinstance(error, Exception) or is_dcp_failure(error)):
            raise
        raise ((reader and reader.refusal) or _sharded_load_failure(path, error)) from error
    return checkpoint


def _verify_shared(path: Path, distributed: bool) -> None:
    # Each rank checks a share of the files; all learn the first problem any rank found, and raise it together.
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problem = None
    try:
        files = read_manifest(path)
        verify_folder(path, sorted(files)[rank::world], files)
    except CheckpointError as error:
        problem = error
    except OSError as error:
        problem = read_failure(path, error)
    problems = [problem]
    if distributed:
        problems = [None] * world
        dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise found


def _sharded_load_failure(path: Path, error: BaseException) -> CheckpointError:
    inner = dcp_failures(error) or [error]
    for failure in inner:
        if isinstance(failure, CheckpointError):
            return failure
    if any(isinstance(e, FileNotFoundError) for e in inner):
        reason, what = "incomplete", "a file it lists is missing"
    else:
        reason, what = "corrupt", "it is incomplete or corrupt"
    return CheckpointError(
        path, reason, f"Checkpoint folder {str(path)!r} could not be read: {what} ({first_line(inner[0])})."
    )


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
