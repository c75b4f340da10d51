"""Checksums that catch a checkpoint damaged on disk or in transit (a flipped bit, a cut-off copy, a lost shard)
before any of it is loaded.

A single file is a zip archive written by ``torch.save``, which already stores a CRC-32 of every record in it; torch
never checks them on load, we do (``verify_file``). A sharded folder gets a ``manifest.json``, written last, with the
size and CRC-32 of every file in it (``write_manifest``); a folder without it, or with a file missing, shorter or
different, is refused (``verify_folder``). CRC-32 (zlib) runs at several GB/s per core and large files are checked in
chunks on several threads, so checking costs one extra read of the bytes from the page cache.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import threading
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from fabriclite.checkpoint.errors import CheckpointError, first_line

MANIFEST_FILE = "manifest.json"
_FORMAT = "fabriclite sharded checkpoint"
_CHUNK = 8 << 20  # bytes per unit of work: zlib.crc32 releases the GIL on it; each thread reuses one buffer
_ZIP_MAGIC = b"PK\x03\x04"


def workers() -> int:
    """Threads for checksumming: the cores this process may use, at most 8 (more only contend for memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def crc32_of_ranges(path: Path, ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each ``(offset, length)`` byte range of the file at ``path``, computed in parallel chunks."""
    ranges = list(ranges)
    pieces = [
        (index, start, min(_CHUNK, offset + length - start))
        for index, (offset, length) in enumerate(ranges)
        for start in range(offset, offset + length, _CHUNK)
    ]
    buffers = threading.local()
    fd = os.open(path, os.O_RDONLY)
    try:

        def crc(piece: tuple[int, int, int]) -> int:
            _, start, length = piece
            if not hasattr(buffers, "data"):
                buffers.data = bytearray(_CHUNK)
            data = memoryview(buffers.data)[:length]
            read = os.preadv(fd, [data], start)
            if read != length:
                raise EOFError(f"{path} ends at byte {start + read}, expected at least {start + length}")
            return zlib.crc32(data)

        if len(pieces) > 1:
            with ThreadPoolExecutor(min(workers(), len(pieces))) as pool:
                crcs = list(pool.map(crc, pieces))
        else:
            crcs = [crc(piece) for piece in pieces]
    finally:
        os.close(fd)
    result = [0] * len(ranges)
    for (index, _, length), value in zip(pieces, crcs):
        result[index] = crc32_combine(result[index], value, length)
    return result


def verify_file(path: Path) -> None:
    """Check every record of a ``torch.save`` zip file against the CRC-32 stored with it; raise ``CheckpointError``
    ("truncated", "corrupt") naming the file and the record. Files in torch's legacy, non-zip format carry no
    checksums and pass unchecked."""
    with open(path, "rb") as f:
        if f.read(4) != _ZIP_MAGIC:
            return
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            # torch stores every record uncompressed; a compressed one (not torch's) is left to torch.load.
            stored = [(r, start) for r, start in _records(path, fd)[0] if r.compress_type == zipfile.ZIP_STORED]
        finally:
            os.close(fd)
    except (zipfile.BadZipFile, EOFError, struct.error) as error:
        size = path.stat().st_size
        raise CheckpointError(
            path,
            "truncated",
            f"Checkpoint {str(path)!r} is truncated or damaged: its zip directory is unreadable ({size} bytes; "
            f"{first_line(error)}). It was cut off while copying or written by a save that did not finish.",
        ) from error
    try:
        crcs = crc32_of_ranges(path, [(start, record.file_size) for record, start in stored])
    except EOFError as error:
        raise CheckpointError(path, "truncated", f"Checkpoint {str(path)!r} is truncated: {error}.") from error
    for (record, _), crc in zip(stored, crcs):
        if crc != record.CRC:
            hint = (
                " It may also have been written with torch's CRC-32 turned off "
                "(torch.utils.serialization.config.save.compute_crc32 = False)."
                if record.CRC == 0
                else ""
            )
            raise CheckpointError(
                path,
                "corrupt",
                f"Checkpoint {str(path)!r} is corrupt: record {record.filename!r} ({record.file_size} bytes) has "
                f"CRC-32 {crc:08x}, but {record.CRC:08x} was stored when it was written.{hint} Load another "
                "checkpoint, or pass verify=False to load it anyway if you know the damage is harmless.",
            )


def fill_in_crcs(path: Path) -> None:
    """Write the CRC-32 of every record into a zip file that ``torch.save`` wrote with its CRC-32s turned off:
    computed in parallel chunks instead of torch's one sequential pass (a third of a save's time), then stored where
    torch would have stored them (each record's data descriptor and its central directory entry)."""
    fd = os.open(path, os.O_RDWR)
    try:
        located, directory = _records(path, fd)
        if any(record.compress_type != zipfile.ZIP_STORED for record, _ in located):
            raise ValueError(f"{path}: torch.save wrote a compressed record, which fill_in_crcs cannot handle")
        crcs = crc32_of_ranges(path, [(start, record.file_size) for record, start in located])
        for (record, start), crc in zip(located, crcs):
            value = struct.pack("<I", crc)
            if record.flag_bits & 0x08:  # a data descriptor follows the data: [signature] crc, sizes
                end = start + record.compress_size
                descriptor = end + 4 if os.pread(fd, 4, end) == b"PK\x07\x08" else end
                os.pwrite(fd, value, descriptor)
            else:
                os.pwrite(fd, value, record.header_offset + 14)
        position = directory
        for (record, _), crc in zip(located, crcs):
            entry = os.pread(fd, 46, position)
            if entry[:4] != b"PK\x01\x02":
                raise zipfile.BadZipFile(f"{path}: no central directory entry for {record.filename!r}")
            os.pwrite(fd, struct.pack("<I", crc), position + 16)
            name_length, extra_length, comment_length = struct.unpack("<HHH", entry[28:34])
            position += 46 + name_length + extra_length + comment_length
    finally:
        os.close(fd)


def _records(path: Path, fd: int) -> tuple[list[tuple[zipfile.ZipInfo, int]], int]:
    """Every record of the zip file at ``path`` (open as ``fd``) with the offset of its data, and the offset of the
    central directory. The data follows the record's local header: 30 bytes, the name, the extra field."""
    with zipfile.ZipFile(path) as archive:
        records, directory = archive.infolist(), archive.start_dir
    located = []
    for record in records:
        header = os.pread(fd, 30, record.header_offset)
        if len(header) != 30 or header[:4] != _ZIP_MAGIC:
            raise zipfile.BadZipFile(f"no local header for {record.filename!r} at byte {record.header_offset}")
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        located.append((record, record.header_offset + 30 + name_length + extra_length))
    return located, directory


# ---------------------------------------------------------------------- sharded folders
def digest(folder: Path, names: Iterable[str]) -> dict[str, dict[str, object]]:
    """Size and CRC-32 of each named file in ``folder``, for the manifest."""
    names = list(names)
    sizes = [(folder / name).stat().st_size for name in names]
    result = {}
    for name, size in zip(names, sizes):
        (crc,) = crc32_of_ranges(folder / name, [(0, size)])
        result[name] = {"bytes": size, "crc32": f"{crc:08x}"}
    return result


def manifest_bytes(files: dict[str, dict[str, object]]) -> bytes:
    """The manifest that lists ``files`` (from ``digest``), as written to ``MANIFEST_FILE``."""
    return json.dumps({"format": _FORMAT, "version": 1, "files": dict(sorted(files.items()))}, indent=1).encode()


def read_manifest(folder: Path) -> dict[str, dict[str, object]]:
    """The files a folder's manifest lists; ``CheckpointError`` ("incomplete", "corrupt") without a valid one."""
    manifest = folder / MANIFEST_FILE
    if not manifest.exists():
        raise CheckpointError(
            folder,
            "incomplete",
            f"Checkpoint folder {str(folder)!r} has no {MANIFEST_FILE}, which a finished save writes last: the save "
            "did not finish, a copy was cut short, or fabriclite 0.1 wrote it. Pass verify=False to load it anyway.",
        )
    try:
        content = json.loads(manifest.read_bytes())
        files = content["files"]
        if content.get("format") != _FORMAT or not all(
            isinstance(entry.get("bytes"), int) and isinstance(entry.get("crc32"), str) for entry in files.values()
        ):
            raise ValueError("unexpected content")
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(
            folder, "corrupt", f"Checkpoint folder {str(folder)!r} has a damaged {MANIFEST_FILE} ({error})."
        ) from error
    for name in files:
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(
                folder,
                "unsafe",
                f"Checkpoint folder {str(folder)!r}: its {MANIFEST_FILE} names {name!r}, not a file in it.",
            )
    return files


def verify_folder(folder: Path, names: Iterable[str], files: dict[str, dict[str, object]]) -> None:
    """Check the named files of ``folder`` against its manifest entries ``files``; raise ``CheckpointError``
    ("incomplete", "truncated", "corrupt") naming the first file that differs."""
    for name in names:
        path, expected = folder / name, files[name]
        if not path.is_file():
            raise CheckpointError(
                folder,
                "incomplete",
                f"Checkpoint folder {str(folder)!r} is incomplete: {name!r}, listed in its {MANIFEST_FILE}, is missing.",
            )
        size = path.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(
                folder,
                "truncated" if size < expected["bytes"] else "corrupt",
                f"Checkpoint folder {str(folder)!r}: {name!r} has {size} bytes, but {expected['bytes']} were written.",
            )
        (crc,) = crc32_of_ranges(path, [(0, size)])
        if f"{crc:08x}" != expected["crc32"]:
            raise CheckpointError(
                folder,
                "corrupt",
                f"Checkpoint folder {str(folder)!r} is corrupt: {name!r} has CRC-32 {crc:08x}, but "
                f"{expected['crc32']} was recorded when it was written. Pass verify=False to load it anyway.",
            )


# ---------------------------------------------------------------------- combining CRCs of consecutive chunks
def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and ``len(b)`` (zlib's
    ``crc32_combine``, which Python's zlib does not expose): chunks checksummed in parallel join into one CRC."""
    if length2 == 0:
        return crc1
    return _times(_zeros_operator(length2), crc1) ^ crc2


def _times(matrix: tuple[int, ...], vector: int) -> int:
    total, row = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[row]
        vector >>= 1
        row += 1
    return total


def _square(matrix: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(matrix, matrix[n]) for n in range(32))


@functools.lru_cache(maxsize=64)
def _zeros_operator(length: int) -> tuple[int, ...]:
    # The linear map over GF(2) that appending `length` zero bytes applies to a CRC register.
    operator = tuple(1 << n for n in range(32))  # identity
    power = _square(_square(_square((0xEDB88320,) + tuple(1 << n for n in range(31)))))  # one zero byte
    while length:
        if length & 1:
            operator = tuple(_times(power, operator[n]) for n in range(32))
        length >>= 1
        if length:
            power = _square(power)
    return operator
