"""The in-process memory tier: LRU within a byte budget, pins, optional per-owner fair share.

A product tier (the fastest place envelopes are kept) and also the one fake storage the tests need.
Envelopes live in a :class:`storage.arena.Arena`, so a store in steady state allocates nothing.
``put`` copies the bytes into an extent; the data path can seal straight into one instead:
``res = tier.reserve(key, nbytes)``, write ``res.view``, then ``tier.commit(res)`` (or
``tier.abort(res)``). ``get`` returns a read-only view of the extent (no copy) that stays valid and
unchanged while held (see the arena's docstring).

Invariants: ``capacity_bytes`` is never exceeded; ``get`` refreshes recency; pinned chunks are never
evicted; a put that cannot fit even after every eviction it may make raises :class:`TierFull` and
changes nothing; with ``owner_quota_bytes`` one owner cannot evict another's chunks that are within
quota (order in :mod:`storage._index`). A namespace or owner deletion cancels the reservations of
its keys: their ``commit`` stores nothing and returns False (a seal in flight cannot bring back a
cleared chunk). No method awaits, so each is atomic for coroutines sharing a loop.

``group_arenas=True`` keeps each group's (a namespace's) envelopes in an arena of its own, a memfd
(``Arena(shared=True)``) that a server can hand to that namespace's workers to map read-only and
read envelopes from in place (``group_arena``, ``locate``). One group's arena holds only that
group's envelopes. Freed bytes stay resident in their arena until trimmed: the tier trims every
arena once what they may hold resident passes the budget by an eighth, and a deleted group's or
owner's at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from storage._index import KeyIndex, byte_view
from storage.arena import Arena, ArenaStats, Extent
from storage.base import Tier
from storage.types import (
    ChunkKey,
    ChunkNotFound,
    InvalidChunk,
    StoredChunk,
    TierFull,
    TierUnavailable,
)

__all__ = ["MemoryTier", "MemoryTierStats", "Populate", "Reservation"]

# faults in the pages of the views (writable ranges of an arena), off the event loop, until done
# or ``stop()``; the thread doing it, or None where there was nothing to do
Populate = Callable[[Sequence[memoryview], Callable[[], bool]], "threading.Thread | None"]
_AHEAD_STEP = 4 << 20  # a group's arena is populated ahead only where this much is missing


@dataclass(frozen=True, slots=True)
class MemoryTierStats:
    """A snapshot of a memory tier's counters."""

    capacity_bytes: int
    owner_quota_bytes: int | None
    chunks: int
    used_bytes: int
    pinned_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected_puts: int
    owner_bytes: dict[str, int] = field(default_factory=dict)
    arena: ArenaStats | None = None
    reservations: int = 0


class Reservation:
    """An extent promised to one key: write ``view`` (exactly ``nbytes``), then hand it to
    ``commit`` or ``abort`` on the event loop. The writer may fill ``view`` on another thread."""

    __slots__ = ("cancelled", "done", "extent", "key", "nbytes", "view")

    def __init__(self, key: ChunkKey, extent: Extent, view: memoryview) -> None:
        self.key = key
        self.nbytes = extent.nbytes
        self.view = view
        self.extent = extent
        self.cancelled = False
        self.done = False


