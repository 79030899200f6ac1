"""The narrow tier interface (as httpx's transport): every tier is an async context manager with
``get``, ``put``, ``delete``, ``contains``, plus the few batch and group operations the gateway
needs. Misses raise :class:`storage.types.ChunkNotFound`; nothing returns ``None`` or ``False`` to
mean failure.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType

from storage.types import ChunkKey, ChunkNotFound, StoredChunk

__all__ = ["Tier"]


class Tier(abc.ABC):
    """A place envelopes are kept. Implementations must be safe to call from one event loop with
    many coroutines in flight; ``put`` is atomic (a reader sees the whole old value, nothing, or
    the whole new value, never a torn one)."""

    #: short name used in metrics, bench results and StoredChunk.tier ("memory", "disk", "redis")
    name: str

    @abc.abstractmethod
    async def get(self, key: ChunkKey) -> StoredChunk:
        """Return the envelope or raise ChunkNotFound (TierUnavailable when unreachable)."""

    @abc.abstractmethod
    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any previous value. The tier may keep a reference
        to ``data``; the caller must not mutate it afterwards."""

    @abc.abstractmethod
    async def delete(self, key: ChunkKey) -> bool:
        """Remove the key; True if something was removed. Pinned keys are removed too."""

    @abc.abstractmethod
    async def contains(self, key: ChunkKey) -> bool:
        """Whether the key is present (a cheap check, no data transfer)."""

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Batch form of contains (tiers with round trips override it with one pipeline)."""
        return [await self.contains(k) for k in keys]

    @abc.abstractmethod
    async def delete_group(self, group: str) -> int:
        """Delete every chunk whose key has this group label; return how many were deleted."""

    @abc.abstractmethod
    async def delete_owner(self, owner: str) -> int:
        """Delete every chunk whose key has this owner label; return how many were deleted."""

    async def pin(self, key: ChunkKey) -> None:
        """Protect a present key from eviction (tiers without eviction accept and ignore)."""
        if not await self.contains(key):
            raise ChunkNotFound(key, self.name)

    async def unpin(self, key: ChunkKey) -> None:  # noqa: B027 - optional, a no-op by default
        """Undo pin; unpinning an unpinned or absent key is not an error."""

    @abc.abstractmethod
    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        """A snapshot of the keys held (all, or one group's): for move, stats and recovery."""

    @property
    def used_bytes(self) -> int:
        return 0

    async def aclose(self) -> None:  # noqa: B027 - optional, a no-op by default
        """Release resources. Idempotent."""

    async def __aenter__(self) -> Tier:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
