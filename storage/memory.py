"""The in-process memory tier: LRU within a byte budget, pins, optional per-owner fair share.

It is a product tier (the first, fastest place envelopes are kept) and also the one fake storage
the tests need (no ``unittest.mock`` for storage). Envelopes are ciphertext; the tier keeps a
reference to the buffer ``put`` was given (no copy) and hands out read-only views of it.

Budget and eviction (see :mod:`storage._index` for the exact order):

- ``capacity_bytes`` is never exceeded; ``get`` refreshes recency; pinned chunks are never evicted.
- A put that cannot fit even after evicting every chunk it may evict raises :class:`TierFull`
  and changes nothing.
- With ``owner_quota_bytes``, an owner over its quota pays for its own puts with its own
  least-recent chunks, so one owner flooding the tier cannot evict another owner's chunks that are
  within that owner's quota.

All methods run to completion without awaiting, so each is atomic for coroutines sharing a loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from storage._index import KeyIndex, byte_view
from storage.base import Tier
from storage.types import ChunkKey, ChunkNotFound, StoredChunk, TierFull, TierUnavailable

__all__ = ["MemoryTier", "MemoryTierStats"]


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


class MemoryTier(Tier):
    """Envelopes in process memory, LRU within ``capacity_bytes``."""

    name = "memory"

    def __init__(self, capacity_bytes: int, *, owner_quota_bytes: int | None = None) -> None:
        if capacity_bytes is None:
            raise ValueError("MemoryTier needs a capacity_bytes budget")
        self._index = KeyIndex(capacity_bytes, owner_quota_bytes)
        self._data: dict[ChunkKey, memoryview] = {}
        self._closed = False
        self._hits = self._misses = self._puts = self._evictions = self._rejected = 0

    # -- the Tier interface --------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> StoredChunk:
        self._check_open()
        view = self._data.get(key)
        if view is None:
            self._misses += 1
            raise ChunkNotFound(key, self.name)
        self._hits += 1
        self._index.touch(key)
        return StoredChunk(key=key, data=view, tier=self.name)

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        self._check_open()
        view = byte_view(key, data)
        try:
            victims = self._index.plan_eviction(key, view.nbytes)
        except TierFull:
            self._rejected += 1
            raise
        for victim in victims:
            self._drop(victim)
        self._evictions += len(victims)
        self._data[key] = view
        self._index.add(key, view.nbytes)
        self._puts += 1

    async def delete(self, key: ChunkKey) -> bool:
        self._check_open()
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
        keys = self._index.group_keys(group)
        for key in keys:
            self._drop(key)
        return len(keys)

    async def delete_owner(self, owner: str) -> int:
        self._check_open()
        keys = self._index.owner_keys(owner)
        for key in keys:
            self._drop(key)
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
        self._data.clear()
        self._index.clear()

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
        )

    def _drop(self, key: ChunkKey) -> None:
        del self._data[key]
        self._index.remove(key)

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the memory tier is closed")