class MemoryTier(Tier):
    """Envelopes in process memory, LRU within ``capacity_bytes``."""

    name = "memory"

    def __init__(
        self,
        capacity_bytes: int,
        *,
        owner_quota_bytes: int | None = None,
        prefault: bool = False,
        huge_pages: bool = False,
        group_arenas: bool = False,
        ahead_bytes: int = 0,
        populate: Populate | None = None,
    ) -> None:
        if capacity_bytes is None:
            raise ValueError("MemoryTier needs a capacity_bytes budget")
        self._index = KeyIndex(capacity_bytes, owner_quota_bytes)
        # room for the 64-byte alignment of each extent beside the budget
        self._arena_bytes = capacity_bytes + min(capacity_bytes // 16, 64 << 20)
        self._huge_pages = huge_pages
        self._group_arenas: dict[str, Arena] | None = {} if group_arenas else None
        # a group's arena is reserved virtual memory: only ``ahead_bytes`` of it are populated
        # ahead of its stores, and only while the arenas stay within the trim bound
        self._ahead_bytes = max(0, ahead_bytes) if populate is not None else 0
        self._populate = populate
        self._populating: dict[str, threading.Thread] = {}
        self._arena = Arena(0 if group_arenas else self._arena_bytes, prefault=prefault and not group_arenas, huge_pages=huge_pages)
        self._data: dict[ChunkKey, Extent] = {}
        self._reservations: set[Reservation] = set()
        self._closed = False
        self._hits = self._misses = self._puts = self._evictions = self._rejected = 0

    # -- the Tier interface --------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> StoredChunk:
        self._check_open()
        ext = self._data.get(key)
        if ext is None:
            self._misses += 1
            raise ChunkNotFound(key, self.name)
        self._hits += 1
        self._index.touch(key)
        return StoredChunk(key=key, data=self._arena_of(key).lease(ext), tier=self.name)

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        view = byte_view(key, data)
        self._make_room(key, view.nbytes)
        arena = self._arena_of(key)
        old = self._data.pop(key, None)
        if old is not None:  # its room goes to the new value (a reader's view keeps it a zombie)
            arena.release(old)
        ext = arena.alloc(view.nbytes)
        if view.nbytes:
            np.copyto(arena.array(ext), np.frombuffer(view, dtype=np.uint8))
        self._install(key, ext)
        if self._group_arenas is not None:
            self._ahead(key.group)

    # -- sealing straight into the arena -------------------------------------------------------
    def reserve(self, key: ChunkKey, nbytes: int) -> Reservation:
        """Claim an extent of exactly ``nbytes`` for ``key`` (evicting as a put would, or
        TierFull changing nothing). Nothing is visible until ``commit``."""
        self._check_open()
        if not isinstance(key, ChunkKey):
            raise InvalidChunk(f"key must be a ChunkKey, not {type(key).__name__}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise InvalidChunk("nbytes must be a non-negative int")
        held = self._index.size(key) if key in self._index else 0
        if held and nbytes + held <= (self._index.capacity or 0):
            self._make_room(key, nbytes + held)  # the old value stays readable until commit
        else:
            if held:  # both cannot fit at once: the old value goes now
                self._drop(key)
            self._make_room(key, nbytes)
        arena = self._arena_of(key)
        ext = arena.alloc(nbytes)
        self._index.reserved += nbytes
        by_owner = self._index.reserved_by_owner
        by_owner[key.owner] = by_owner.get(key.owner, 0) + nbytes
        res = Reservation(key, ext, arena.lease(ext, writable=True))
        self._reservations.add(res)
        return res

    def commit(self, res: Reservation) -> bool:
        """Make a reservation's bytes the key's value; False (nothing stored) if it was cancelled
        by a deletion or the tier closed, or if its room is gone (every byte pinned since)."""
        if not self._finish(res):
            return False
        try:
            self._make_room(res.key, res.nbytes)
        except TierFull:
            self._release(res.key, res.extent)
            return False
        self._install(res.key, res.extent)
        self._ahead(res.key.group)
        return True

    def abort(self, res: Reservation) -> None:
        """Give a reservation back (its extent is reused once the writer's views are gone)."""
        if self._finish(res):
            self._release(res.key, res.extent)

    def _finish(self, res: Reservation) -> bool:
        if res.done:
            raise ValueError("this reservation was already committed or aborted")
        res.done = True
        self._reservations.discard(res)
        try:
            res.view.release()  # best effort: the writer's own slices stay theirs
        except BufferError:
            pass
        if self._closed:
            return False
        self._index.reserved -= res.nbytes
        by_owner = self._index.reserved_by_owner
        left = by_owner.get(res.key.owner, 0) - res.nbytes
        if left > 0:
            by_owner[res.key.owner] = left
        else:
            by_owner.pop(res.key.owner, None)
        if res.cancelled:
            self._release(res.key, res.extent)
            return False
        return True

    def _make_room(self, key: ChunkKey, nbytes: int) -> None:
        try:
            victims = self._index.plan_eviction(key, nbytes)
        except TierFull:
            self._rejected += 1
            raise
        for victim in victims:
            self._drop(victim)
        self._evictions += len(victims)
        if victims:
            self._trim(keep=key.group)

    def _install(self, key: ChunkKey, ext: Extent) -> None:
        old = self._data.get(key)
        if old is not None and old is not ext:
            self._release(key, old)
        self._data[key] = ext
        self._index.add(key, ext.nbytes)
        self._puts += 1

    def _cancel(self, *, key: ChunkKey | None = None, group: str | None = None, owner: str | None = None) -> None:
        for res in self._reservations:
            if res.key == key or res.key.group == group or res.key.owner == owner:
                res.cancelled = True

    async def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        self._cancel(key=key)
        if key not in self._data:
            return False
        self._drop(key)
        return True

    async def contains(self, key: ChunkKey) -> bool:
        self._check_open()
        return key in self._data

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        return [k in self._data for k in keys]

    async def delete_group(self, group: str) -> int:
        self._check_open()
        self._cancel(group=group)
        keys = self._index.group_keys(group)
        for key in keys:
            self._drop(key)
        arena = (self._group_arenas or {}).get(group)
        if arena is not None:  # nothing of the group's is left resident but what a reader holds
            arena.trim()
        return len(keys)

    async def delete_owner(self, owner: str) -> int:
        self._check_open()
        self._cancel(owner=owner)
        keys = self._index.owner_keys(owner)
        for key in keys:
            self._drop(key)
        for group in {key.group for key in keys}:  # nothing of the owner's left resident but what a reader holds
            arena = (self._group_arenas or {}).get(group)
            if arena is not None:
                arena.trim()
        return len(keys)

    async def pin(self, key: ChunkKey) -> None:
        self._check_open()
        if key not in self._data:
            raise ChunkNotFound(key, self.name)
        self._index.pin(key)

    async def unpin(self, key: ChunkKey) -> None:
        self._check_open()
        self._index.unpin(key)

    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        self._check_open()
        return list(self._data) if group is None else self._index.group_keys(group)

    @property
    def used_bytes(self) -> int:
        return self._index.used

    async def aclose(self) -> None:
        """Drop every reference held; later calls raise TierUnavailable. Idempotent."""
        self._closed = True
        for res in self._reservations:
            res.cancelled = True
        self._data.clear()
        self._index.clear()
        self._arena.close()
        for arena in (self._group_arenas or {}).values():
            arena.close()

    # -- extras --------------------------------------------------------------------------------
    def is_pinned(self, key: ChunkKey) -> bool:
        return self._index.is_pinned(key)

    def stats(self) -> MemoryTierStats:
        index = self._index
        return MemoryTierStats(
            capacity_bytes=index.capacity or 0,
            owner_quota_bytes=index.owner_quota,
            chunks=len(index),
            used_bytes=index.used,
            pinned_bytes=index.pinned_bytes,
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            rejected_puts=self._rejected,
            owner_bytes=index.owner_bytes(),
            arena=self._arena.stats(),
            reservations=len(self._reservations),
        )

    @property
    def arena(self) -> Arena:
        """The arena of every group's envelopes (an empty one with ``group_arenas``)."""
        return self._arena

    @property
    def group_arenas(self) -> bool:
        return self._group_arenas is not None

    def group_arena(self, group: str) -> Arena:
        """The arena of ``group``'s envelopes (made, empty, where it has none yet); ValueError
        without ``group_arenas``."""
        self._check_open()
        if self._group_arenas is None:
            raise ValueError("this memory tier keeps every group's envelopes in one arena")
        arena = self._group_arenas.get(group)
        if arena is None:
            arena = self._group_arenas[group] = Arena(self._arena_bytes, huge_pages=self._huge_pages, shared=True)
            self._ahead(group)
        return arena

    def locate(self, group: str, data: memoryview) -> int | None:
        """Where ``data`` (a view ``get`` returned) lies in ``group``'s arena, or None where it is
        not there (another group's envelope, another tier's buffer, no group arenas)."""
        arenas = self._group_arenas
        arena = arenas.get(group) if arenas is not None else None
        return arena.offset_of(data) if arena is not None else None

    def _arena_of(self, key: ChunkKey) -> Arena:
        return self._arena if self._group_arenas is None else self.group_arena(key.group)

    def _release(self, key: ChunkKey, ext: Extent) -> None:
        self._arena_of(key).release(ext)

    def _trim(self, keep: str) -> None:
        """With group arenas: once the bytes they may hold resident (in use, or freed since their
        last trim) pass the budget by an eighth, punch out the free holes of the other arenas, and
        of ``keep``'s (the group whose store is making room) only where that is not enough. The
        holes a store's own evictions just freed are where its extent goes next: punched, each of
        their pages would be allocated and zeroed again under the store's seals."""
        arenas = self._group_arenas
        if not arenas:
            return
        capacity = self._index.capacity or 0
        bound = capacity + capacity // 8

        if self._resident() <= bound:
            return
        for group, arena in arenas.items():
            if group != keep:
                arena.trim()
        if keep in arenas and self._resident() > bound:
            arenas[keep].trim()

    def _resident(self) -> int:
        """The bytes the group arenas may hold resident: in use, or free and not trimmed since."""
        return sum(a.used_span() + a.dirty for a in (self._group_arenas or {}).values())

    def _ahead(self, group: str) -> None:
        """Populate up to ``ahead_bytes`` of ``group``'s arena's free pages ahead of its next store,
        where it holds fewer free resident bytes than that, no store of the group is still sealing
        and no populating of it is still running, within the trim bound (``_trim``)."""
        arena = (self._group_arenas or {}).get(group)
        if arena is None or self._populate is None or self._ahead_bytes <= 0:
            return
        running = self._populating.get(group)
        if (running is not None and running.is_alive()) or any(r.key.group == group for r in self._reservations):
            return
        capacity = self._index.capacity or 0
        want = min(self._ahead_bytes, capacity + capacity // 8 - self._resident()) - arena.dirty
        if want < _AHEAD_STEP:
            return
        ranges = arena.ahead(want)
        if not ranges:
            return
        region, trims = arena.region(), arena.trims
        views = [memoryview(region[offset : offset + n]) for offset, n in ranges]  # type: ignore[arg-type]
        thread = self._populate(views, lambda: arena.closed or arena.trims != trims)
        if thread is not None:
            self._populating[group] = thread

    def _drop(self, key: ChunkKey) -> None:
        self._release(key, self._data.pop(key))
        self._index.remove(key)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the memory tier is closed")
