"""The local disk tier: one file per chunk, atomic writes, an in-memory index rebuilt at start.

File layout, header and the write protocol are in :mod:`storage._diskio`: a crash never leaves a
torn chunk, and a file whose payload checksum fails (truncation, bit rot; not tampering, which is
the cipher's job) is treated as absent, deleted and counted.

One ``DiskTier`` owns its root: its index (sizes, recency, pins) is rebuilt by scanning the root in
:meth:`DiskTier.start` (or ``await DiskTier.open(root)``, or ``async with DiskTier(root)``). Keys
the index does not know are looked for on disk and indexed where found, so processes sharing a root
see each other's chunks. Pins are kept in memory only. Blocking I/O runs in worker threads. Each
key's operations are serialised by a lock; ``delete_group`` / ``delete_owner`` hold new puts to
that label back until done and also remove files the index does not know, since they back secure
clear. ``capacity_bytes`` (optional) bounds the bytes of chunk files (header included), evicting
the least recently used unpinned chunks; a put that cannot fit raises TierFull and changes nothing.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage import _diskio
from storage._index import KeyIndex, byte_view
from storage._keylocks import KeyLocks
from storage.base import Tier
from storage.types import (
    ChunkKey,
    ChunkNotFound,
    StoredChunk,
    TierFull,
    TierUnavailable,
)

__all__ = ["DiskTier", "DiskTierStats"]


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    """A snapshot of a disk tier's counters."""

    capacity_bytes: int | None
    chunks: int
    used_bytes: int
    pinned_bytes: int
    hits: int
    misses: int
    puts: int
    evictions: int
    rejected_puts: int
    corrupt_removed: int
    temp_removed: int


