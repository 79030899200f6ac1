"""The batched data plane's framing: several envelopes in one body, and back.

One request per prefix; frames are length-prefixed (integers little endian, hashes raw 32-byte
chained sha256), and a reader refuses an unknown magic.
Upload (``PUT /v1/chunks``): magic ``b"KVB2"``, count u32, an index of (hash, storage key 32, length
u64) per item, then the envelopes in index order; the storage key is the one issued with the item's
sealing key (a stale one: the batch is refused whole). ``b"KVB1"`` (older workers): items without it.
The index comes first, so the server checks it and the capability before reading an envelope;
nothing is stored until the whole frame is in and every header checked.
Download (``POST /v1/chunks/fetch``): magic ``b"KVK1"``, the chunk size and the capability's scope,
then items (hash, status u8, the envelope's key, length u64, envelope) in the order asked, streamed.
Status 0 is an envelope; the first chunk not served ends it with status 1 (missing), 2 (tier
failed), 6 (tier deadline; read as 2 if unknown) or 3 (key version destroyed); 4: a header that
does not parse, sent without a key; 5: in the worker's shared-memory window; 7: in place in the
memory tier's arena of the caller's namespace, at the u64 offset that follows the item's head. A
response that stops early without an end was cut. Full layouts: docs/architecture.md, section 5.
"""

from __future__ import annotations

import struct
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from gateway.errors import BadFrame

__all__ = [
    "HEAD",
    "INDEX_ITEM",
    "ARENA_OFFSET",
    "IN_ARENA",
    "IN_REGION",
    "KEYED_HEAD",
    "KEYED_ITEM_HEAD",
    "KEYED_MAGIC",
    "KEY_UNAVAILABLE",
    "KeyedItem",
    "MAGIC",
    "SEALED_INDEX_ITEM",
    "SEALED_MAGIC",
    "OK",
    "MISSING",
    "TIMEOUT",
    "Reader",
    "UNAVAILABLE",
    "UNKEYED",
    "arena_offset",
    "encode_head",
    "encode_index",
    "encode_sealed_index",
    "keyed_head",
    "keyed_item_head",
    "decode_name",
    "parse_index",
    "parse_sealed_index",
    "parse_upload_head",
    "parse_keyed_head",
    "parse_arena_offset",
    "parse_keyed_item_head",
    "read_keyed_head",
]

MAGIC = b"KVB1"
SEALED_MAGIC = b"KVB2"
KEYED_MAGIC = b"KVK1"
OK, MISSING, UNAVAILABLE, KEY_UNAVAILABLE, UNKEYED, IN_REGION, TIMEOUT, IN_ARENA = 0, 1, 2, 3, 4, 5, 6, 7
_OFFSET = struct.Struct("<Q")
ARENA_OFFSET = _OFFSET.size  # 8 bytes after an IN_ARENA item's head
_HEAD = struct.Struct("<4sI")
_INDEX = struct.Struct("<32sQ")
_SEALED_INDEX = struct.Struct("<32s32sQ")
_KEYED_HEAD = struct.Struct("<4sIHH")
_KEYED_ITEM = struct.Struct("<32sBI32s32s32sQ")
HEAD, INDEX_ITEM, SEALED_INDEX_ITEM = _HEAD.size, _INDEX.size, _SEALED_INDEX.size  # 8, 40, 72 bytes
KEYED_ITEM_HEAD = _KEYED_ITEM.size  # 141 bytes
KEYED_HEAD = _KEYED_HEAD.size  # 12 bytes, then the two names
_KEY_BYTES = 32
_NO_KEY = bytes(_KEY_BYTES)
_MAX_NAME = 1024  # a tenant or namespace name longer than this is a broken frame


def encode_head(count: int, magic: bytes = MAGIC) -> bytes:
    return _HEAD.pack(magic, count)


def encode_sealed_index(items: Sequence[tuple[bytes, bytes, int]]) -> bytes:
    """The head and index of an upload frame: ``(chained hash, storage key, envelope length)``
    per item, the storage key as the 32 raw bytes the server issued it as (hex) with the item's
    sealing key."""
    return encode_head(len(items), SEALED_MAGIC) + b"".join(_SEALED_INDEX.pack(h, k, n) for h, k, n in items)


def encode_index(items: Sequence[tuple[bytes, int]]) -> bytes:
    """The head and index of an older worker's upload frame (``b"KVB1"``, no storage keys):
    ``(chained hash, envelope length)`` per item."""
    return encode_head(len(items)) + b"".join(_INDEX.pack(h, n) for h, n in items)


def parse_upload_head(data: bytes | memoryview, max_items: int) -> tuple[int, bool]:
    """``(item count, sealed)`` of an upload frame's head (``sealed``: ``b"KVB2"``, whose items
    name their storage keys); BadFrame for another magic or a count out of range."""
    magic, count = _HEAD.unpack(data)
    if magic != SEALED_MAGIC and magic != MAGIC:
        raise BadFrame("not a kvgate batch frame (magic KVB2, or KVB1)")
    if not 1 <= count <= max_items:
        raise BadFrame(f"a batch holds 1 to {max_items} items, not {count}")
    return int(count), magic == SEALED_MAGIC


def _checked(items: list[tuple[bytes, int]], count: int, max_item_bytes: int) -> list[tuple[bytes, int]]:
    if len(items) != count:
        raise BadFrame("the index is shorter than its count")
    for _h, n in items:
        if n <= 0 or n > max_item_bytes:
            raise BadFrame(f"an item is 1 to {max_item_bytes} bytes, not {n}")
    if len({h for h, _n in items}) != count:
        raise BadFrame("a hash is named twice in one batch")
    return items


