"""The batch frame (gateway.frames): what parses, and every malformed frame refused as BadFrame."""

from __future__ import annotations

import struct
from collections.abc import AsyncIterator

import pytest

from gateway import frames
from gateway.errors import BadFrame, InvalidRequest

H1, H2 = b"\x01" * 32, b"\x02" * 32


def test_index_round_trip():
    raw = frames.encode_index([(H1, 10), (H2, 20)])
    assert len(raw) == frames.HEAD + 2 * frames.INDEX_ITEM
    count = frames.parse_head(raw[: frames.HEAD], max_items=2)
    assert frames.parse_index(raw[frames.HEAD :], count, max_item_bytes=20) == [(H1, 10), (H2, 20)]
    h, status, n = frames.parse_item_head(frames.item_head(H2, frames.MISSING, 0))
    assert (h, status, n) == (H2, frames.MISSING, 0)


@pytest.mark.parametrize(
    ("head", "why"),
    [
        (struct.pack("<4sI", b"KVB2", 1), "magic"),
        (struct.pack("<4sI", b"KVB1", 0), "1 to 4"),
        (struct.pack("<4sI", b"KVB1", 5), "1 to 4"),
    ],
)
def test_bad_heads(head: bytes, why: str):
    with pytest.raises(BadFrame, match=why):
        frames.parse_head(head, max_items=4)


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
