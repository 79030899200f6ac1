"""The batched remote data plane: a prefix's envelopes in one request each way.

``open_upload`` starts an upload batch once the capability was checked for every chunk named,
every size against ``max_chunk_bytes`` and every storage key the items were sealed for against
the namespace's now (``NamespaceChanged`` where a clear ended that epoch); each envelope is read
into its own buffer, a reserved extent of the memory tier where it hands one out.
``UploadBatch.commit`` checks every envelope's header, stores them all, then checks the epoch
again (``NamespaceChunks.confirm``); a client gone, a torn frame, a bad header or a clear leaves
nothing in any tier, and a tier failing mid-batch refuses it whole (a copy on a tier that cannot
be reached stays, counted as left). ``fetch_prefix`` is the download side, the prefix walk folded
in: each chunk is yielded as its tier hands it over, with its opening key
(``gateway.chunks.envelopes.KeyIssue``), up to the first that is not stored (or whose key version
is destroyed). Framing (``gateway.protocol.frames``) and HTTP stay in ``gateway.server.data``.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

import numpy as np

from audit.types import Actor
from crypto.envelope import read_header
from crypto.errors import DecryptionFailed
from gateway.chunks.envelopes import EnvelopeKey, EnvelopePlane
from gateway.chunks.service import ChunkStats, FetchFailed, NamespaceChunks
from gateway.errors import BadFrame, NamespaceChanged
from gateway.logs import RateLimitedLogger
from gateway.metrics import LoadReason
from storage.memory import Reservation
from storage.types import StoredChunk, TierError, failure_reason

__all__ = ["PrefixItem", "UploadBatch", "fetch_prefix", "open_upload"]

log = logging.getLogger("kvgate.server")
_degraded_log = RateLimitedLogger(log)  # an outage degrades every fetch: one line per interval


class UploadBatch:
    """The buffers of one upload batch (``views``, in index order), all stored or none."""

    def __init__(self, opened: NamespaceChunks, sizes: Sequence[int]) -> None:
        self._opened = opened
        self._slots: list[Reservation | None] = []
        self._stored: set[int] = set()
        self.sizes = list(sizes)
        self.views: list[memoryview] = []  # a committed extent's view is released by the tier
        self._done = False
        try:
            for i, n in enumerate(self.sizes):
                slot = opened.reserve(i, n)  # None where there is no room: a buffer of its own
                self._slots.append(slot)
                self.views.append(slot.view if slot is not None else np.empty(n, dtype=np.uint8).data.cast("B"))
        except BaseException:
            self.abort()
            raise

    async def commit(self, only: Sequence[int] | None = None, *, last: bool = True) -> list[list[str]]:
        """Check the envelopes' headers, then store them all; the tiers that took each. ``only``:
        the items to store now (every one by default), of a batch whose envelopes were written in
        place (``gateway.server.shm``); with ``last`` the items not stored are given back and the
        batch ends, else they stay reserved for a later call. A bad header ends the batch with
        nothing more stored (BadFrame)."""
        if self._done:
            raise RuntimeError("this batch was already committed or aborted")
        ks = list(range(len(self.views))) if only is None else list(only)
        if len(set(ks)) != len(ks) or any(not 0 <= k < len(self.views) or k in self._stored for k in ks):
            self.abort()
            raise BadFrame("an item is named twice, out of range, or stored already")
        for k in ks:
            try:
                header = read_header(self.views[k])
            except DecryptionFailed:
                self.abort()
                raise BadFrame(f"item {k} is not a kvgate envelope") from None
            if header.envelope_length != self.views[k].nbytes:
                self.abort()
                raise BadFrame(f"item {k}: the envelope length does not match its header")
        self._done = last
        opened = self._opened
        written: list[list[str]] = []
        try:
            for k in ks:
                slot = self._slots[k]
                self._stored.add(k)
                if slot is not None:
                    self._slots[k] = None
                    got = await opened.commit(slot)
                else:
                    got = await opened.put(k, self.views[k].toreadonly())
                written.append(got)
        except TierError:
            # no tier took envelope k: the batch is refused whole, so what it stored is removed
            # (and envelope k, whose write may have landed before the tier failed)
            upto = ks[: len(written) + 1]
            if left := await opened.roll_back(upto):
                log.warning("a refused batch left %d of its %d envelopes in a tier that could not be reached", left, len(upto))
            self._done = True
            raise
        finally:
            if self._done:
                self._release()
        try:
            await opened.confirm()  # a clear that ended the epoch meanwhile: the batch is taken back
        except NamespaceChanged:
            opened.counts.namespace_changed()
            self.abort()
            raise
        for got, k in zip(written, ks):
            if got:
                opened.counts.stored(1, self.sizes[k])
        return written

    @property
    def done(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Give every reserved extent back; nothing more of the batch is stored."""
        self._done = True
        self._release()

    def _release(self) -> None:
        for k, slot in enumerate(self._slots):
            if slot is not None:
                self._slots[k] = None
                self._opened.abort(slot)