class DiskTier(Tier):
    """Envelopes as files under ``root``."""

    name = "disk"

    def __init__(
        self,
        root: Path | str,
        *,
        capacity_bytes: int | None = None,
        fsync: bool = True,
        verify_on_start: bool = False,
        temp_grace_s: float = 300.0,
        checksum: str | None = None,
    ) -> None:
        """No I/O here; call :meth:`start` (or use :meth:`open` / ``async with``).

        verify_on_start: read every file and check its checksum at start (else headers and sizes
        only; bit rot is then found at the first read). temp_grace_s: age after which a temp file
        of a writer that may still be alive counts as a crash leftover. checksum: "crc32c" or
        "sha256" for new files (default: crc32c when the package is installed).
        """
        checksum = checksum or _diskio.default_algorithm()
        if checksum not in _diskio.ALGORITHMS:
            raise ValueError(f"checksum must be one of {sorted(_diskio.ALGORITHMS)}, not {checksum!r}")
        self.checksum = checksum
        self._algo = _diskio.ALGORITHMS[checksum]
        self.root = Path(root).absolute()
        self._fsync = fsync
        self._verify_on_start = verify_on_start
        self._temp_grace_s = temp_grace_s
        self._index = KeyIndex(capacity_bytes)
        self._locks = KeyLocks()
        self._clearing: dict[tuple[str, str], asyncio.Event] = {}
        self._tasks: set[asyncio.Future[None]] = set()
        self._start_lock = asyncio.Lock()
        self._started = False
        self._closed = False
        self._n: dict[str, int] = dict.fromkeys(
            ("hits", "misses", "puts", "evictions", "rejected", "corrupt", "temp"), 0
        )

    @classmethod
    async def open(cls, root: Path | str, **kwargs: Any) -> DiskTier:
        tier = cls(root, **kwargs)
        await tier.start()
        return tier

    async def start(self) -> None:
        """Create ``root`` (0700) if needed and rebuild the index from it. Idempotent."""
        async with self._start_lock:
            if self._closed:
                raise TierUnavailable("the disk tier is closed")
            if not self._started:
                await self._start()

    async def _start(self) -> None:
        try:
            await asyncio.to_thread(self.root.mkdir, mode=0o700, parents=True, exist_ok=True)
            found = await asyncio.to_thread(
                _diskio.scan, self.root, temp_grace_s=self._temp_grace_s, verify=self._verify_on_start
            )
        except OSError as exc:
            raise TierUnavailable(f"cannot open the disk tier at {self.root}: {exc.strerror}") from exc
        for key, size, _mtime in found.entries:
            self._index.add(key, size)
        self._n["corrupt"] += found.corrupt_removed
        self._n["temp"] += found.temp_removed
        self._started = True
        cap = self._index.capacity
        if cap is not None and self._index.used > cap:  # the budget shrank since the last run
            over = self._index.used - cap
            victims = []
            for key in self._index.evictable():
                if over <= 0:
                    break
                over -= self._index.remove(key)
                victims.append(key)
            await self._unlink(victims)
            self._n["evictions"] += len(victims)

    async def __aenter__(self) -> DiskTier:
        await self.start()
        return self

    # -- the Tier interface --------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> StoredChunk:
        self._check_open()
        if key not in self._index and not await self._adopt([key]):
            self._n["misses"] += 1
            raise ChunkNotFound(key, self.name)
        path = self._path(key)
        try:
            data, _ident = await asyncio.to_thread(_diskio.read_chunk, path)
        except (FileNotFoundError, _diskio.Corrupt) as exc:
            await self._discard(key, getattr(exc, "ident", None), corrupt=isinstance(exc, _diskio.Corrupt))
            self._n["misses"] += 1
            raise ChunkNotFound(key, self.name) from None
        except OSError as exc:
            raise TierUnavailable(f"disk read failed: {exc.strerror}") from exc
        except _diskio.ChecksumUnavailable as exc:
            raise TierUnavailable(str(exc)) from exc
        self._n["hits"] += 1
        if key in self._index:
            self._index.touch(key)
        return StoredChunk(key=key, data=data, tier=self.name)

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        """Write the chunk. Cancelling the caller does not stop a put once it has begun: it runs
        to the end in its own task, so the index always matches the files."""
        self._check_open()
        view = byte_view(key, data)
        await self._wait_clearing(key)
        task = asyncio.ensure_future(self._put(key, view))
        self._tasks.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self._tasks.discard)
        await asyncio.shield(task)

    async def _put(self, key: ChunkKey, view: memoryview) -> None:
        async with self._locks.hold(key):
            self._check_open()
            size = _diskio.HEADER.size + view.nbytes
            try:
                victims = self._index.plan_eviction(key, size, skip=self._locks.busy)
            except TierFull:
                self._n["rejected"] += 1
                raise
            for victim in victims:
                self._locks.take(victim)  # free (skipped busy keys): no await, no interleaving
            try:
                for victim in victims:
                    self._index.remove(victim)
                self._index.reserved += size
                try:
                    await self._unlink(victims)
                    path = self._path(key)
                    await asyncio.to_thread(
                        _diskio.write_chunk, self.root, path, view, self._fsync, self._algo
                    )
                except OSError as exc:
                    raise TierUnavailable(f"disk write failed: {exc.strerror}") from exc
                except _diskio.ChecksumUnavailable as exc:
                    raise TierUnavailable(str(exc)) from exc
                finally:
                    self._index.reserved -= size
            finally:
                for victim in victims:
                    self._locks.release(victim)
            self._n["evictions"] += len(victims)
            self._n["puts"] += 1
            self._index.add(key, size)

    async def delete(self, key: ChunkKey) -> bool:
        self._check_open()
        async with self._locks.hold(key):
            present = key in self._index
            if present:
                self._index.remove(key)
            removed = await self._unlink([key])
        return present or removed > 0

    async def contains(self, key: ChunkKey) -> bool:
        return (await self.contains_many([key]))[0]

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self._check_open()
        unknown = [k for k in keys if k not in self._index]
        if unknown:
            await self._adopt(unknown)
        return [k in self._index for k in keys]

    async def delete_group(self, group: str) -> int:
        return await self._delete_label("g", group)

    async def delete_owner(self, owner: str) -> int:
        return await self._delete_label("o", owner)

    async def pin(self, key: ChunkKey) -> None:
        self._check_open()
        if key not in self._index:
            raise ChunkNotFound(key, self.name)
        self._index.pin(key)

    async def unpin(self, key: ChunkKey) -> None:
        self._check_open()
        self._index.unpin(key)

    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        self._check_open()
        return list(self._index) if group is None else self._index.group_keys(group)

    @property
    def used_bytes(self) -> int:
        return self._index.used

    async def aclose(self) -> None:
        """Wait for operations in flight, then forget the index (files stay). Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self.drain()
        while self._locks.held():
            for key in self._locks.held():
                async with self._locks.hold(key):
                    pass
        self._index.clear()

    # -- extras --------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Wait until the puts in flight have landed (those whose callers were cancelled too)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    def is_pinned(self, key: ChunkKey) -> bool:
        return self._index.is_pinned(key)

    def path_of(self, key: ChunkKey) -> Path:
        """Where ``key``'s file lives (for operators and tests)."""
        return self._path(key)

    def stats(self) -> DiskTierStats:
        n = self._n
        return DiskTierStats(
            capacity_bytes=self._index.capacity,
            chunks=len(self._index),
            used_bytes=self._index.used,
            pinned_bytes=self._index.pinned_bytes,
            hits=n["hits"],
            misses=n["misses"],
            puts=n["puts"],
            evictions=n["evictions"],
            rejected_puts=n["rejected"],
            corrupt_removed=n["corrupt"],
            temp_removed=n["temp"],
        )

    # -- internals -----------------------------------------------------------------------------
    def _path(self, key: ChunkKey) -> Path:
        return _diskio.chunk_path(self.root, key)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the disk tier is closed")
        if not self._started:
            raise TierUnavailable("the disk tier is not started (await tier.start() first)")

    async def _unlink(self, keys: list[ChunkKey]) -> int:
        if not keys:
            return 0
        paths = [self._path(k) for k in keys]
        try:
            return await asyncio.to_thread(_diskio.unlink_chunks, self.root, paths)
        except OSError as exc:
            raise TierUnavailable(f"disk delete failed: {exc.strerror}") from exc

    async def _adopt(self, keys: list[ChunkKey]) -> int:
        """Index the files of ``keys``, in order up to the first not on disk, that another process
        sharing the root wrote since this one's index was built (a stat each, in a thread: a
        prefix walk's lookup costs one stat where nothing is stored); how many were found. A
        broken file is caught, removed and counted when it is read."""
        sizes = await asyncio.to_thread(_diskio.leading_file_sizes, self.root, keys)
        found = 0
        for key, size in zip(keys, sizes):
            if key not in self._index and not self._locks.busy(key):
                self._index.add(key, size)
                found += 1
        return found

    async def _discard(self, key: ChunkKey, ident: tuple[int, int] | None, *, corrupt: bool) -> None:
        """Forget a key whose file is gone or broken; delete the broken file if it is still the
        one we read (a concurrent put may have replaced it)."""
        async with self._locks.hold(key):
            path = self._path(key)
            if corrupt:
                removed = await asyncio.to_thread(_diskio.unlink_chunks, self.root, [path], ident)
                self._n["corrupt"] += removed
            still_there = await asyncio.to_thread(_diskio.same_file, path, None)
            if not still_there and key in self._index:
                self._index.remove(key)

    async def _wait_clearing(self, key: ChunkKey) -> None:
        while True:
            event = self._clearing.get(("g", key.group)) or self._clearing.get(("o", key.owner))
            if event is None:
                return
            await event.wait()

    @asynccontextmanager
    async def _clearing_label(self, kind: str, label: str) -> AsyncIterator[None]:
        while (kind, label) in self._clearing:
            await self._clearing[(kind, label)].wait()
        event = self._clearing[(kind, label)] = asyncio.Event()
        try:
            yield
        finally:
            del self._clearing[(kind, label)]
            event.set()

    async def _delete_label(self, kind: str, label: str) -> int:
        self._check_open()
        async with self._clearing_label(kind, label):
            # Let puts already under way land first: new ones of this label now wait for the
            # clear (``_wait_clearing``), and every put task made before it is waited for, also
            # one not yet holding its key's lock (a lock-only wait missed those, and the clear
            # then unlinked their temp files under them).
            started = [t for t in self._tasks if not t.done()]
            if started:
                await asyncio.wait(started)
            in_flight = [k for k in self._locks.held() if (k.group if kind == "g" else k.owner) == label]
            for key in in_flight:  # an eviction's unlink still holding a victim's lock
                async with self._locks.hold(key):
                    pass
            keys = self._index.group_keys(label) if kind == "g" else self._index.owner_keys(label)
            for key in keys:
                self._index.remove(key)
            owner, group = (None, label) if kind == "g" else (label, None)
            try:
                removed = await asyncio.to_thread(_diskio.remove_labels, self.root, owner, group)
            except OSError as exc:
                raise TierUnavailable(f"disk delete failed: {exc.strerror}") from exc
        return len(removed.union(keys))


def _settled(task: asyncio.Future[None]) -> None:
    """Retrieve the outcome of a put whose caller went away (no 'never retrieved' warning)."""
    if not task.cancelled():
        task.exception()
