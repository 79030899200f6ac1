"""Write-behind copies for the slower tiers: one bounded queue and one worker task per tier.

A store returns once the chunk is in the fastest tier that took it; each slower tier gets its copy
from its own worker, so a stalled Redis never delays the disk copies and neither ever delays a
store. ``offer`` never blocks: past ``max_items`` queued copies or ``max_bytes`` queued bytes (all
tiers together) the copy is dropped and counted. A cache may always lose a copy; the engine
recomputes what a miss costs. What a crash loses is exactly what was still queued.

``pace(busy, finish_s)`` makes each copy yield to its process's other work: while ``busy()`` (an
engine in this process runs forward steps) a copy waits, at most ``finish_s`` after it was queued.
A copy costs CPU in this process and in the tier's server alike (Redis reads and keeps every
byte), which a decode step on the same cores would otherwise lose.

``purge`` removes queued copies of a key, group or owner (a deletion must not be undone by a copy
landing after it) and then waits only for the copies already being written. ``close`` drains for
at most ``drain_timeout_s`` and counts what it then drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from storage.base import Tier
from storage.types import ChunkKey, TierError

__all__ = ["WriteBehind"]

log = logging.getLogger("kvgate.storage")


@dataclass(slots=True)
class _Copy:
    key: ChunkKey
    data: bytes | bytearray | memoryview
    nbytes: int
    queued: float  # time.monotonic()


class _Lane:
    """One tier's queue and worker."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.queue: deque[_Copy] = deque()
        self.wake = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.task: asyncio.Task[None] | None = None
        self.writing: _Copy | None = None  # the copy whose put is under way


class WriteBehind:
    def __init__(self, *, max_items: int = 4096, max_bytes: int = 1 << 30) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.dropped: Counter[str] = Counter()  # copies never written: queue full or closed
        self.written: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # copies the tier refused or could not take
        self._lanes: dict[str, _Lane] = {}
        self._items = 0
        self._bytes = 0
        self._closed = False
        self._busy: Callable[[], bool] | None = None
        self._finish_s = 0.0
        self.paced_s = 0.0  # copies' total wait for ``busy`` to clear

    def pace(self, busy: Callable[[], bool] | None, finish_s: float) -> None:
        """Copies wait while ``busy()``, each at most ``finish_s`` after it was queued (None or 0:
        they never wait)."""
        self._busy = busy if finish_s > 0 else None
        self._finish_s = finish_s

    async def _turn(self, copy: _Copy) -> None:
        busy = self._busy
        if busy is None:
            return
        due = copy.queued + self._finish_s
        t0 = now = time.monotonic()
        while now < due and busy():
            await asyncio.sleep(min(0.005, due - now))
            now = time.monotonic()
        self.paced_s += now - t0

    @property
    def queued(self) -> int:
        return self._items

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, tier: Tier, key: ChunkKey, data: bytes | bytearray | memoryview) -> bool:
        """Queue a copy for ``tier``; False (counted in ``dropped``) when full or closed."""
        size = memoryview(data).nbytes
        if self._closed or self._items >= self.max_items or self._bytes + size > self.max_bytes:
            self.dropped[tier.name] += 1
            return False
        lane = self._lanes.get(tier.name)
        if lane is None:
            lane = self._lanes[tier.name] = _Lane(tier)
        if lane.task is None:
            lane.task = asyncio.get_running_loop().create_task(self._work(lane), name=f"kvgate-write-behind-{tier.name}")
        lane.queue.append(_Copy(key, data, size, time.monotonic()))
        self._items += 1
        self._bytes += size
        lane.idle.clear()
        lane.wake.set()
        return True

    async def _work(self, lane: _Lane) -> None:
        while True:
            if not lane.queue:
                lane.idle.set()
                lane.wake.clear()
                await lane.wake.wait()
                continue
            copy = lane.queue[0]
            try:  # cancelled (close): the copy stays queued and close counts it dropped
                await self._turn(copy)
                if not lane.queue or lane.queue[0] is not copy:  # purged while it waited
                    continue
                lane.writing = copy
                await lane.tier.put(copy.key, copy.data)
                self.written[lane.tier.name] += 1
            except TierError as exc:
                self.errors[lane.tier.name] += 1
                log.debug("write-behind copy to %s failed: %s", lane.tier.name, type(exc).__name__)
            finally:
                lane.writing = None
            if lane.queue and lane.queue[0] is copy:
                lane.queue.popleft()
                self._items -= 1
                self._bytes -= copy.nbytes

    async def flush(self) -> None:
        """Wait until every queue is empty (copies written or failed)."""
        for lane in list(self._lanes.values()):
            await lane.idle.wait()

    async def purge(self, match: Callable[[ChunkKey], bool]) -> int:
        """Drop queued copies whose key matches, wait for the copies being written; return how
        many were dropped (not counted in ``dropped``: they were deleted, not lost)."""
        removed = 0
        busy = []
        for lane in self._lanes.values():
            head = lane.writing  # a copy still waiting for its turn is dropped like the rest
            keep: deque[_Copy] = deque()
            for copy in lane.queue:
                if copy is head or not match(copy.key):
                    keep.append(copy)
                else:
                    removed += 1
                    self._items -= 1
                    self._bytes -= copy.nbytes
            lane.queue = keep
            if head is not None:
                busy.append(self._head_done(lane, head))
        if busy:
            await asyncio.gather(*busy)
        return removed

    @staticmethod
    async def _head_done(lane: _Lane, head: _Copy) -> None:
        while lane.writing is head:
            await asyncio.sleep(0.001)

    async def close(self, drain_timeout_s: float = 5.0) -> int:
        """Drain for at most ``drain_timeout_s``, then stop; return the copies dropped here."""
        if not self._closed:
            self._closed = True
            try:
                await asyncio.wait_for(self.flush(), drain_timeout_s)
            except TimeoutError:
                pass
        lost = 0
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
                try:
                    await lane.task
                except asyncio.CancelledError:
                    pass
                lane.task = None
            lost += len(lane.queue)
            self.dropped[lane.tier.name] += len(lane.queue)
            lane.queue.clear()
        self._items = self._bytes = 0
        return lost
