"""The batched remote data plane (issue 18): a prefix's envelopes in one request each way.

``open_upload`` starts an upload batch after the capability was checked for every chunk named
(the chunk allowlist included) and every size against ``max_chunk_bytes``: each envelope gets
one buffer to be read into, a reserved extent of the memory tier where it hands one out (the
bytes land where they are kept: no second copy), else a preallocated array. ``UploadBatch.commit``
checks every envelope's header before it stores any, then stores them all; ``abort`` gives every
extent back. A reserved extent is invisible until committed, so a client that disconnects, a torn
frame or a bad header leaves nothing in any tier. (Reserving makes room as a put would: a batch
that is then aborted may have evicted older chunks, as its puts would have. A tier that fails
while a checked batch is being stored -- no tier takes an envelope -- ends it with that error;
the envelopes stored before it stay, each whole.)

``fetch_prefix`` is the download side, the prefix walk folded in: it yields each chunk of the
walk as its tier hands it over (the tier's own buffer, not a copy) and stops at the first that
is not stored. With ``keys`` it also issues each envelope's opening key from the key version and
salt in its header (``gateway.envelopes.KeyIssue``: charged to the capability's budget up front
for every hash asked, what was not issued refunded and one ``key.issue`` audited when the walk
ends, however it ends); an envelope whose key version is destroyed ends the walk
(``key_unavailable``), one whose header does not parse is handed over without a key and ends it
after itself (``unkeyed``: it fails to open on the worker). Framing (``gateway.frames``) and HTTP
stay in ``gateway.server.data``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import numpy as np

from audit.types import Actor
from crypto.envelope import read_header
from crypto.errors import DecryptionFailed
from gateway.envelopes import EnvelopeKey, EnvelopePlane
from gateway.errors import BadFrame
from storage.memory import Reservation
from storage.types import ChunkKey, ChunkNotFound, StoredChunk, TierError

__all__ = ["PrefixItem", "UploadBatch", "fetch_prefix", "open_upload"]


class UploadBatch:
    """The buffers of one upload batch (``views``, in index order), all stored or none."""

    def __init__(self, plane: EnvelopePlane, keys: Sequence[ChunkKey], sizes: Sequence[int]) -> None:
        self._plane = plane
        self._keys = list(keys)
        self._slots: list[Reservation | None] = []
        self.sizes = list(sizes)
        self.views: list[memoryview] = []  # a committed extent's view is released by the tier
        self._done = False
        tiers = plane.tiers
        try:
            for key, n in zip(keys, sizes):
                slot: Reservation | None = None
                if tiers.can_reserve:
                    try:
                        slot = tiers.reserve(key, n)
                    except (TierError, TypeError, ValueError):  # no room (or pinned out): a buffer
                        slot = None
                self._slots.append(slot)
                self.views.append(slot.view if slot is not None else np.empty(n, dtype=np.uint8).data.cast("B"))
        except BaseException:
            self.abort()
            raise

    async def commit(self) -> list[list[str]]:
        """Check every envelope's header, then store them all; the tiers that took each."""
        if self._done:
            raise RuntimeError("this batch was already committed or aborted")
        for k, view in enumerate(self.views):
            try:
                header = read_header(view)
            except DecryptionFailed:
                self.abort()
                raise BadFrame(f"item {k} is not a kvgate envelope") from None
            if header.envelope_length != view.nbytes:
                self.abort()
                raise BadFrame(f"item {k}: the envelope length does not match its header")
        self._done = True
        tiers, stats = self._plane.tiers, self._plane.stats
        written: list[list[str]] = []
        try:
            for k, (key, slot, view, n) in enumerate(zip(self._keys, self._slots, self.views, self.sizes)):
                if slot is not None:
                    self._slots[k] = None
                    got = [tiers.names[0]] if await tiers.commit(slot) else []  # slower tiers: written behind it
                else:
                    got = await tiers.put(key, view.toreadonly())
                written.append(got)
                if got:
                    stats["chunks_stored"] += 1
                    stats["bytes_in"] += n
        finally:
            self._release()
        return written

    def abort(self) -> None:
        """Give every reserved extent back; nothing of the batch is stored."""
        self._done = True
        self._release()

    def _release(self) -> None:
        for k, slot in enumerate(self._slots):
            if slot is not None:
                self._slots[k] = None
                self._plane.tiers.abort(slot)


async def open_upload(plane: EnvelopePlane, token: str, items: Sequence[tuple[bytes, int]]) -> UploadBatch:
    """An upload batch of ``(chained hash, envelope length)`` items, after the capability was
    checked for op ``put`` on every hash (AccessDenied: nothing read, nothing reserved)."""
    _cap, keys = await plane.keys_for(token, "put", [h.hex() for h, _n in items])
    for _h, n in items:
        if n > plane.max_chunk_bytes:
            raise BadFrame("an envelope is larger than the configured limit")
    return UploadBatch(plane, keys, [n for _h, n in items])


@dataclass(frozen=True, slots=True)
class PrefixItem:
    """One answer of the prefix walk: ``found`` is None where the walk ended (``reason``:
    ``missing``, ``unavailable`` where a tier could not answer, ``key_unavailable`` where the
    envelope's key version is destroyed); ``key`` is the envelope's opening key where keys were
    asked for (None with ``reason`` ``unkeyed``: its header does not parse)."""

    chained_hash: bytes
    found: StoredChunk | None
    reason: str = ""
    key: EnvelopeKey | None = None


async def fetch_prefix(
    plane: EnvelopePlane, token: str, hashes: Sequence[str], *, keys: bool = False, actor: Actor | None = None,
) -> AsyncGenerator[PrefixItem, None]:
    """The stored prefix of ``hashes``, chunk by chunk as each tier hands it over; the capability
    is checked for op ``get`` on every hash (and, with ``keys``, the key budget charged) before
    the first is read."""
    cap, chunk_keys = await plane.keys_for(token, "get", hashes)
    issue = await plane.begin_issue(cap, "open", len(hashes), actor=actor, route="/v1/chunks/fetch") if keys else None
    stats = plane.stats
    try:
        for h, key in zip(hashes, chunk_keys):
            chained = bytes.fromhex(h)
            try:
                found = await plane.tiers.get(key)
            except ChunkNotFound as exc:
                stats["load_misses"] += 1
                yield PrefixItem(chained, None, "unavailable" if exc.tier_errors else "missing")
                return
            except TierError:
                stats["load_misses"] += 1
                yield PrefixItem(chained, None, "unavailable")
                return
            opening: EnvelopeKey | None = None
            if issue is not None:
                try:
                    header = read_header(found.data)
                except DecryptionFailed:  # handed over keyless: it fails to open, and ends the walk
                    _count_out(stats, found)
                    yield PrefixItem(chained, found, "unkeyed")
                    return
                opening = await issue.open(h, chained, header.key_version, header.salt)
                if opening.key is None:  # its key version is destroyed: a miss, the end of the prefix
                    stats["load_misses"] += 1
                    yield PrefixItem(chained, None, "key_unavailable")
                    return
            _count_out(stats, found)
            yield PrefixItem(chained, found, key=opening)
    finally:
        if issue is not None:
            issue.close()  # one key.issue event per fetch, with the keys that were issued


def _count_out(stats: Counter[str], found: StoredChunk) -> None:
    stats["load_hits"] += 1
    stats["chunks_loaded"] += 1
    stats["bytes_out"] += found.nbytes
