"""The Redis Cluster tier (also Valkey in cluster mode): the Redis tier's format and fast path on a
redis-py asyncio ``RedisCluster``.

What differs from :class:`storage.redis.RedisTier`, whose docstring covers the rest:

- Key layout (:mod:`storage._cluster_layout`): a put or delete is one MULTI/EXEC on one slot, and
  no key crosses slots: pins and bytes are per tag, plus 16 counter shards (:attr:`used_bytes` is
  their sum as last seen; :meth:`refresh_used_bytes` reads all 16); no owner or group registries.
- Clears and listings SCAN every master for the tags (:mod:`storage._cluster_clear`).
- One circuit breaker per master, chosen by the slot of the key a call touches: a dead master
  fails fast for its slots while the others serve theirs. Loads during a failover or reshard are
  misses (TierUnavailable/TierTimeout, within the deadline), never other errors.
- ``contains_many`` asks each master in parallel; keys on an unreachable master answer False
  (a lookup miss) unless every master failed, when it raises like the single-node tier.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from storage._cluster_clear import ClusterClearer
from storage._cluster_client import is_cluster_url, make_cluster_client, node_of
from storage._cluster_layout import ClusterLayout
from storage._cluster_slot import on_slot
from storage._cluster_write import delete_chunk, put_chunk
from storage._index import byte_view
from storage._redis_breaker import CLOSED, CircuitBreaker
from storage._redis_client import Guard
from storage._redis_layout import HEADER_SIZE, Header
from storage.redis import RedisTier, RedisTierStats
from storage.types import ChunkKey, ChunkNotFound, TierError, TierFull

__all__ = ["RedisClusterTier", "probe_cluster"]

T = TypeVar("T")


class RedisClusterTier(RedisTier):
    """Envelopes in a Redis Cluster under ``prefix`` (url: ``redis+cluster://host:port[,...]``)."""

    name = "redis"
    _layout: ClusterLayout  # type: ignore[assignment]  # built by _new_layout
    _clearer: ClusterClearer  # type: ignore[assignment]  # built by _new_clearer

    # -- construction hooks --------------------------------------------------------------------
    @staticmethod
    def _check_url(url: str) -> None:
        if not is_cluster_url(url):
            raise ValueError("url must be a redis+cluster:// or rediss+cluster:// URL")

    def _new_layout(self, prefix: str) -> Any:
        self._guards: dict[str, Guard] = {}
        self._shards: dict[str, int] = {}
        return ClusterLayout(prefix)

    def _new_client(self, url: str, max_connections: int) -> Any:
        # connects are bounded by each call's deadline; a clear gets its own (longer) one
        return make_cluster_client(url, connect_timeout_s=max(self.op_timeout_s, self.clear_timeout_s),
                                   socket_timeout_s=max(30.0, self.clear_timeout_s), max_connections=max_connections)

    def _new_clearer(self, batch: int) -> Any:
        return ClusterClearer(self._redis, self._layout, batch, self._call, self.clear_timeout_s, self._set_shard)

    async def start(self) -> None:
        """Load the slot map, check that the cluster answers (TierUnavailable if not) and read the
        byte counters (discovery connects to every master: ``clear_timeout_s`` bounds it)."""
        await self.refresh_used_bytes(self.clear_timeout_s)

    async def refresh_used_bytes(self, timeout_s: float | None = None) -> int:
        """Read the 16 counter shards (one pipeline) and return their sum."""
        names = self._layout.shard_names()

        async def run() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return list(await pipe.execute())

        values = await self._call("start", timeout_s or self.op_timeout_s, run)
        self._shards = {n: int(v or 0) for n, v in zip(names, values)}
        return self.used_bytes

    # -- the Tier interface (get and contains are the single-node tier's) ----------------------
    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        view = byte_view(key, data)
        head = self._head(key)
        size = view.nbytes
        if size > self.max_value_bytes:
            self._n["rejected"] += 1
            raise TierFull(f"chunk of {size} bytes exceeds max_value_bytes={self.max_value_bytes}")
        budget = self.put_timeout_s + size / self.min_bytes_per_s
        shard, used = await self._call("put", budget, lambda: put_chunk(
            self._redis, self._layout, key, view, segment_bytes=self.segment_bytes, ttl_s=self.ttl_s), route=head)
        if used is not None:
            self._shards[shard] = used
        self._n["puts"] += 1
        self._n["in"] += size

    async def delete(self, key: ChunkKey) -> bool:
        head = self._head(key)
        removed, shard, used = await self._call(
            "delete", self.put_timeout_s, lambda: delete_chunk(self._redis, self._layout, key), route=head)
        if used is not None:
            self._shards[shard] = used
        return bool(removed)

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        heads = [self._head(k) for k in keys]
        if not heads:
            return []
        by_node: dict[str, list[int]] = {}
        for i, head in enumerate(heads):
            by_node.setdefault(node_of(self._redis, head), []).append(i)

        async def ask(name: str, idx: list[int]) -> list[Any]:
            async def run() -> list[Any]:
                pipe = self._redis.pipeline(transaction=False)
                for i in idx:
                    pipe.execute_command("EXISTS", heads[i])
                return list(await pipe.execute())

            return await self._call("contains", self.op_timeout_s, run, node=name)

        answers = await asyncio.gather(*(ask(n, idx) for n, idx in by_node.items()), return_exceptions=True)
        found = [False] * len(heads)
        failed: list[BaseException] = []
        for idx, answer in zip(by_node.values(), answers):
            if isinstance(answer, BaseException):
                failed.append(answer)
                continue
            for i, n in zip(idx, answer):
                found[i] = bool(n)
        for exc in failed:
            if not isinstance(exc, TierError):
                raise exc
        if failed and len(failed) == len(by_node):
            raise failed[0]
        return found

    async def pin(self, key: ChunkKey) -> None:
        head = self._head(key)

        async def run() -> None:
            raw = (await on_slot(self._redis, head, [("GETRANGE", head, 0, HEADER_SIZE - 1)], transaction=False))[0]
            if not raw:
                raise ChunkNotFound(key, self.name)
            cmds: list[tuple[Any, ...]] = [("SADD", self._layout.pins(key), head)]
            cmds += [("PERSIST", name) for name in [head, *self._segment_names(head, raw)]]
            await on_slot(self._redis, head, cmds, transaction=True)

        await self._call("pin", self.op_timeout_s, run, route=head)

    async def unpin(self, key: ChunkKey) -> None:
        head = self._head(key)

        async def run() -> None:
            _, raw = await on_slot(self._redis, head, [
                ("SREM", self._layout.pins(key), head), ("GETRANGE", head, 0, HEADER_SIZE - 1)], transaction=True)
            if raw and self.ttl_s is not None:
                names = [head, *self._segment_names(head, raw)]
                await on_slot(self._redis, head, [("EXPIRE", n, self.ttl_s) for n in names], transaction=True)

        await self._call("unpin", self.op_timeout_s, run, route=head)

    async def is_pinned(self, key: ChunkKey) -> bool:
        head = self._head(key)
        return bool(await self._call("pin", self.op_timeout_s,
                                     lambda: self._redis.sismember(self._layout.pins(key), head), route=head))

    @property
    def used_bytes(self) -> int:
        return sum(self._shards.values())

    def stats(self) -> RedisTierStats:
        base = super().stats()
        open_nodes = sorted(n for n, g in self._guards.items() if g.breaker.state != CLOSED)
        state = CLOSED if not open_nodes else "open: " + ",".join(open_nodes)
        trips = sum(g.breaker.trips for g in self._guards.values())
        return RedisTierStats(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                                 "used_bytes": self.used_bytes, "breaker_state": state, "breaker_trips": trips})

    @property
    def breaker_open(self) -> bool:
        """Whether any master's breaker is open or half-open (its slots fail fast)."""
        return any(g.breaker.state != CLOSED for g in self._guards.values())

    def breaker_for(self, node: str) -> CircuitBreaker:
        """The breaker of one master (host:port)."""
        return self._guard_for(node).breaker

    # -- internals -----------------------------------------------------------------------------
    async def _segments(self, head: str, header: Header) -> list[bytes] | None:
        names = self._layout.segments(head, header)
        parts = await on_slot(self._redis, head, [("GET", n) for n in names], transaction=False)
        return None if any(p is None for p in parts) else parts

    def _set_shard(self, name: str, value: int) -> None:
        self._shards[name] = value

    def _guard_for(self, node: str) -> Guard:
        guard = self._guards.get(node)
        if guard is None:
            guard = Guard(CircuitBreaker(self.breaker.failures, self.breaker.cooldown_s), self._n)
            self._guards[node] = guard
        return guard

    async def _call(self, what: str, timeout: float, fn: Callable[[], Awaitable[T]], route: str | None = None,
                    node: str | None = None) -> T:
        self._check_open()
        if node is None:
            node = node_of(self._redis, route) if route is not None else "*"
        return await self._guard_for(node).run(what, timeout, fn)


async def probe_cluster(url: str, *, timeout_s: float = 3.0) -> str:
    """A health line for a cluster URL ("cluster_state ok, 3 masters, 6 nodes known"), or
    ``TierError`` saying what is wrong (unreachable, or a cluster that is not ok)."""
    client = make_cluster_client(url, connect_timeout_s=2.0, socket_timeout_s=2.0, max_connections=4)
    try:
        async with asyncio.timeout(timeout_s):
            await client.initialize()
            info = await client.cluster_info()
            masters = len(client.get_primaries())
    except TierError:
        raise
    except Exception as exc:  # redis-py's errors and timeouts, translated at the boundary
        raise TierError(f"cluster unreachable: {type(exc).__name__}: {exc}") from None
    finally:
        await client.aclose()
    state = str(info.get("cluster_state", "?"))
    if state != "ok":
        raise TierError(f"cluster_state {state} ({masters} masters reachable)")
    return f"cluster_state ok, {masters} masters, {info.get('cluster_known_nodes', '?')} nodes known"
