"""Where the Redis Cluster tier puts things: key names with hash tags. Pure functions, no I/O.

Redis Cluster hashes only the hash tag (the first ``{...}``) of a key, so keys sharing a tag share
a slot and may be used together in one MULTI/EXEC. A chunk's tag is ``owner.group.bb`` (its owner
and group labels and the first two hex digits of its digest), so one namespace spreads over up to
256 slots while everything one chunk's write touches is in one slot::

    {p}{o.g.bb}c:{digest}              head: header, plus the payload inline when it fits
    {p}{o.g.bb}c:{digest}:{ver}:{i}    segment i of a large chunk, version ``ver`` (immutable)
    {p}{o.g.bb}pins / {p}{o.g.bb}b     set of pinned heads / payload bytes under this tag
    {p}{u.x}bytes                      shard ``x`` (bucket's first hex digit) of the total bytes

No key lies outside a chunk's tag except the 16 counter shards, so no write crosses slots.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage._redis_layout import Header
from storage.types import ChunkKey

__all__ = ["SHARDS", "ClusterLayout", "Parsed"]

SHARDS = "0123456789abcdef"
HEAD, SEGMENT, PINS, COUNTER = "head", "segment", "pins", "counter"


@dataclass(frozen=True, slots=True)
class Parsed:
    """What a key name under the prefix is: its kind, tag labels and (for a head) chunk key."""

    kind: str
    owner: str
    group: str
    bucket: str
    key: ChunkKey | None = None


class ClusterLayout:
    """Key names for one prefix on a cluster."""

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or any(c in prefix for c in "*?[]\\ \r\n{}"):
            raise ValueError("prefix must be a string without glob characters, braces or whitespace")
        self.prefix = prefix
        self._open = prefix + "{"

    @staticmethod
    def bucket(key: ChunkKey) -> str:
        return key.digest[:2]

    def tag(self, key: ChunkKey) -> str:
        return f"{self._open}{key.owner}.{key.group}.{key.digest[:2]}}}"

    def head(self, key: ChunkKey) -> str:
        return f"{self.tag(key)}c:{key.digest}"

    def segment(self, head: str, version: bytes, index: int) -> str:
        return f"{head}:{version.hex()}:{index}"

    def segments(self, head: str, header: Header) -> list[str]:
        return [self.segment(head, header.version, i) for i in range(header.segments)]

    def pins(self, key: ChunkKey) -> str:
        return self.tag(key) + "pins"

    def tag_bytes(self, key: ChunkKey) -> str:
        return self.tag(key) + "b"

    def shard(self, key: ChunkKey) -> str:
        return self.shard_name(key.digest[0])

    def shard_name(self, digit: str) -> str:
        return f"{self._open}u.{digit}}}bytes"

    def shard_names(self) -> list[str]:
        return [self.shard_name(d) for d in SHARDS]

    # -- SCAN patterns (glob: only * ? [ ] \ are special, and labels hold none) -----------------
    def pattern(self, owner: str | None = None, group: str | None = None, heads_only: bool = False) -> str:
        tail = "c:*" if heads_only else "*"
        return f"{self._open}{owner or '*'}.{group or '*'}.*}}{tail}"

    def parse(self, name: str | bytes) -> Parsed | None:
        """The kind and labels of a key name written by this layout; None for anything else."""
        if isinstance(name, bytes):
            name = name.decode("ascii", "replace")
        if not name.startswith(self._open):
            return None
        tag, sep, rest = name[len(self._open):].partition("}")
        labels = tag.split(".")
        if not sep or len(labels) != 3:
            return None
        owner, group, bucket = labels
        if rest == "pins":
            return Parsed(PINS, owner, group, bucket)
        if rest == "b":
            return Parsed(COUNTER, owner, group, bucket)
        if not rest.startswith("c:"):
            return None
        parts = rest[2:].split(":")
        if len(parts) == 3:
            return Parsed(SEGMENT, owner, group, bucket)
        if len(parts) != 1:
            return None
        try:
            key = ChunkKey(owner, group, parts[0])
        except ValueError:
            return None
        if key.digest[:2] != bucket:
            return None
        return Parsed(HEAD, owner, group, bucket, key)
