"""Storage tiers: opaque keys and ciphertext envelopes, never tenants' names or secrets.

Public surface::

    Tier                       the contract every tier meets (storage.base)
    ChunkKey, StoredChunk      identity and result types (storage.types)
    MemoryTier, DiskTier       the in-process and local-disk tiers

Errors (all from storage.types)::

    TierError
     +-- ChunkNotFound     the key is not in this tier (a miss)
     +-- TierUnavailable   the tier cannot be reached, is closed or not started
     +-- TierFull          the chunk cannot fit (larger than the budget, or every byte pinned)
     +-- InvalidChunk      the bytes or key handed to put are not acceptable
"""

from storage.base import Tier
from storage.disk import DiskTier, DiskTierStats
from storage.memory import MemoryTier, MemoryTierStats
from storage.types import (
    ChunkKey,
    ChunkNotFound,
    InvalidChunk,
    StoredChunk,
    TierError,
    TierFull,
    TierUnavailable,
)

__all__ = [
    "ChunkKey",
    "ChunkNotFound",
    "DiskTier",
    "DiskTierStats",
    "InvalidChunk",
    "MemoryTier",
    "MemoryTierStats",
    "StoredChunk",
    "Tier",
    "TierError",
    "TierFull",
    "TierUnavailable",
]
