"""The disk tier's file format and its blocking file operations (run in a worker thread).

Layout: ``root/<owner>/<group>/<digest[:2]>/<digest>.kvc``; every label is lowercase hex (checked
by :class:`ChunkKey`), so a key cannot name a path outside ``root``. Directories are created 0700,
files 0600. A chunk file is a 48-byte header followed by the payload (the ciphertext envelope):
magic ``b"KVGC"`` (4), format version 1 (1), checksum algorithm (1: 1 = SHA-256, 2 = CRC32C,
3 = CRC-32), reserved zeros (2), payload length little endian (8), payload checksum (32; a CRC is
4 bytes little endian, then zeros). Every algorithm is read back, whichever wrote the file.

The checksum detects torn, truncated or bit-rotted files, treated as absent; it is *not* a security
check (anyone who can write the file can recompute it): authenticity is the cipher's job. A write
goes to a unique temp file (``O_EXCL``), is fsynced, ``os.replace``-d onto the final name and the
directory fsynced, so a crash never leaves a torn chunk and concurrent writers leave one complete
file. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import io
import os
import secrets
import stat
import struct
import time
import zlib
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from storage.types import ChunkKey

__all__ = [
    "ALGORITHMS",
    "HEADER",
    "ChecksumUnavailable",
    "Corrupt",
    "ScanResult",
    "checksum",
    "chunk_path",
    "default_algorithm",
    "read_chunk",
    "remove_labels",
    "same_file",
    "scan",
    "unlink_chunks",
    "write_chunk",
]

MAGIC = b"KVGC"
VERSION = 1
ALGO_SHA256 = 1
ALGO_CRC32C = 2
ALGO_CRC32 = 3  # zlib.crc32: in the standard library, releases the GIL
ALGORITHMS = {"sha256": ALGO_SHA256, "crc32c": ALGO_CRC32C, "crc32": ALGO_CRC32}
HEADER = struct.Struct("<4sBBHQ32s")
SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class Corrupt(Exception):
    """A chunk file that is truncated, has a bad header or a wrong checksum."""

    def __init__(self, reason: str, ident: tuple[int, int] | None = None) -> None:
        super().__init__(reason)
        self.ident = ident


class ChecksumUnavailable(Exception):
    """The file's checksum algorithm needs a package that is not installed."""


@functools.cache
def _crc32c() -> Callable[[Any], int] | None:
    try:  # optional (LGPL, no type stubs): imported by name so the type checker needs no stub
        crc32c = importlib.import_module("crc32c")
    except ImportError:
        return None
    fn: Callable[[Any], int] = crc32c.crc32c
    return fn if getattr(crc32c, "hardware_based", False) else None


def default_algorithm() -> str:
    return "crc32c" if _crc32c() is not None else "crc32"


def checksum(algo: int, data: bytes | bytearray | memoryview) -> bytes:
    if algo == ALGO_SHA256:
        return hashlib.sha256(data).digest()
    if algo == ALGO_CRC32:
        return zlib.crc32(data).to_bytes(4, "little") + bytes(28)
    if algo == ALGO_CRC32C:
        fn = _crc32c()
        if fn is None:
            raise ChecksumUnavailable("this chunk file has a CRC32C checksum: install crc32c")
        return fn(data).to_bytes(4, "little") + bytes(28)
    raise Corrupt(f"unknown checksum algorithm {algo}")


def chunk_path(root: Path, key: ChunkKey) -> Path:
    return root / key.owner / key.group / key.digest[:2] / (key.digest + SUFFIX)


def leading_file_sizes(root: Path, keys: list[ChunkKey]) -> list[int]:
    """The sizes of the chunk files of the leading ``keys`` that are on disk, up to the first that
    is not (one stat each, no read; the paths of ``chunk_path``, built as strings)."""
    base = os.fspath(root)
    out: list[int] = []
    for key in keys:
        d = key.digest
        try:
            st = os.stat(f"{base}/{key.owner}/{key.group}/{d[:2]}/{d}{SUFFIX}")
        except OSError:
            break
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER.size:
            break
        out.append(st.st_size)
    return out


