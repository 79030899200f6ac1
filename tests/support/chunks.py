"""Chunk traffic on a live server through the routes a worker uses, for tests and probes.

``PUT /v1/chunks`` stores a frame of envelopes (all or none), ``POST /v1/lookup`` says which
leading chunks are stored and where, ``POST /v1/chunks/fetch`` streams the stored prefix back
(frame ``KVK1``: each envelope after its opening key) and an admin's ``POST /v1/admin/clear``
of scope ``chunks`` removes chunks. ``frame`` and ``parse_fetch`` are plain functions, so a
synchronous client uses them too; the ``async`` helpers take an ``httpx.AsyncClient`` and the
caller's headers (bearer token and capability).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from gateway.protocol import frames

__all__ = [
    "BATCH",
    "Fetched",
    "envelope",
    "fetch",
    "frame",
    "parse_fetch",
    "post_fetch",
    "remove",
    "store",
    "stored",
    "where",
]

BATCH = "application/octet-stream"


def frame(items: Sequence[tuple[str, bytes]]) -> bytes:
    """The body of ``PUT /v1/chunks`` for ``(hash hex, envelope)`` items."""
    return frames.encode_index([(bytes.fromhex(h), len(e)) for h, e in items]) + b"".join(e for _h, e in items)


async def store(http: httpx.AsyncClient, headers: dict[str, str], items: Sequence[tuple[str, bytes]]) -> httpx.Response:
    """``PUT /v1/chunks`` with one frame of ``items`` (204: all of them stored)."""
    return await http.put("/v1/chunks", content=frame(items), headers={**headers, "Content-Type": BATCH})


async def where(http: httpx.AsyncClient, headers: dict[str, str], chunk_hash: str) -> list[str]:
    """The tiers that hold ``chunk_hash`` (op ``lookup``); empty where it is not stored."""
    r = await http.post("/v1/lookup", json={"hashes": [chunk_hash]}, headers=headers)
    assert r.status_code == 200, (r.status_code, r.text)
    body = r.json()
    return list(body["locations"][0]) if body["hit_chunks"] else []


async def stored(http: httpx.AsyncClient, headers: dict[str, str], hashes: Sequence[str]) -> list[bool]:
    """Whether each chunk is stored, asked one hash at a time (a prefix lookup stops at the first
    miss)."""
    return [bool(await where(http, headers, h)) for h in hashes]


@dataclass(frozen=True)
class Fetched:
    """A parsed fetch response: the capability's scope and every item with its envelope bytes
    (none for an item that ends the prefix or whose envelope went into a shared-memory window)."""

    chunk_tokens: int
    tenant: str
    namespace: str
    items: list[tuple[frames.KeyedItem, bytes]]

    @property
    def statuses(self) -> list[int]:
        return [item.status for item, _e in self.items]

    def envelopes(self) -> list[bytes]:
        """The envelopes of the stored prefix (the items of status ``OK``), in order."""
        return [e for item, e in self.items if item.status == frames.OK]


def parse_fetch(raw: bytes) -> Fetched:
    """Every item of a ``KVK1`` frame; an ``AssertionError`` where the frame is not whole."""
    view = memoryview(raw)
    chunk_tokens, t_len, n_len = frames.parse_keyed_head(view[: frames.KEYED_HEAD])
    off = frames.KEYED_HEAD
    tenant = frames.decode_name(view[off : off + t_len])
    namespace = frames.decode_name(view[off + t_len : off + t_len + n_len])
    off += t_len + n_len
    items: list[tuple[frames.KeyedItem, bytes]] = []
    while off < len(view):
        assert off + frames.KEYED_ITEM_HEAD <= len(view), "the frame ends inside an item head"
        item = frames.parse_keyed_item_head(view[off : off + frames.KEYED_ITEM_HEAD])
        off += frames.KEYED_ITEM_HEAD
        body = b"" if item.status == frames.IN_REGION else bytes(view[off : off + item.length])
        assert len(body) == (0 if item.status == frames.IN_REGION else item.length), "the frame ends inside an envelope"
        off += len(body)
        items.append((item, body))
    return Fetched(chunk_tokens, tenant, namespace, items)


async def post_fetch(http: httpx.AsyncClient, headers: dict[str, str], hashes: Sequence[str]) -> httpx.Response:
    """``POST /v1/chunks/fetch`` as a worker loads (op ``get``, keys in the stream), unparsed."""
    return await http.post("/v1/chunks/fetch", json={"hashes": list(hashes), "keys": True}, headers=headers)


async def fetch(http: httpx.AsyncClient, headers: dict[str, str], hashes: Sequence[str]) -> Fetched:
    """The stored prefix of ``hashes``, parsed (an ``AssertionError`` for any answer but 200)."""
    r = await post_fetch(http, headers, hashes)
    assert r.status_code == 200, (r.status_code, r.text)
    assert r.headers["content-type"].startswith(BATCH)
    return parse_fetch(r.content)


async def envelope(http: httpx.AsyncClient, headers: dict[str, str], chunk_hash: str) -> bytes | None:
    """The stored envelope of ``chunk_hash``, or None where the fetch answers it missing."""
    got = await fetch(http, headers, [chunk_hash])
    assert len(got.items) == 1, got.statuses
    item, body = got.items[0]
    if item.status == frames.MISSING:
        return None
    assert item.status == frames.OK and item.chained_hash.hex() == chunk_hash, item
    return body


async def remove(
    http: httpx.AsyncClient, admin_headers: dict[str, str], tenant: str, namespace: str, hashes: Sequence[str],
) -> httpx.Response:
    """A secure clear of ``hashes`` in one namespace (an admin's bearer token in ``admin_headers``)."""
    body = {"scope": "chunks", "tenant": tenant, "namespace": namespace, "hashes": list(hashes)}
    return await http.post("/v1/admin/clear", json=body, headers=admin_headers)
