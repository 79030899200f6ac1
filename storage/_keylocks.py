"""Per-key mutual exclusion for one event loop, with a non-blocking ``take``.

``asyncio.Lock`` per key would do, except that the disk tier must claim eviction victims without
awaiting (so nothing interleaves between planning and claiming) and must know which keys are busy.
A key is held while it is in ``_queues``; waiters queue FIFO and are handed the key directly.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from storage.types import ChunkKey

__all__ = ["KeyLocks"]


class KeyLocks:
    def __init__(self) -> None:
        self._queues: dict[ChunkKey, deque[asyncio.Future[None]]] = {}

    def busy(self, key: ChunkKey) -> bool:
        return key in self._queues

    def held(self) -> list[ChunkKey]:
        return list(self._queues)

    def take(self, key: ChunkKey) -> None:
        """Claim a key that is not busy, without awaiting (RuntimeError if it is busy)."""
        if key in self._queues:
            raise RuntimeError("key is busy")
        self._queues[key] = deque()

    async def acquire(self, key: ChunkKey) -> None:
        queue = self._queues.get(key)
        if queue is None:
            self._queues[key] = deque()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(key)  # handed the key, then cancelled: pass it on
            else:
                with suppress(ValueError):
                    queue.remove(waiter)
            raise

    def release(self, key: ChunkKey) -> None:
        queue = self._queues[key]
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # ownership moves to the waiter
                return
        del self._queues[key]

    @asynccontextmanager
    async def hold(self, key: ChunkKey) -> AsyncIterator[None]:
        await self.acquire(key)
        try:
            yield
        finally:
            self.release(key)
