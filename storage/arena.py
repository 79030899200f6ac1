"""The memory tier's arena: one anonymous mapping, carved into extents, reused in place.

The region is mapped once (``prefault=True`` adds ``MAP_POPULATE``; ``huge_pages=True`` asks for
transparent huge pages), so in steady state an envelope lands in pages already there: no
allocation and no page fault per chunk. Allocation is best fit over coalescing holes (64-byte
aligned); under fragmentation :meth:`Arena.compact` slides unleased extents to the start, and only
then does an extent come from the heap (counted in ``overflow``). The arena never refuses: the
memory tier bounds the bytes held with its budget.

``shared=True`` backs the region with a memfd (``MAP_SHARED``, sealed against shrinking and
growing) whose descriptor ``fd`` can be handed to another process to map read-only; freed bytes of
such a region stay resident until :meth:`Arena.trim` punches them out, and :meth:`Arena.ahead`
names free pages with no memory behind them yet, in the order allocations would take them, for a
caller to fault in ahead of the stores that will write there.

Invariants: a view from :meth:`Arena.lease` keeps its extent *leased* while it or anything derived
from it lives. A leased extent is never moved; one released by its owner while leased becomes a
*zombie* (bytes unchanged, in no free list) until the last lease dies. So one buffer is never
handed to two live envelopes, and a reader's view never changes under it.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import weakref
from dataclasses import dataclass

import numpy as np

__all__ = ["Arena", "ArenaStats", "Extent"]

ALIGN = 64
_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = 0x4000  # Linux; a lazily faulted region is not charged up front


def _round(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class Extent:
    """One envelope's bytes: ``offset`` into the region, or -1 for a heap fallback in ``heap``."""

    __slots__ = ("heap", "leases", "nbytes", "offset", "owned")

    def __init__(self, offset: int, nbytes: int, heap: np.ndarray | None = None) -> None:
        self.offset = offset
        self.nbytes = nbytes
        self.heap = heap
        self.leases: list[weakref.ref[np.ndarray]] = []
        self.owned = True  # False once the owner released it (a zombie while leased)

    @property
    def span(self) -> int:
        return _round(max(1, self.nbytes)) if self.offset >= 0 else 0

    def leased(self) -> bool:
        alive = [r for r in self.leases if r() is not None]
        self.leases = alive
        return bool(alive)


@dataclass(frozen=True, slots=True)
class ArenaStats:
    region_bytes: int
    extents: int
    free_bytes: int
    largest_hole: int
    zombie_bytes: int
    overflow: int  # extents that came from the heap because no hole fitted
    compactions: int


