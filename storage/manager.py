"""The tier manager: ordered tiers (fastest first), write-through or write-behind puts, first-hit
gets with promotion into faster tiers, and group/owner deletion across all of them.

Writes (``write_mode``):
- ``"through"``: ``put`` writes every tier before it returns (the tiers named in ``write_back``
  excepted: they get their copy behind, as below).
- ``"behind"``: ``put`` returns once the chunk is in the fastest tier that takes it; slower tiers
  get their copy from :class:`storage.writebehind.WriteBehind` (a bounded queue and a worker per
  tier). Back-pressure drops copies (``dropped``, per tier), never blocks a store; a crash loses
  only the queued copies, which recomputation brings back.

``flush`` waits for the queued copies; ``delete*`` first purges the queued copies they cover (a
copy must not land after a delete); ``aclose`` drains for at most ``drain_timeout_s`` and counts
what it drops. A tier that fails (TierUnavailable, or any TierError on a read) is counted and
passed over: for a cache, an unreachable tier is a miss, never an error for the engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from typing import Literal

from storage.base import Tier
from storage.memory import MemoryTier, Reservation
from storage.types import ChunkKey, ChunkNotFound, StoredChunk, TierError, TierFull
from storage.writebehind import WriteBehind

__all__ = ["TierManager"]

log = logging.getLogger("kvgate.storage")


class TierManager:
    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        promote: bool = True,
        write_back: Sequence[str] = (),
        write_mode: Literal["through", "behind"] = "through",
        max_pending_bytes: int = 1 << 30,
        max_pending_items: int = 4096,
        drain_timeout_s: float = 5.0,
    ) -> None:
        if not tiers:
            raise ValueError("at least one tier is needed")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        if write_mode not in ("through", "behind"):
            raise ValueError(f"write_mode must be 'through' or 'behind', not {write_mode!r}")
        self.tiers: list[Tier] = list(tiers)
        self.promote = promote
        unknown = set(write_back) - set(names)
        if unknown:
            raise ValueError(f"write_back names unknown tiers: {sorted(unknown)}")
        if write_back and set(write_back) == set(names):
            raise ValueError("at least one tier must be written through")
        self.write_mode = write_mode
        self.write_back = frozenset(write_back) | (frozenset(names[1:]) if write_mode == "behind" else frozenset())
        self.max_pending_bytes = max_pending_bytes
        self.drain_timeout_s = drain_timeout_s
        self.errors: Counter[str] = Counter()
        self.behind = WriteBehind(max_items=max_pending_items, max_bytes=max_pending_bytes)

    @property
    def dropped(self) -> Counter[str]:
        """Write-behind copies never written (queue full, or dropped by ``aclose``), per tier."""
        return self.behind.dropped

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r} (have {[t.name for t in self.tiers]})")

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview, *, only: Sequence[str] | None = None) -> list[str]:
        """Write the chunk; returns the names of the tiers written before returning (copies
        queued behind are not named). Raises the last error only if no tier took the chunk."""
        targets = self.tiers if only is None else [self.tier(n) for n in only]
        behind: list[Tier] = []
        if only is None and self.write_back:
            behind = [t for t in targets if t.name in self.write_back]
            targets = [t for t in targets if t.name not in self.write_back]
        written, last = await self._put_each(targets, key, data, first_only=False)
        if not written and behind:  # nothing faster took it: the first slower tier that does
            written, last = await self._put_each(behind, key, data, first_only=True)
            behind = behind[behind.index(self.tier(written[0])) + 1 :] if written else []
        for t in behind:
            self.behind.offer(t, key, data)
        if not written and last is not None:
            raise last
        return written

    async def _put_each(
        self, tiers: Sequence[Tier], key: ChunkKey, data: bytes | bytearray | memoryview, *, first_only: bool
    ) -> tuple[list[str], TierError | None]:
        written: list[str] = []
        last: TierError | None = None
        for t in tiers:
            try:
                await t.put(key, data)
                written.append(t.name)
                if first_only:
                    break
            except TierError as exc:
                self.errors[t.name] += 1
                last = exc
                log.warning("tier %s refused a put: %s", t.name, type(exc).__name__)
        return written, last

    @property
    def can_reserve(self) -> bool:
        """Whether the fastest tier hands out extents to seal into (a memory tier)."""
        return isinstance(self.tiers[0], MemoryTier)

    def reserve(self, key: ChunkKey, nbytes: int) -> Reservation:
        """An extent of the fastest tier to seal into (``MemoryTier.reserve``); TierFull, or
        TypeError when the fastest tier cannot hand one out (then seal and ``put`` instead)."""
        fast = self.tiers[0]
        if not isinstance(fast, MemoryTier):
            raise TypeError(f"tier {fast.name} does not hand out extents")
        return fast.reserve(key, nbytes)

    def abort(self, reservation: Reservation) -> None:
        fast = self.tiers[0]
        assert isinstance(fast, MemoryTier)
        fast.abort(reservation)

    async def commit(self, reservation: Reservation) -> bool:
        """Publish a reservation in the fastest tier and queue the slower tiers' copies (views
        of the committed extent, which stay valid while queued); False if nothing was stored."""
        fast = self.tiers[0]
        assert isinstance(fast, MemoryTier)
        if not fast.commit(reservation):
            return False
        rest = self.tiers[1:]
        if rest:
            view = (await fast.get(reservation.key)).data
            for t in rest:
                if t.name in self.write_back:
                    self.behind.offer(t, reservation.key, view)
                else:
                    await self._put_each([t], reservation.key, view, first_only=True)
        return True

    async def flush(self) -> None:
        """Wait for every write-behind copy queued."""
        await self.behind.flush()

    async def get(self, key: ChunkKey) -> StoredChunk:
        return (await self.get_checked(key))[0]

    async def get_checked(self, key: ChunkKey) -> tuple[StoredChunk, list[TierError]]:
        """The chunk from the first tier that has it, and the errors of the faster tiers that
        failed on the way (a load served, but degraded). ChunkNotFound where no tier had it; its
        ``tier_errors`` are the tiers that could not answer."""
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
            return found, failed
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

    async def locate_many(self, keys: Sequence[ChunkKey]) -> tuple[list[list[str]], list[TierError]]:
        """The tiers that hold each key, from one batched presence check per tier (the tiers
        asked at once), and the errors of tiers that could not answer (their keys read as
        absent there)."""
        where: list[list[str]] = [[] for _ in keys]
        errors: list[TierError] = []
        answers = await asyncio.gather(*(t.contains_many(keys) for t in self.tiers), return_exceptions=True)
        for t, found in zip(self.tiers, answers, strict=True):
            if isinstance(found, TierError):
                self.errors[t.name] += 1
                errors.append(found)
                continue
            if isinstance(found, BaseException):
                raise found
            for w, f in zip(where, found, strict=True):
                if f:
                    w.append(t.name)
        return where, errors

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
        await self.behind.purge(lambda k: k == key)
        results = await asyncio.gather(*(t.delete(key) for t in self.tiers))
        return sum(1 for r in results if r)

    async def delete_many(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Remove each key from every tier (its queued copies first), every tier asked even where
        another fails; the keys that a failing tier may still hold."""
        if not keys:
            return []
        doomed = set(keys)
        await self.behind.purge(lambda k: k in doomed)
        left: list[ChunkKey] = []
        for key in keys:
            results = await asyncio.gather(*(t.delete(key) for t in self.tiers), return_exceptions=True)
            for t, r in zip(self.tiers, results, strict=True):
                if isinstance(r, TierError):
                    self.errors[t.name] += 1
                elif isinstance(r, BaseException):
                    raise r
            if any(isinstance(r, BaseException) for r in results):
                left.append(key)
        return left

    async def delete_group(self, group: str) -> int:
        await self.behind.purge(lambda k: k.group == group)  # no queued copy may land after it
        return sum(await asyncio.gather(*(t.delete_group(group) for t in self.tiers)))

    async def delete_owner(self, owner: str) -> int:
        await self.behind.purge(lambda k: k.owner == owner)
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
        """Drain the write-behind queues (at most ``drain_timeout_s``; the rest is dropped and
        counted), then close every tier."""
        await self.behind.close(self.drain_timeout_s)
        for t in self.tiers:
            await t.aclose()
