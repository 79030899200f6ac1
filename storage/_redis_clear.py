"""Group and owner clears and key listings for the Redis tier, driven by its index sets.

A clear of one (owner, group) set is a loop of pipelined round trips, each carrying::

    UNLINK <heads of batch i>, UNLINK <segments of batch i>, SREM set <batch i>,
    SREM pins <heads of batch i>, SSCAN set <cursor> COUNT <batch>      -> batch i+1

so the next batch is fetched in the same round trip that deletes the previous one. SSCAN returns
every member present for the whole scan (members added meanwhile may be missed, removed ones
skipped), so passes repeat until the set is empty (bounded: writers that keep adding to a group
being cleared cannot keep the clear running forever; crypto-shredding has made those chunks
unreadable anyway). UNLINK frees values in a background thread of the server. Only heads are
counted, so the count is chunks removed, not keys. Each round trip has its own timeout
(``clear_timeout_s``) and goes through the tier's breaker like every other call.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from storage._redis_layout import Layout
from storage.types import ChunkKey, InvalidChunk

__all__ = ["Clearer"]

_MAX_PASSES = 8

Call = Callable[[str, float, Callable[[], Awaitable[Any]]], Awaitable[Any]]


class Clearer:
    def __init__(self, redis: Any, layout: Layout, batch: int, call: Call, timeout_s: float,
                 on_used: Callable[[int], None]) -> None:
        self._on_used = on_used  # told the shared byte counter's new value
        self._redis = redis
        self._layout = layout
        self._batch = batch
        self._call = call
        self._timeout = timeout_s

    async def delete_group(self, group: str) -> int:
        _label(group)
        owners = await self._members(self._layout.group_owners(group))
        return sum([await self._clear(owner, group) for owner in owners])

    async def delete_owner(self, owner: str) -> int:
        _label(owner)
        groups = await self._members(self._layout.owner_groups(owner))
        total = sum([await self._clear(owner, group) for group in groups])
        await self._call("clear", self._timeout, lambda: self._redis.srem(self._layout.owners, owner))
        return total

    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        lay = self._layout
        if group is not None:
            _label(group)
            pairs = [(o, group) for o in await self._members(lay.group_owners(group))]
        else:
            pairs = []
            for owner in await self._members(lay.owners):
                pairs += [(owner, g) for g in await self._members(lay.owner_groups(owner))]
        found: list[ChunkKey] = []
        for owner, grp in pairs:
            found += await self._call("list", self._timeout, partial(self._list, owner, grp))
        return found

    async def _list(self, owner: str, group: str) -> list[ChunkKey]:
        heads: dict[str, ChunkKey] = {}
        async for member in self._redis.sscan_iter(self._layout.group_set(owner, group), count=self._batch):
            key = self._layout.parse_head(member)
            if key is not None:
                heads[member.decode()] = key
        if not heads:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for name in heads:
            pipe.exists(name)
        alive = await pipe.execute()  # entries of chunks that expired (TTL) stay in the set
        return [key for key, n in zip(heads.values(), alive) if n]

    async def _members(self, name: str) -> list[str]:
        raw = await self._call("clear", self._timeout, lambda: self._redis.smembers(name))
        return sorted(m.decode() for m in raw)

    async def _clear(self, owner: str, group: str) -> int:
        lay = self._layout
        gset = lay.group_set(owner, group)
        removed = 0
        for _ in range(_MAX_PASSES):
            cursor: int | None = 0
            batch: list[bytes] = []
            while cursor is not None or batch:
                step = partial(self._step, gset, cursor, batch)
                removed_now, cursor, batch = await self._call("clear", self._timeout, step)
                removed += removed_now
            if not await self._call("clear", self._timeout, lambda: self._redis.scard(gset)):
                break
        pipe_ops = (lay.owner_groups(owner), group), (lay.group_owners(group), owner)

        async def finish() -> None:
            pipe = self._redis.pipeline(transaction=False)
            for name, member in pipe_ops:
                pipe.srem(name, member)
            pipe.getdel(lay.group_bytes(owner, group))
            gone = (await pipe.execute())[-1]
            if gone:
                self._on_used(int(await self._redis.decrby(lay.bytes, int(gone))))

        await self._call("clear", self._timeout, finish)
        return removed

    async def _step(self, gset: str, cursor: int | None, batch: list[bytes]) -> tuple[int, int | None, list[bytes]]:
        """Delete ``batch`` and fetch the next one (cursor None: the scan is over)."""
        pipe = self._redis.pipeline(transaction=False)
        is_head = self._layout.is_head
        heads = [m for m in batch if is_head(m)]
        segments = [m for m in batch if not is_head(m)]
        if heads:
            pipe.unlink(*heads)
            pipe.srem(self._layout.pins, *heads)
        if segments:
            pipe.unlink(*segments)
        if batch:
            pipe.srem(gset, *batch)
        if cursor is not None:
            pipe.sscan(gset, cursor, count=self._batch)
        result = await pipe.execute()
        removed = int(result[0]) if heads else 0
        if cursor is None:
            return removed, None, []
        next_cursor, members = result[-1]
        return removed, (int(next_cursor) or None), list(members)


def _label(value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > 128 or any(c not in "0123456789abcdef" for c in value):
        raise InvalidChunk("owner and group labels are non-empty lowercase hex strings")