class Arena:
    """A fixed region of ``nbytes`` (rounded up to whole pages). Not thread-safe: one event loop
    allocates; other threads may only read or write the views they were handed."""

    def __init__(self, nbytes: int, *, prefault: bool = False, huge_pages: bool = False, shared: bool = False) -> None:
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise ValueError("arena size must be a non-negative int")
        self.size = max(_PAGE, _round(nbytes, _PAGE))
        self.fd = -1  # the memfd of a shared arena
        # bytes of free holes that may have memory behind them: freed since the last trim (a shared
        # arena keeps them resident until then), or named by ``ahead`` to be faulted in
        self.dirty = 0
        self.trims = 0  # trims so far: a change tells a populating thread that its pages went
        self._last_span = 0  # the span of the last allocation from the region
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        flags |= mmap.MAP_POPULATE if prefault else _MAP_NORESERVE
        if shared:
            self.fd = _memfd(self.size)
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
        try:
            self._map: mmap.mmap | None = mmap.mmap(self.fd, self.size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            if self.fd >= 0:
                os.close(self.fd)
            raise
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self._buf = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._buf.ctypes.data
        self._holes: dict[int, int] = {0: self.size}  # start -> size
        self._ends: dict[int, int] = {self.size: 0}  # end -> start
        self._extents: dict[int, Extent] = {}  # region extents not yet free, by offset
        self._zombies: list[Extent] = []
        self.overflow = 0
        self.compactions = 0

    # -- allocation ----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> Extent:
        """An extent of exactly ``nbytes`` (its contents are whatever was there)."""
        self.sweep()
        span = _round(max(1, nbytes))
        start = self._best_fit(span)
        if start is None and self.free_bytes() >= span:
            self.compact()
            start = self._best_fit(span)
        if start is None or self._map is None:
            self.overflow += 1
            return Extent(-1, nbytes, np.empty(nbytes, dtype=np.uint8))
        self._take(start, span)
        self._last_span = span
        self.dirty = max(0, self.dirty - span)  # best fit reuses freed (still resident) bytes first
        ext = self._extents[start] = Extent(start, nbytes)
        return ext

    def release(self, ext: Extent) -> None:
        """The owner lets go: the extent is free now, or once its last lease dies."""
        if not ext.owned:
            return
        ext.owned = False
        if ext.offset < 0:
            ext.heap = None
        elif ext.leased():
            self._zombies.append(ext)
        else:
            self._free(ext)

    def sweep(self) -> None:
        """Free the zombies nobody reads any more."""
        if self._zombies:
            keep = []
            for z in self._zombies:
                if z.leased():
                    keep.append(z)
                else:
                    self._free(z)
            self._zombies = keep

    # -- views ---------------------------------------------------------------------------------
    def array(self, ext: Extent) -> np.ndarray:
        """A fresh array over the extent's bytes (the arena keeps no strong reference to it)."""
        if ext.offset < 0:
            assert ext.heap is not None
            return ext.heap[:]
        return self._buf[ext.offset : ext.offset + ext.nbytes]

    def lease(self, ext: Extent, *, writable: bool = False) -> memoryview:
        """A view that keeps the extent's bytes in place (never moved, never reused) while it,
        or anything made from it, is alive."""
        arr = self.array(ext)
        if ext.offset >= 0:
            if len(ext.leases) > 8:
                ext.leased()  # prune dead references
            ext.leases.append(weakref.ref(arr))
        view = memoryview(arr)  # type: ignore[arg-type]  # ndarray exports a buffer
        return view if writable else view.toreadonly()

    def offset_of(self, view: memoryview) -> int | None:
        """Where ``view`` (a lease of this arena) starts in the region, or None where it is not
        the whole of a region extent here (a heap fallback, another arena's, a slice)."""
        if self._map is None or view.nbytes == 0:
            return None
        at = int(np.frombuffer(view, dtype=np.uint8).ctypes.data) - self._base
        ext = self._extents.get(at)
        return at if ext is not None and ext.nbytes == view.nbytes and 0 <= at < self.size else None

    def used_span(self) -> int:
        """Bytes of the region held by extents (owned or zombie)."""
        return self.size - self.free_bytes()

    def trim(self) -> int:
        """Give the pages wholly inside free holes back to the system (``MADV_REMOVE``: a shared
        arena's freed bytes stay resident otherwise, and so does any reader's mapping of them);
        returns the bytes punched. A hole's pages fault in again when it is next used."""
        self.sweep()
        punched = 0
        if self._map is not None and self.fd >= 0:
            for start, size in list(self._holes.items()):
                lo, hi = _round(start, _PAGE), (start + size) // _PAGE * _PAGE
                if hi > lo:
                    with contextlib.suppress(OSError, ValueError):
                        self._map.madvise(mmap.MADV_REMOVE, lo, hi - lo)
                        punched += hi - lo
        self.dirty = 0
        self.trims += 1
        return punched

    def ahead(self, nbytes: int) -> list[tuple[int, int]]:
        """Up to ``nbytes`` of whole free pages of a shared arena that have no memory behind them,
        as ``(offset, length)`` ranges, in the order best fit takes holes (the smallest first,
        skipping those smaller than the last allocation); counted in ``dirty`` as if already
        resident, so the bound a trim keeps covers them once faulted in. Empty for an arena
        that is not shared (its pages cannot be told apart from here) or closed."""
        if self._map is None or self.fd < 0 or nbytes <= 0:
            return []
        self.sweep()
        ranges: list[tuple[int, int]] = []
        total = 0
        for start, size in sorted(self._holes.items(), key=lambda hole: (hole[1], hole[0])):
            if size < self._last_span:
                continue
            lo, hi = _round(start, _PAGE), (start + size) // _PAGE * _PAGE
            for a, b in _unbacked(self.fd, lo, hi):
                n = min(b - a, nbytes - total)
                ranges.append((a, n))
                total += n
                if total >= nbytes:
                    self.dirty += total
                    return ranges
        self.dirty += total
        return ranges

    # -- fragmentation -------------------------------------------------------------------------
    def compact(self) -> int:
        """Slide every owned, unleased extent towards the start; return bytes moved."""
        self.sweep()
        cursor = moved = 0
        placed: dict[int, Extent] = {}
        for off in sorted(self._extents):
            ext = self._extents[off]
            if ext.owned and not ext.leased() and off > cursor:
                ctypes.memmove(self._base + cursor, self._base + off, ext.nbytes)
                ext.offset = cursor
                moved += ext.nbytes
            placed[ext.offset] = ext
            cursor = ext.offset + ext.span
        self._extents = placed
        self._holes, self._ends = {}, {}
        cursor = 0
        for off in sorted(placed):
            if off > cursor:
                self._add_hole(cursor, off - cursor)
            cursor = off + placed[off].span
        if cursor < self.size:
            self._add_hole(cursor, self.size - cursor)
        self.compactions += 1
        return moved

    # -- bookkeeping ---------------------------------------------------------------------------
    def free_bytes(self) -> int:
        return sum(self._holes.values())

    def stats(self) -> ArenaStats:
        return ArenaStats(
            region_bytes=self.size,
            extents=len(self._extents),
            free_bytes=self.free_bytes(),
            largest_hole=max(self._holes.values(), default=0),
            zombie_bytes=sum(z.span for z in self._zombies),
            overflow=self.overflow,
            compactions=self.compactions,
        )

    @property
    def closed(self) -> bool:
        return self._map is None

    def region(self) -> np.ndarray:
        """The whole region as bytes (empty once closed), for faulting its pages in ahead of use;
        the view keeps the mapping alive while held."""
        return self._buf

    def region_extents(self) -> list[Extent]:
        """Extents in the region not yet free (owned or zombie), by offset (for tests)."""
        return [self._extents[o] for o in sorted(self._extents)]

    def close(self) -> None:
        """Drop the region. Views still held keep the mapping alive until they die."""
        self._extents.clear()
        self._zombies.clear()
        self._holes, self._ends = {}, {}
        mapping, self._map = self._map, None
        self._buf = np.empty(0, dtype=np.uint8)
        if self.fd >= 0:  # a reader's mapping of it keeps holes, never the bytes
            if mapping is not None:
                with contextlib.suppress(OSError, ValueError):
                    mapping.madvise(mmap.MADV_REMOVE)
            os.close(self.fd)
            self.fd = -1
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:  # a reader still holds a view: the GC unmaps it later
                pass

    def _best_fit(self, span: int) -> int | None:
        best: int | None = None
        best_size = 0
        for start, size in self._holes.items():
            if size >= span and (best is None or size < best_size):
                best, best_size = start, size
                if size == span:
                    break
        return best

    def _take(self, start: int, span: int) -> None:
        size = self._holes.pop(start)
        del self._ends[start + size]
        if size > span:
            self._add_hole(start + span, size - span)

    def _add_hole(self, start: int, size: int) -> None:
        self._holes[start] = size
        self._ends[start + size] = start

    def _free(self, ext: Extent) -> None:
        del self._extents[ext.offset]
        start, end = ext.offset, ext.offset + ext.span
        before = self._ends.pop(start, None)
        if before is not None:
            del self._holes[before]
            start = before
        after = self._holes.pop(end, None)
        if after is not None:
            del self._ends[end + after]
            end += after
        self._add_hole(start, end - start)
        self.dirty += ext.span
        ext.offset = -2  # freed: not in the region any more


def _unbacked(fd: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The ranges within ``[lo, hi)`` of the file ``fd`` that hold no memory (a memfd's holes, by
    ``SEEK_HOLE`` and ``SEEK_DATA``), as ``(start, end)``."""
    out: list[tuple[int, int]] = []
    at = lo
    while at < hi:
        try:
            hole = os.lseek(fd, at, os.SEEK_HOLE)
        except OSError:
            break
        if hole >= hi:
            break
        try:
            data = os.lseek(fd, hole, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past the hole
            data = hi
        end = min(data, hi)
        out.append((hole, end))
        at = end
    return out


_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


def _memfd(size: int) -> int:
    """A memfd of ``size`` bytes sealed against shrinking and growing (a process it is handed to
    cannot truncate it under the arena's writes); OSError where the system has none."""
    if not hasattr(os, "memfd_create") or not _SEALS:
        raise OSError("a shared arena needs memfd_create and file seals (Linux)")
    fd = os.memfd_create("kvgate-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