# -- write -------------------------------------------------------------------------------------
def write_chunk(root: Path, path: Path, data: memoryview, fsync: bool, algo: int = ALGO_SHA256) -> int:
    """Atomically write ``data`` at ``path``; return the file's size."""
    header = HEADER.pack(MAGIC, VERSION, algo, 0, data.nbytes, checksum(algo, data))
    directory = path.parent
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC | _O_NOFOLLOW
    for attempt in range(5):
        tmp = directory / f".{path.stem}.{os.getpid()}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        try:
            _ensure_dir(root, directory, fsync)
            fd = os.open(tmp, flags, 0o600)
            break
        except FileNotFoundError:  # a concurrent delete pruned the directory: make it again
            if attempt == 4:
                raise
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(directory)
    return HEADER.size + data.nbytes


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view.nbytes:
        view = view[os.write(fd, view) :]


def _ensure_dir(root: Path, directory: Path, fsync: bool) -> None:
    if directory.is_dir():
        return
    missing: list[Path] = []
    d = directory
    while d != root and not d.is_dir():
        missing.append(d)
        d = d.parent
    for d in reversed(missing):
        with suppress(FileExistsError):
            os.mkdir(d, 0o700)
            if fsync:
                _fsync_dir(d.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- read --------------------------------------------------------------------------------------
def read_chunk(path: Path) -> tuple[memoryview, tuple[int, int]]:
    """Read and check one chunk into one preallocated buffer. Raises FileNotFoundError or Corrupt."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    with io.FileIO(fd, "rb") as f:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        algo, length, expected = _read_header(f, st.st_size, ident)
        # numpy's allocator asks for transparent huge pages on large buffers: far fewer page
        # faults than bytearray (which also zero-fills) for a 32 MiB chunk
        buf = np.empty(length, dtype=np.uint8).data.cast("B")
        _read_into(f, buf, ident)
    if checksum(algo, buf) != expected:
        raise Corrupt("checksum mismatch", ident)
    return buf.toreadonly(), ident


def _read_header(f: io.FileIO, size: int, ident: tuple[int, int]) -> tuple[int, int, bytes]:
    raw = bytearray(HEADER.size)
    if size < HEADER.size:
        raise Corrupt("shorter than the header", ident)
    _read_into(f, memoryview(raw), ident)
    magic, version, algo, _reserved, length, expected = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION or algo not in ALGORITHMS.values():
        raise Corrupt("not a chunk file of a known format", ident)
    if size != HEADER.size + length:
        raise Corrupt(f"length mismatch: header says {length}, file holds {size - HEADER.size}", ident)
    return algo, length, expected


def _read_into(f: io.FileIO, view: memoryview, ident: tuple[int, int]) -> None:
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise Corrupt("truncated while reading", ident)
        view = view[n:]


def same_file(path: Path, ident: tuple[int, int] | None) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return ident is None or (st.st_dev, st.st_ino) == ident


# -- delete ------------------------------------------------------------------------------------
def unlink_chunks(root: Path, paths: list[Path], only_if: tuple[int, int] | None = None) -> int:
    """Unlink chunk files (only the one with inode ``only_if`` when given); prune empty dirs."""
    removed = 0
    for path in paths:
        if only_if is not None and not same_file(path, only_if):
            continue
        with suppress(FileNotFoundError):
            os.unlink(path)
            removed += 1
        _prune(root, path.parent)
    return removed


def remove_labels(root: Path, owner: str | None, group: str | None) -> set[ChunkKey]:
    """Unlink every chunk and temp file under one owner or one group (also files this process
    has not indexed, such as crash leftovers); return the keys of the chunk files removed."""
    owners = [owner] if owner is not None else [e.name for e in _subdirs(root)]
    removed: set[ChunkKey] = set()
    for o in owners:
        groups = [group] if group is not None else [e.name for e in _subdirs(root / o)]
        for g in groups:
            gdir = root / o / g
            for prefix in _subdirs(gdir):
                with suppress(FileNotFoundError), os.scandir(prefix.path) as it:
                    for entry in it:
                        if entry.name.endswith((SUFFIX, TMP_SUFFIX)):
                            with suppress(FileNotFoundError):
                                os.unlink(entry.path)
                                if entry.name.endswith(SUFFIX):
                                    with suppress(ValueError):
                                        removed.add(ChunkKey(o, g, entry.name[: -len(SUFFIX)]))
                _prune(root, Path(prefix.path))
    return removed


def _prune(root: Path, directory: Path) -> None:
    while directory != root and root in directory.parents:
        try:
            os.rmdir(directory)
        except OSError:  # not empty, or gone
            return
        directory = directory.parent


# -- start-up scan -----------------------------------------------------------------------------
@dataclass
class ScanResult:
    entries: list[tuple[ChunkKey, int, float]] = field(default_factory=list)  # key, size, mtime
    temp_removed: int = 0
    corrupt_removed: int = 0
    ignored: int = 0


def scan(root: Path, *, temp_grace_s: float, verify: bool) -> ScanResult:
    """Index every chunk file under ``root``; remove stale temp files and broken chunk files."""
    result = ScanResult()
    for o in _subdirs(root):
        for g in _subdirs(Path(o.path)):
            for prefix in _subdirs(Path(g.path), max_len=2):
                with os.scandir(prefix.path) as it:
                    for entry in it:
                        _scan_entry(entry, o.name, g.name, prefix.name, temp_grace_s, verify, result)
    result.entries.sort(key=lambda e: e[2])  # least recently written first
    return result


def _scan_entry(
    entry: os.DirEntry[str], owner: str, group: str, prefix: str,
    grace: float, verify: bool, result: ScanResult,
) -> None:
    name = entry.name
    if not entry.is_file(follow_symlinks=False):
        result.ignored += 1
        return
    if name.startswith(".") and name.endswith(TMP_SUFFIX):
        if _stale_temp(entry, grace):
            with suppress(FileNotFoundError):
                os.unlink(entry.path)
                result.temp_removed += 1
        return
    digest = name[: -len(SUFFIX)]
    if not name.endswith(SUFFIX) or digest[:2] != prefix:
        result.ignored += 1
        return
    try:
        key = ChunkKey(owner, group, digest)
    except ValueError:
        result.ignored += 1
        return
    try:
        if verify:
            with suppress(ChecksumUnavailable):  # cannot verify here: the read will say so
                read_chunk(Path(entry.path))
        _check_header(Path(entry.path))
        st = entry.stat(follow_symlinks=False)
    except FileNotFoundError:
        return
    except Corrupt:
        with suppress(FileNotFoundError):
            os.unlink(entry.path)
        result.corrupt_removed += 1
        return
    result.entries.append((key, st.st_size, st.st_mtime))


def _check_header(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | _O_NOFOLLOW)
    with io.FileIO(fd, "rb") as f:
        st = os.fstat(fd)
        _read_header(f, st.st_size, (st.st_dev, st.st_ino))


def _stale_temp(entry: os.DirEntry[str], grace: float) -> bool:
    """A temp file is left over when its writer is gone (pid in its name) or it is old."""
    with suppress(FileNotFoundError):
        if time.time() - entry.stat(follow_symlinks=False).st_mtime > grace:
            return True
    parts = entry.name.split(".")
    try:
        pid = int(parts[-3])
    except (IndexError, ValueError):
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _subdirs(path: Path, max_len: int = 128) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [
                e for e in it
                if e.is_dir(follow_symlinks=False) and 0 < len(e.name) <= max_len
                and all(c in "0123456789abcdef" for c in e.name)
            ]
    except (FileNotFoundError, NotADirectoryError):
        return []
