"""The tier manager: ordered tiers (fastest first), write-through or write-back puts per tier,
first-hit gets with promotion into faster tiers, and group/owner deletion across all of them.

Write-back tiers get their copy from a background task after ``put`` returned (bounded: past
``max_pending`` queued bytes a write-back copy is dropped and counted, since a cache may always
lose a copy). ``aclose`` and ``flush`` wait for the copies in flight.

A tier that fails (TierUnavailable, or any TierError on a read) is counted and passed over: for
a cache, an unreachable tier is a miss, never an error for the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

from storage.base import Tier
from storage.types import ChunkKey, ChunkNotFound, StoredChunk, TierError, TierFull

__all__ = ["TierManager"]

log = logging.getLogger("kvgate.storage")


class TierManager:
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        promote: bool = True,
        write_back: Sequence[str] = (),
        max_pending_bytes: int = 1 << 30,
    ) -> None:
        if not tiers:
            raise ValueError("at least one tier is needed")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers: list[Tier] = list(tiers)
        self.promote = promote
        unknown = set(write_back) - set(names)
        if unknown:
            raise ValueError(f"write_back names unknown tiers: {sorted(unknown)}")
        if write_back and set(write_back) == set(names):
            raise ValueError("at least one tier must be written through")
        self.write_back = frozenset(write_back)
        self.max_pending_bytes = max_pending_bytes
        self.errors: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self._pending: set[asyncio.Task[None]] = set()
        self._pending_bytes = 0

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r} (have {[t.name for t in self.tiers]})")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview, *, only: Sequence[str] | None = None) -> list[str]:
        """Write to every tier (or those named); returns the names written. Raises the last
        error only if no tier took the chunk."""
        targets = self.tiers if only is None else [self.tier(n) for n in only]
        written: list[str] = []
        last: TierError | None = None
        if only is None and self.write_back:
            for t in [t for t in targets if t.name in self.write_back]:
                self._write_back(t, key, data)
            targets = [t for t in targets if t.name not in self.write_back]
        for t in targets:
            try:
                await t.put(key, data)
                written.append(t.name)
            except TierError as exc:
                self.errors[t.name] += 1
                last = exc
                log.warning("tier %s refused a put: %s", t.name, type(exc).__name__)
        if not written and last is not None:
            raise last
        return written

    def _write_back(self, tier: Tier, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        size = memoryview(data).nbytes
        if self._pending_bytes + size > self.max_pending_bytes:
            self.dropped[tier.name] += 1
            return
        self._pending_bytes += size

        async def copy() -> None:
            try:
                await tier.put(key, data)
            except TierError:
                self.errors[tier.name] += 1
            finally:
                self._pending_bytes -= size

        task = asyncio.get_running_loop().create_task(copy())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def flush(self) -> None:
        """Wait for every write-back copy in flight."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def get(self, key: ChunkKey) -> StoredChunk:
        misses: list[Tier] = []
        failed: list[TierError] = []
        for t in self.tiers:
            try:
                found = await t.get(key)
            except ChunkNotFound:
                misses.append(t)
                continue
            except TierError as exc:
                self.errors[t.name] += 1
                failed.append(exc)
                continue
            if self.promote and misses:
                await self._promote(key, found, misses)
            return found
        raise ChunkNotFound(key, "all", tier_errors=failed)

    async def _promote(self, key: ChunkKey, found: StoredChunk, into: list[Tier]) -> None:
        for t in into:
            try:
                await t.put(key, found.data)
            except TierFull:
                pass
            except TierError:
                self.errors[t.name] += 1

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return (await self.contains_many_checked(keys))[0]

    async def contains_many_checked(self, keys: Sequence[ChunkKey]) -> tuple[list[bool], list[TierError]]:
        """Presence of each key in any tier, and the errors of tiers that could not answer (a
        key they hold then reads as absent: the caller may say why its answer is short)."""
        present = [False] * len(keys)
        errors: list[TierError] = []
        for t in self.tiers:
            todo = [i for i, p in enumerate(present) if not p]
            if not todo:
                break
            try:
                found = await t.contains_many([keys[i] for i in todo])
            except TierError as exc:
                self.errors[t.name] += 1
                errors.append(exc)
                continue
            for i, f in zip(todo, found):
                present[i] = present[i] or f
        return present, errors

    async def locate(self, key: ChunkKey) -> list[str]:
        out = []
        for t in self.tiers:
            try:
                if await t.contains(key):
                    out.append(t.name)
            except TierError:
                self.errors[t.name] += 1
        return out

    async def delete(self, key: ChunkKey) -> int:
        await self.flush()
        results = await asyncio.gather(*(t.delete(key) for t in self.tiers))
        return sum(1 for r in results if r)

    async def delete_group(self, group: str) -> int:
        await self.flush()  # a copy in flight must not land after the delete
        return sum(await asyncio.gather(*(t.delete_group(group) for t in self.tiers)))

    async def delete_owner(self, owner: str) -> int:
        await self.flush()
        return sum(await asyncio.gather(*(t.delete_owner(owner) for t in self.tiers)))

    async def move(self, key: ChunkKey, src: str, dst: str) -> int:
        """Copy a chunk from ``src`` to ``dst`` and remove it from ``src``; returns bytes moved."""
        if src == dst:
            raise ValueError("source and destination tiers are the same")
        s, d = self.tier(src), self.tier(dst)
        found = await s.get(key)
        await d.put(key, found.data)
        await s.delete(key)
        return found.nbytes

    async def pin(self, key: ChunkKey) -> list[str]:
        pinned = []
        for t in self.tiers:
            try:
                await t.pin(key)
                pinned.append(t.name)
            except ChunkNotFound:
                continue
        if not pinned:
            raise ChunkNotFound(key, "all")
        return pinned

    async def unpin(self, key: ChunkKey) -> None:
        for t in self.tiers:
            await t.unpin(key)

    async def aclose(self) -> None:
        await self.flush()
        for t in self.tiers:
            await t.aclose()
