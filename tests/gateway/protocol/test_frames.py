"""The batch frame (gateway.protocol.frames): what parses, and every malformed frame refused as BadFrame."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

import pytest

from gateway.errors import BadFrame, InvalidRequest
from gateway.protocol import frames

H1, H2 = b"\x01" * 32, b"\x02" * 32
K1, K2 = b"\x0a" * 32, b"\x0b" * 32  # the storage keys the server issued with the sealing keys


def test_index_round_trip():
    raw = frames.encode_sealed_index([(H1, K1, 10), (H2, K2, 20)])
    assert len(raw) == frames.HEAD + 2 * frames.SEALED_INDEX_ITEM
    assert frames.parse_upload_head(raw[: frames.HEAD], max_items=2) == (2, True)
    items, keys = frames.parse_sealed_index(raw[frames.HEAD :], 2, max_item_bytes=20)
    assert items == [(H1, 10), (H2, 20)] and keys == [K1.hex(), K2.hex()]


def test_an_older_workers_index_without_storage_keys_still_parses():
    raw = frames.encode_index([(H1, 10), (H2, 20)])
    assert len(raw) == frames.HEAD + 2 * frames.INDEX_ITEM
    assert frames.parse_upload_head(raw[: frames.HEAD], max_items=2) == (2, False)
    assert frames.parse_index(raw[frames.HEAD :], 2, max_item_bytes=20) == [(H1, 10), (H2, 20)]


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (struct.pack("<4sI", b"KVB3", 1), "magic"),
        (struct.pack("<4sI", b"KVK1", 1), "magic"),
        (struct.pack("<4sI", b"KVB1", 0), "1 to 4"),
        (struct.pack("<4sI", b"KVB2", 5), "1 to 4"),
    ],
)
def test_bad_heads(head: bytes, why: str):
    with pytest.raises(BadFrame, match=why):
        frames.parse_upload_head(head, max_items=4)


@pytest.mark.parametrize(
    ("items", "why"),
    [
        ([(H1, 0)], "1 to 100"),
        ([(H1, 101)], "1 to 100"),
        ([(H1, 5), (H1, 5)], "twice"),
    ],
)
def test_bad_indexes(items: list[tuple[bytes, int]], why: str):
    raw = frames.encode_index(items)[frames.HEAD :]
    with pytest.raises(BadFrame, match=why):
        frames.parse_index(raw, len(items), max_item_bytes=100)
    sealed = frames.encode_sealed_index([(h, K1, n) for h, n in items])[frames.HEAD :]
    with pytest.raises(BadFrame, match=why):
        frames.parse_sealed_index(sealed, len(items), max_item_bytes=100)
    assert issubclass(BadFrame, InvalidRequest)  # a typed 4xx (400), never a 500


async def _parts(*chunks: bytes) -> AsyncIterator[bytes]:
    for c in chunks:
        yield c


async def test_reader_fills_buffers_across_parts_and_refuses_short_or_long_bodies():
    r = frames.Reader(_parts(b"ab", b"", b"cdef", b"g"))
    out = memoryview(bytearray(5))
    await r.into(out)
    assert bytes(out) == b"abcde"
    assert bytes(await r.read(2)) == b"fg"
    await r.end()  # positive control: nothing follows
    with pytest.raises(BadFrame, match="ends inside"):
        await frames.Reader(_parts(b"abc")).read(4)
    long = frames.Reader(_parts(b"abc", b"d"))
    await long.read(3)
    with pytest.raises(BadFrame, match="runs on"):
        await long.end()


async def test_keyed_head_and_items_round_trip():
    """The keyed download (KVK1): its head names the chunk size and scope; an item carries the
    envelope's key version, salt, key and storage key before its length; no key is all zeros."""
    head = frames.keyed_head(256, "acme", "déjà-vu")
    assert await frames.read_keyed_head(frames.Reader(_parts(head[:5], head[5:]))) == (256, "acme", "déjà-vu")
    salt, key, sk = b"\x03" * 32, b"\x04" * 32, b"\x05" * 32
    raw = frames.keyed_item_head(H1, frames.OK, 1234, key_version=7, salt=salt, key=key, storage_key=sk)
    assert len(raw) == frames.KEYED_ITEM_HEAD == 141
    item = frames.parse_keyed_item_head(raw)
    assert (item.chained_hash, item.status, item.key_version, item.salt, item.key, item.storage_key, item.length) == (
        H1, frames.OK, 7, salt, key, sk, 1234,
    )
    assert repr(key) not in repr(item) and " key=" not in repr(item)  # the key stays out of logs
    for status in (frames.KEY_UNAVAILABLE, frames.MISSING):  # items that end a prefix: no key, no envelope
        end = frames.parse_keyed_item_head(frames.keyed_item_head(H2, status))
        assert (end.chained_hash, end.status, end.length, end.key, end.salt) == (H2, status, 0, bytes(32), bytes(32))


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (frames.MAGIC + b"\x00" * 8, "KVK1"),  # an upload frame's head where a download's was expected
        (struct.pack("<4sIHH", b"KVK1", 16, 2000, 1) + b"a" * 2001, "too long"),
        (struct.pack("<4sIHH", b"KVK1", 16, 2, 1) + b"\xff\xfeb", "UTF-8"),
    ],
)
async def test_bad_keyed_heads(head: bytes, why: str):
    with pytest.raises(BadFrame, match=why):
        await frames.read_keyed_head(frames.Reader(_parts(head)))
