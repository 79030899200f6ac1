"""Where the Redis tier puts things: key names and the chunk header. Pure functions, no I/O.

Keys under ``prefix`` (every label is lowercase hex, so ``:`` never occurs inside one)::

    {p}c:{owner}:{group}:{digest}              head: header, plus the payload inline if it fits
    {p}c:{owner}:{group}:{digest}:{ver}:{i}    segment i of a large chunk, version ``ver``
    {p}g:{owner}:{group}                       set: every head and segment key of that group
    {p}go:{group} / {p}o:{owner} / {p}owners   sets: owners of a group, groups of an owner, owners
    {p}pins                                    set: pinned head keys
    {p}bytes, {p}b:{owner}:{group}             counters: payload bytes stored (all, per group)

Segments are immutable once written: a new put writes a new version, then unlinks the old one.
Header (28 bytes, little endian): magic "KVR" | format 1 | flags (bit 0: inline) | 3 reserved |
segments u32 | length u64 | version 8 bytes (random per put; names the segment keys).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from storage.types import ChunkKey

__all__ = ["HEADER_SIZE", "BadHeader", "Header", "Layout", "pack_header", "unpack_header"]

_MAGIC = b"KVR\x01"
_HEADER = struct.Struct("<4sBxxxIQ8s")
HEADER_SIZE = _HEADER.size
_INLINE = 1


class BadHeader(ValueError):
    """The head value is not a chunk header this code wrote (foreign key or corruption)."""


@dataclass(frozen=True, slots=True)
class Header:
    length: int
    segments: int  # 0 when the payload is inline in the head value
    version: bytes

    @property
    def inline(self) -> bool:
        return self.segments == 0


def pack_header(header: Header) -> bytes:
    flags = _INLINE if header.inline else 0
    return _HEADER.pack(_MAGIC, flags, header.segments, header.length, header.version)


def unpack_header(raw: bytes | memoryview) -> Header:
    if len(raw) < HEADER_SIZE:
        raise BadHeader("head value shorter than the header")
    magic, flags, segments, length, version = _HEADER.unpack_from(raw)
    if magic != _MAGIC or bool(flags & _INLINE) != (segments == 0) or flags & ~_INLINE:
        raise BadHeader("not a kvgate chunk header")
    return Header(length=length, segments=segments, version=version)


class Layout:
    """Key names for one prefix."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or any(c in prefix for c in "*?[]\\ \r\n"):
            raise ValueError("prefix must be a string without glob characters or whitespace")
        self.prefix = prefix
        self.bytes = f"{prefix}bytes"
        self.owners = f"{prefix}owners"
        self.pins = f"{prefix}pins"
        self._head0 = f"{prefix}c:"
        self._head0_len = len(self._head0.encode())

    def head(self, key: ChunkKey) -> str:
        return f"{self._head0}{key.owner}:{key.group}:{key.digest}"

    def segment(self, head: str, version: bytes, index: int) -> str:
        return f"{head}:{version.hex()}:{index}"

    def segments(self, head: str, header: Header) -> list[str]:
        return [self.segment(head, header.version, i) for i in range(header.segments)]

    def group_set(self, owner: str, group: str) -> str:
        return f"{self.prefix}g:{owner}:{group}"

    def group_owners(self, group: str) -> str:
        return f"{self.prefix}go:{group}"

    def owner_groups(self, owner: str) -> str:
        return f"{self.prefix}o:{owner}"

    def group_bytes(self, owner: str, group: str) -> str:
        return f"{self.prefix}b:{owner}:{group}"

    def is_head(self, name: bytes) -> bool:
        """Whether a member of a group set names a head (fast: no parsing, no validation)."""
        return name.count(b":", self._head0_len) == 2

    def parse_head(self, name: str | bytes) -> ChunkKey | None:
        """The ChunkKey of a head key name; None for segment names and anything else."""
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        if not name.startswith(self._head0):
            return None
        parts = name[len(self._head0):].split(":")
        if len(parts) != 3:
            return None
        try:
            return ChunkKey(*parts)
        except ValueError:
            return None