def parse_index(data: bytes | memoryview, count: int, max_item_bytes: int) -> list[tuple[bytes, int]]:
    """A ``b"KVB1"`` upload's index; BadFrame for an empty or oversized item or a hash named twice."""
    return _checked([(bytes(h), int(n)) for h, n in _INDEX.iter_unpack(data)], count, max_item_bytes)


def parse_sealed_index(
    data: bytes | memoryview, count: int, max_item_bytes: int,
) -> tuple[list[tuple[bytes, int]], list[str]]:
    """A ``b"KVB2"`` upload's index: its ``(chained hash, length)`` items and the storage key
    each names (hex, as the server issued it); BadFrame as ``parse_index``."""
    rows = list(_SEALED_INDEX.iter_unpack(data))
    items = _checked([(bytes(h), int(n)) for h, _k, n in rows], count, max_item_bytes)
    return items, [bytes(k).hex() for _h, k, _n in rows]


def keyed_head(chunk_tokens: int, tenant: str, namespace: str) -> bytes:
    """The head of a keyed download: magic, chunk size and the capability's scope."""
    t, n = tenant.encode(), namespace.encode()
    return _KEYED_HEAD.pack(KEYED_MAGIC, chunk_tokens, len(t), len(n)) + t + n


@dataclass(frozen=True, slots=True)
class KeyedItem:
    """One item head of a keyed download (``key`` is all zero where none was sent)."""

    chained_hash: bytes
    status: int
    key_version: int
    salt: bytes
    key: bytes = field(repr=False)
    storage_key: bytes
    length: int


def keyed_item_head(
    chained_hash: bytes, status: int, length: int = 0, *, key_version: int = 0, salt: bytes = _NO_KEY,
    key: bytes = _NO_KEY, storage_key: bytes = _NO_KEY,
) -> bytes:
    return _KEYED_ITEM.pack(chained_hash, status, key_version, salt, key, storage_key, length)


def arena_offset(offset: int) -> bytes:
    """What follows an ``IN_ARENA`` item's head: where its envelope starts in the arena."""
    return _OFFSET.pack(offset)


def parse_arena_offset(data: bytes | memoryview) -> int:
    return int(_OFFSET.unpack(data)[0])


def parse_keyed_item_head(data: bytes | memoryview) -> KeyedItem:
    h, status, version, salt, key, storage_key, length = _KEYED_ITEM.unpack(data)
    return KeyedItem(bytes(h), int(status), int(version), bytes(salt), bytes(key), bytes(storage_key), int(length))


def parse_keyed_head(data: bytes | memoryview) -> tuple[int, int, int]:
    """``(chunk_tokens, tenant length, namespace length)`` from the fixed part of a keyed
    download's head (``KEYED_HEAD`` bytes); BadFrame for another magic or a name too long."""
    magic, chunk_tokens, t_len, n_len = _KEYED_HEAD.unpack(data)
    if magic != KEYED_MAGIC:
        raise BadFrame("not a kvgate keyed batch frame (magic KVK1)")
    if t_len > _MAX_NAME or n_len > _MAX_NAME:
        raise BadFrame("a scope name is too long")
    return int(chunk_tokens), int(t_len), int(n_len)


def decode_name(data: bytes | memoryview) -> str:
    """A tenant or namespace name of a keyed head; BadFrame where it is not UTF-8."""
    try:
        return bytes(data).decode()
    except UnicodeDecodeError:
        raise BadFrame("a scope name is not UTF-8") from None


async def read_keyed_head(reader: Reader) -> tuple[int, str, str]:
    """``(chunk_tokens, tenant, namespace)`` of a keyed download; BadFrame for another magic."""
    chunk_tokens, t_len, n_len = parse_keyed_head(await reader.read(KEYED_HEAD))
    tenant = decode_name(await reader.read(t_len))
    namespace = decode_name(await reader.read(n_len))
    return chunk_tokens, tenant, namespace


class Reader:
    """A byte stream read into the caller's buffers as it arrives (no copy beyond the one out of
    the transport's own receive buffer); BadFrame where it ends early or runs on."""

    def __init__(self, parts: AsyncIterable[bytes], direct: Callable[[memoryview], Awaitable[None]] | None = None) -> None:
        """``direct(view)``, where given, fills a view straight from the connection with the
        bytes that follow what ``parts`` has handed over (``gateway.server.rawbody``): ``into``
        uses it once what it holds of ``parts`` is used up."""
        self._parts = parts.__aiter__()
        self._left = memoryview(b"")
        self._direct = direct

    async def _next(self) -> memoryview:
        while not self._left:
            try:
                self._left = memoryview(await self._parts.__anext__()).cast("B")
            except StopAsyncIteration:
                raise BadFrame("the body ends inside the frame") from None
        return self._left

    async def into(self, view: memoryview) -> None:
        """Fill ``view`` (a writable byte buffer) from the stream."""
        filled = 0
        while filled < view.nbytes:
            if self._direct is not None and not self._left:
                await self._direct(view[filled:])
                return
            part = await self._next()
            n = min(part.nbytes, view.nbytes - filled)
            view[filled : filled + n] = part[:n]
            self._left = part[n:]
            filled += n

    async def read(self, n: int) -> memoryview:
        out = memoryview(bytearray(n))
        await self.into(out)
        return out

    async def end(self) -> None:
        """Check that nothing follows the frame."""
        if self._left:
            raise BadFrame("the body runs on past the frame")
        async for part in self._parts:
            if part:
                raise BadFrame("the body runs on past the frame")
