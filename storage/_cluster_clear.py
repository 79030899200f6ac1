"""Namespace and owner clears and key listings for the Redis Cluster tier: SCAN on every master.

Every key of an (owner, group) carries the tag ``{owner.group.bb}`` (see _cluster_layout), so a
clear walks every master (in parallel) with ``SCAN MATCH <the tags' pattern> COUNT <batch>`` and, for each batch,
deletes the keys it found in one pipeline of per-slot commands (``UNLINK`` of heads, ``UNLINK`` of
segments and pin sets, ``GETDEL`` of tag counters, so their bytes are taken off the total). The
next SCAN runs while that pipeline is in flight. Only heads are counted, so the count is chunks.

SCAN returns every key present for the whole scan; keys added meanwhile, or moved to another
master by a reshard during the scan, may be missed, so passes repeat until one finds nothing
(bounded). Each round trip has its own timeout (``clear_timeout_s``) and goes through the tier's
breaker for that node. A clear that dies half-way is resumed by running it again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from redis.crc import key_slot

from storage._cluster_layout import COUNTER, HEAD, SHARDS, ClusterLayout, Parsed
from storage._redis_clear import _label
from storage.types import ChunkKey

__all__ = ["ClusterClearer"]

_MAX_PASSES = 4

Call = Callable[..., Awaitable[Any]]


class ClusterClearer:
    def __init__(self, redis: Any, layout: ClusterLayout, batch: int, call: Call, timeout_s: float,
                 on_shard: Callable[[str, int], None]) -> None:
        self._redis = redis
        self._layout = layout
        self._batch = batch
        self._call = call
        self._timeout = timeout_s
        self._on_shard = on_shard  # told a total-counter shard's new value

    async def delete_group(self, group: str) -> int:
        _label(group)
        return await self._sweep(self._layout.pattern(group=group), lambda p: p.group == group)

    async def delete_owner(self, owner: str) -> int:
        _label(owner)
        return await self._sweep(self._layout.pattern(owner=owner), lambda p: p.owner == owner)

    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        if group is not None:
            _label(group)
        found: set[ChunkKey] = set()
        for node in await self._primaries():
            async for names in self._scan(node, self._layout.pattern(group=group, heads_only=True)):
                for name in names:
                    parsed = self._layout.parse(name)
                    if parsed is not None and parsed.key is not None and group in (None, parsed.group):
                        found.add(parsed.key)
        return sorted(found, key=lambda k: (k.owner, k.group, k.digest))

    async def _primaries(self) -> list[Any]:
        async def run() -> list[Any]:
            await self._redis.initialize()
            return list(self._redis.get_primaries())

        primaries: list[Any] = await self._call("clear", self._timeout, run)
        return primaries

    async def _scan(self, node: Any, pattern: str) -> Any:
        cursor = 0
        while True:
            cursor, names = await self._call("clear", self._timeout, partial(self._scan_step, node, pattern, cursor),
                                             node=node.name)
            yield names
            if not cursor:
                return

    async def _scan_step(self, node: Any, pattern: str, cursor: int) -> tuple[int, list[bytes]]:
        cursors, names = await self._redis.execute_command(
            "SCAN", cursor, "MATCH", pattern, "COUNT", self._batch, target_nodes=node)
        return int(cursors.get(node.name, 0)), list(names)

    async def _sweep(self, pattern: str, want: Callable[[Parsed], bool]) -> int:
        removed = 0
        for _ in range(_MAX_PASSES):
            counts = await asyncio.gather(*(self._sweep_node(node, pattern, want) for node in await self._primaries()))
            removed += sum(n for n, _ in counts)
            if not sum(seen for _, seen in counts):
                break
        return removed

    async def _sweep_node(self, node: Any, pattern: str, want: Callable[[Parsed], bool]) -> tuple[int, int]:
        """One pass over one master (the masters are swept in parallel): (chunks removed, keys seen)."""
        removed = seen = 0
        pending: asyncio.Future[int] | None = None
        try:
            async for names in self._scan(node, pattern):
                mine = [(n, p) for n in names if (p := self._layout.parse(n)) is not None and want(p)]
                seen += len(mine)
                if pending is not None:
                    removed += await pending
                    pending = None
                if mine:  # deleted while the next SCAN is in flight
                    pending = asyncio.ensure_future(self._call("clear", self._timeout, partial(self._unlink, mine)))
            if pending is not None:
                removed += await pending
                pending = None
        finally:
            if pending is not None:
                pending.cancel()
        return removed, seen

    async def _unlink(self, found: list[tuple[bytes, Parsed]]) -> int:
        """Delete one batch of keys (one pipeline, per-slot commands); return the heads removed."""
        lay = self._layout
        by_slot: dict[int, tuple[list[bytes], list[bytes], list[bytes]]] = {}
        buckets: dict[bytes, str] = {}
        for name, parsed in found:
            heads, others, counters = by_slot.setdefault(key_slot(name), ([], [], []))
            if parsed.kind == HEAD:
                heads.append(name)
            elif parsed.kind == COUNTER:
                counters.append(name)
                buckets[name] = parsed.bucket
            else:
                others.append(name)
        pipe = self._redis.pipeline(transaction=False)
        plan: list[tuple[str, Any]] = []
        for heads, others, counters in by_slot.values():
            if heads:
                pipe.execute_command("UNLINK", *heads)
                plan.append((HEAD, None))
            if others:
                pipe.execute_command("UNLINK", *others)
                plan.append(("other", None))
            for counter in counters:
                pipe.getdel(counter)
                plan.append((COUNTER, counter))
        results = await pipe.execute()
        removed = 0
        freed = dict.fromkeys(SHARDS, 0)
        for (kind, counter), result in zip(plan, results):
            if kind == HEAD:
                removed += int(result)
            elif kind == COUNTER and result:
                freed[buckets[counter][0]] += int(result)
        if any(freed.values()):
            pipe = self._redis.pipeline(transaction=False)
            digits = [d for d, n in freed.items() if n]
            for digit in digits:
                pipe.decrby(lay.shard_name(digit), freed[digit])
            for digit, value in zip(digits, await pipe.execute()):
                self._on_shard(lay.shard_name(digit), int(value))
        return removed
