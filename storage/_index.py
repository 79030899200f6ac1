"""Bookkeeping shared by the memory and disk tiers: sizes, recency, pins, group/owner indexes,
the eviction planner, and the check both tiers apply to the bytes handed to ``put``.

The index never touches data. A tier asks :meth:`KeyIndex.plan_eviction` which keys must go for a
put to fit, and gets either a list of victims or :class:`TierFull` *before* anything changed, so a
rejected put leaves the tier exactly as it was.

Eviction with ``owner_quota`` evicts, in order: (1) the putting owner's own least-recent unpinned
chunks while it is over its quota (counting the incoming chunk); (2) the least-recent unpinned
chunks of any other owner over its quota, until it is back within it; (3) only if the putting owner
is within its quota, plain LRU over every unpinned chunk. An owner over its quota thus never evicts
another owner's chunks that are within quota. Without ``owner_quota`` only step 3 applies. Pinned
chunks are never victims; they are kept out of the recency lists altogether.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator

from storage.types import ChunkKey, InvalidChunk, TierFull

__all__ = ["KeyIndex", "byte_view"]


def byte_view(key: object, data: object) -> memoryview:
    """A read-only, flat byte view of ``data`` without copying; InvalidChunk for anything else."""
    if not isinstance(key, ChunkKey):
        raise InvalidChunk(f"key must be a ChunkKey, not {type(key).__name__}")
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidChunk(f"chunk data must be bytes, bytearray or memoryview, not {type(data).__name__}")
    try:
        view = memoryview(data)
        if not view.c_contiguous:
            raise InvalidChunk("chunk data must be a C-contiguous buffer")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        return view.toreadonly()
    except (ValueError, TypeError) as exc:  # a released view, an odd format
        raise InvalidChunk(f"chunk data is not a usable buffer: {exc}") from exc


class KeyIndex:
    """Sizes and recency of the keys one tier holds. Not thread-safe: used from one event loop."""

    def __init__(self, capacity_bytes: int | None, owner_quota_bytes: int | None = None) -> None:
        for name, value in (("capacity_bytes", capacity_bytes), ("owner_quota_bytes", owner_quota_bytes)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"{name} must be a non-negative int or None")
        self.capacity = capacity_bytes
        self.owner_quota = owner_quota_bytes
        self.clear()

    def clear(self) -> None:
        """Forget every key (the budget and quota stay)."""
        self._sizes: dict[ChunkKey, int] = {}
        self._stamps: dict[ChunkKey, int] = {}
        self._clock = 0
        self._lru: OrderedDict[ChunkKey, None] = OrderedDict()  # unpinned, least recent first
        self._owner_lru: dict[str, OrderedDict[ChunkKey, None]] = {}  # unpinned, per owner
        self._pinned: set[ChunkKey] = set()
        self._groups: dict[str, set[ChunkKey]] = {}
        self._owners: dict[str, set[ChunkKey]] = {}
        self._owner_bytes: dict[str, int] = {}
        self.used = 0
        self.pinned_bytes = 0
        #: bytes promised to puts in flight (the disk tier reserves room before its I/O)
        self.reserved = 0
        self.reserved_by_owner: dict[str, int] = {}  # reservations count against their owner's quota

    # -- queries -------------------------------------------------------------------------------
    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(list(self._sizes))

    def size(self, key: ChunkKey) -> int:
        return self._sizes[key]

    def is_pinned(self, key: ChunkKey) -> bool:
        return key in self._pinned

    def group_keys(self, group: str) -> list[ChunkKey]:
        return list(self._groups.get(group, ()))

    def owner_keys(self, owner: str) -> list[ChunkKey]:
        return list(self._owners.get(owner, ()))

    def evictable(self) -> list[ChunkKey]:
        """Unpinned keys, least recent first."""
        return list(self._lru)

    def owner_bytes(self) -> dict[str, int]:
        return dict(self._owner_bytes)

    # -- updates -------------------------------------------------------------------------------
    def touch(self, key: ChunkKey) -> None:
        """Mark ``key`` most recently used."""
        self._clock += 1
        self._stamps[key] = self._clock
        if key not in self._pinned:
            self._lru.move_to_end(key)
            self._owner_lru[key.owner].move_to_end(key)

    def add(self, key: ChunkKey, nbytes: int) -> None:
        """Insert or replace ``key`` (a replaced key keeps its pin) and make it most recent."""
        old = self._sizes.get(key)
        if old is None:
            self._groups.setdefault(key.group, set()).add(key)
            self._owners.setdefault(key.owner, set()).add(key)
            self._lru[key] = None
            self._owner_lru.setdefault(key.owner, OrderedDict())[key] = None
            old = 0
        self._sizes[key] = nbytes
        self.used += nbytes - old
        self._owner_bytes[key.owner] = self._owner_bytes.get(key.owner, 0) + nbytes - old
        if key in self._pinned:
            self.pinned_bytes += nbytes - old
        self.touch(key)

    def remove(self, key: ChunkKey) -> int:
        """Forget ``key`` (pin included); return its size. KeyError if absent."""
        nbytes = self._sizes.pop(key)
        del self._stamps[key]
        self.used -= nbytes
        owner_left = self._owner_bytes[key.owner] - nbytes
        _discard(self._groups, key.group, key)
        _discard(self._owners, key.owner, key)
        if key.owner in self._owners:
            self._owner_bytes[key.owner] = owner_left
        else:
            del self._owner_bytes[key.owner]
        if key in self._pinned:
            self._pinned.discard(key)
            self.pinned_bytes -= nbytes
        else:
            del self._lru[key]
            lru = self._owner_lru[key.owner]
            del lru[key]
            if not lru:
                del self._owner_lru[key.owner]
        return nbytes

    def pin(self, key: ChunkKey) -> None:
        """Protect a present key from eviction (KeyError if absent)."""
        nbytes = self._sizes[key]
        if key in self._pinned:
            return
        self._pinned.add(key)
        self.pinned_bytes += nbytes
        del self._lru[key]
        lru = self._owner_lru[key.owner]
        del lru[key]
        if not lru:
            del self._owner_lru[key.owner]

    def unpin(self, key: ChunkKey) -> None:
        """Make a pinned key evictable again (as most recent). Absent or unpinned: no-op."""
        if key not in self._pinned:
            return
        self._pinned.discard(key)
        self.pinned_bytes -= self._sizes[key]
        self._lru[key] = None
        self._owner_lru.setdefault(key.owner, OrderedDict())[key] = None
        self.touch(key)

    # -- eviction planning ---------------------------------------------------------------------
    def plan_eviction(
        self, key: ChunkKey, nbytes: int, skip: Callable[[ChunkKey], bool] | None = None
    ) -> list[ChunkKey]:
        """Keys to evict so that putting ``nbytes`` under ``key`` fits; raise TierFull (changing
        nothing) when it cannot. ``skip`` excludes keys that are busy (a put in flight)."""
        cap = self.capacity
        if cap is None:
            return []
        if nbytes > cap:
            raise TierFull(f"a chunk of {nbytes} bytes exceeds the tier budget of {cap} bytes")
        old = self._sizes.get(key, 0)
        need = self.used + self.reserved - old + nbytes - cap
        if need <= 0:
            return []
        plan = _Plan(self, key, nbytes - old, need, skip)
        quota = self.owner_quota
        if quota is not None:
            plan.take_from(self._owner_lru.get(key.owner, ()), lambda: plan.over(key.owner, quota))
            if plan.need > 0:
                plan.take_from_over_quota_owners(quota)
        if plan.need > 0 and (quota is None or not plan.over(key.owner, quota)):
            plan.take_from(self._lru, lambda: True)
        if plan.need > 0:
            raise TierFull(
                f"no room for {nbytes} bytes: budget {cap}, in use {self.used}, "
                f"pinned {self.pinned_bytes}" + ("" if quota is None else ", owner quotas kept")
            )
        return plan.victims


class _Plan:
    """One eviction plan under construction (a dry run: the index is not modified)."""

    def __init__(
        self, index: KeyIndex, key: ChunkKey, delta: int, need: int,
        skip: Callable[[ChunkKey], bool] | None,
    ) -> None:
        self.index = index
        self.key = key
        self.need = need
        self.skip = skip
        self.victims: list[ChunkKey] = []
        self.chosen: set[ChunkKey] = set()
        self.delta: dict[str, int] = {key.owner: delta}

    def over(self, owner: str, quota: int) -> bool:
        index = self.index
        return index._owner_bytes.get(owner, 0) + index.reserved_by_owner.get(owner, 0) + self.delta.get(owner, 0) > quota

    def eligible(self, k: ChunkKey) -> bool:
        return k != self.key and k not in self.chosen and not (self.skip and self.skip(k))

    def take(self, k: ChunkKey) -> None:
        n = self.index._sizes[k]
        self.victims.append(k)
        self.chosen.add(k)
        self.need -= n
        self.delta[k.owner] = self.delta.get(k.owner, 0) - n

    def take_from(self, keys: OrderedDict[ChunkKey, None] | tuple[()], go_on: Callable[[], bool]) -> None:
        for k in keys:
            if self.need <= 0 or not go_on():
                return
            if self.eligible(k):
                self.take(k)

    def take_from_over_quota_owners(self, quota: int) -> None:
        index = self.index
        heap: list[tuple[int, str]] = []
        iters: dict[str, Iterator[ChunkKey]] = {}
        heads: dict[str, ChunkKey] = {}

        def advance(owner: str) -> None:
            for k in iters[owner]:
                if self.eligible(k):
                    heads[owner] = k
                    heapq.heappush(heap, (index._stamps[k], owner))
                    return

        for owner in index._owner_lru:
            if owner != self.key.owner and self.over(owner, quota):
                iters[owner] = iter(index._owner_lru[owner])
                advance(owner)
        while heap and self.need > 0:
            _, owner = heapq.heappop(heap)
            self.take(heads.pop(owner))
            if self.over(owner, quota):
                advance(owner)


def _discard(index: dict[str, set[ChunkKey]], label: str, key: ChunkKey) -> None:
    keys = index.get(label)
    if keys is not None:
        keys.discard(key)
        if not keys:
            del index[label]