async def open_upload(
    plane: EnvelopePlane, token: str, items: Sequence[tuple[bytes, int]], sealed_for: Sequence[str] | None = None,
) -> UploadBatch:
    """An upload batch of ``(chained hash, envelope length)`` items, after the capability was
    checked for op ``put`` on every hash (AccessDenied: nothing read, nothing reserved).
    ``sealed_for``: the storage key (hex) each item names, the one issued with its sealing key;
    where one is not the namespace's now, its envelope binds a storage key of an epoch a clear has
    ended (it could only ever fail authentication): ``NamespaceChanged``, nothing reserved.
    None (an older worker's frame): not checked."""
    opened = await plane.opened(token, "put", [h.hex() for h, _n in items])
    for _h, n in items:
        if n > plane.max_chunk_bytes:
            raise BadFrame("an envelope is larger than the configured limit")
    if sealed_for is not None and any(k.digest != s for k, s in zip(opened.keys, sealed_for, strict=True)):
        opened.counts.namespace_changed()
        raise NamespaceChanged()
    return UploadBatch(opened, [n for _h, n in items])


@dataclass(frozen=True, slots=True)
class PrefixItem:
    """One answer of the prefix walk: ``found`` is None where the walk ended (``reason``:
    ``missing``, ``tier_unavailable`` or ``tier_timeout`` where a tier could not answer, or not in
    time, ``key_unavailable`` where the envelope's key version is destroyed); ``key`` is the
    envelope's opening key (None with ``reason`` ``unkeyed``: its header does not parse)."""

    chained_hash: bytes
    found: StoredChunk | None
    reason: str = ""
    key: EnvelopeKey | None = None


async def fetch_prefix(
    plane: EnvelopePlane, token: str, hashes: Sequence[str], *, actor: Actor | None = None,
    opened: NamespaceChunks | None = None,
) -> AsyncGenerator[PrefixItem, None]:
    """The stored prefix of ``hashes``, chunk by chunk as each tier hands it over, each with the
    key that opens it; the capability is checked for op ``get`` on every hash and the key budget
    charged before the first is read. ``opened``: the session of ``hashes`` the caller opened
    already (with the published prefix it reads: each key is then its chunk's namespace's)."""
    if opened is None:
        opened = await plane.opened(token, "get", hashes)
    issue = await plane.begin_issue(opened.cap, "open", len(hashes), actor=actor, route="/v1/chunks/fetch", ns=opened.ns)
    counts = opened.counts
    passed_over: list[TierError] = []  # faster tiers that failed before a slower one served
    try:
        for i, h in enumerate(hashes):
            chained = bytes.fromhex(h)
            try:
                got = await opened.fetch(i)
            except FetchFailed as exc:
                yield _ended(counts, chained, exc.reason)
                return
            found = got.chunk
            passed_over += got.passed_over
            try:
                header = read_header(found.data)
            except DecryptionFailed:  # handed over keyless: it fails to open, and ends the walk
                _count_out(counts, found)
                yield PrefixItem(chained, found, "unkeyed")
                return
            opening = await issue.open(h, chained, header.key_version, header.salt, ns=opened.owner_of(i))
            if opening.key is None:  # its key version is destroyed: a miss, the end of the prefix
                yield _ended(counts, chained, "key_unavailable")
                return
            _count_out(counts, found)
            yield PrefixItem(chained, found, key=opening)
        counts.load_hit()  # one per fetch that served every chunk asked for, as a retrieve counts in process
    finally:
        issue.close()  # one key.issue event per fetch, with the keys that were issued
        degraded = failure_reason(passed_over)
        if degraded:
            counts.load_degraded(degraded)
            _degraded_log.warning("a fetch was served by a slower tier because a faster one failed: %s", degraded)


def _ended(counts: ChunkStats, chained: bytes, reason: LoadReason) -> PrefixItem:
    """The item that ends a walk (``reason`` as ``FetchFailed``'s, or ``key_unavailable``; a miss
    is ``missing`` in the item), counted as a load that ended early."""
    counts.load_ended(reason)
    return PrefixItem(chained, None, "missing" if reason == "miss" else reason)


def _count_out(counts: ChunkStats, found: StoredChunk) -> None:
    counts.loaded(1, found.nbytes)
