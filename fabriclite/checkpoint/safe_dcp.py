"""Reading a ``torch.distributed.checkpoint`` (DCP) folder without trusting it.

DCP itself unpickles ``.metadata`` with the plain unpickler (any code in it runs), loads items that the metadata
declares as "bytes" with ``torch.load(weights_only=False)``, and opens whatever path the metadata names, inside the
folder or not. ``SafeReader`` reads the metadata with an unpickler that builds only DCP's own metadata classes and
torch's dtypes and sizes, then refuses "bytes" items (fabriclite writes only tensors), storage paths that are
absolute or lead out of the folder, and stream transforms; tensors themselves DCP loads with ``weights_only=True``.
"""

from __future__ import annotations

import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from fabriclite.checkpoint.errors import CheckpointError
from fabriclite._versions import dcp_metadata_path

# Everything a .metadata that DCP writes for tensors is built from (plus torch's dtypes, checked by type).
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib._local", "PosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            self.path,
            "unsafe",
            f"Checkpoint metadata {str(self.path)!r} asks to build {module}.{name}, which is not part of the metadata "
            "torch.distributed.checkpoint writes for tensors; refusing to unpickle it (it could run code).",
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(self.path, "unsafe", f"Checkpoint metadata {str(self.path)!r} has a persistent id.")


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata read safely and checked (see the module's docstring). DCP turns what
    ``read_metadata`` raises into text; ``refusal`` keeps the first ``CheckpointError`` to raise instead.

    Usage: ``dcp.load(tensors, storage_reader=SafeReader(folder))``.
    """

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.refusal: CheckpointError | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = dcp_metadata_path(self, kwargs.get("rank"))
        try:
            metadata = self._read(path)
        except CheckpointError as error:
            self.refusal = self.refusal or error
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read(self, path: Path) -> Metadata:
        if not path.is_file():
            raise CheckpointError(
                Path(self.path), "incomplete", f"Checkpoint folder {str(self.path)!r} has no {path.name} file."
            )
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                path,
                "truncated" if isinstance(error, EOFError) else "corrupt",
                f"Checkpoint metadata {str(path)!r} cannot be read: {type(error).__name__}: {error}",
            ) from error
        check_metadata(metadata, Path(self.path), path)
        return metadata


def check_metadata(metadata: Any, folder: Path, path: Path) -> None:
    """Raise ``CheckpointError`` ("unsafe", "corrupt") unless ``metadata`` declares only tensors stored in files
    inside ``folder``, without stream transforms."""
    if not isinstance(metadata, Metadata):
        raise CheckpointError(path, "corrupt", f"{str(path)!r} holds a {type(metadata).__name__}, not DCP metadata.")
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(
                path,
                "unsafe",
                f"Checkpoint metadata {str(path)!r} declares {key!r} as {type(item).__name__}; fabriclite writes only "
                "tensors, and DCP would load anything else with torch.load(weights_only=False), which can run code.",
            )
    root = folder.resolve()
    for index, info in (metadata.storage_data or {}).items():
        relative = getattr(info, "relative_path", None)
        if (
            not isinstance(relative, str)
            or PurePosixPath(relative).is_absolute()
            or ".." in PurePosixPath(relative).parts
            or not (root / relative).resolve().is_relative_to(root)
        ):
            raise CheckpointError(
                path,
                "unsafe",
                f"Checkpoint metadata {str(path)!r} points {getattr(index, 'fqn', index)!r} at {relative!r}, outside "
                f"the folder {str(folder)!r}; refusing to read it.",
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                path,
                "unsafe",
                f"Checkpoint metadata {str(path)!r} asks for stream transforms {info.transform_descriptors!r} on "
                f"{relative!r}; fabriclite writes none.",
            )
