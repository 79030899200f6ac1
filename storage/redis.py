"""The Redis tier (redis-py asyncio): envelopes under opaque namespaced keys, shared by workers.

Key layout and the chunk header: :mod:`storage._redis_layout`; client and error mapping:
:mod:`storage._redis_client`; breaker: :mod:`storage._redis_breaker`. A chunk up to
``segment_bytes`` is one value; a larger one is a head plus immutable segments of a random per-put
version, swapped in by one MULTI/EXEC, so readers never see a torn or mixed chunk, without locks.

Every call runs under a deadline (``op_timeout_s``, ``read_timeout_s``, ``put_timeout_s``,
``clear_timeout_s``, plus ``len / min_bytes_per_s`` for a large payload); redis-py never retries.
Connection errors raise :class:`TierUnavailable`, deadlines :class:`TierTimeout` (counted in
``stats().timeouts``), and both feed a circuit breaker. A namespace clear SSCANs the group's key
set in batches and is crash-safe (members leave the set only with their keys). The tier evicts
nothing itself; ``ttl_s`` sets an expiry that pins remove. Redis must run with ``noeviction`` or a
``volatile-*`` policy with ``ttl_s``, never ``allkeys-*`` (it could evict index sets or pinned
chunks). Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from dataclasses import field as dc_field
from functools import partial
from typing import Any, TypeVar

from storage._index import byte_view
from storage._redis_breaker import CircuitBreaker
from storage._redis_clear import Clearer
from storage._redis_client import Guard, make_client
from storage._redis_layout import HEADER_SIZE, BadHeader, Header, Layout, unpack_header
from storage._redis_write import delete_chunk, put_chunk
from storage.base import Tier
from storage.types import (
    ChunkKey,
    ChunkNotFound,
    InvalidChunk,
    StoredChunk,
    TierError,
    TierFull,
    TierUnavailable,
)

__all__ = ["RedisTier", "RedisTierStats"]

T = TypeVar("T")
MiB = 1024 * 1024
_READ_ATTEMPTS = 4


@dataclass(frozen=True, slots=True)
class RedisTierStats:
    """A snapshot of one client's counters (``used_bytes`` is the shared counter as last seen)."""

    hits: int
    misses: int
    puts: int
    errors: int
    fast_failures: int
    rejected_puts: int
    corrupt: int
    retried_reads: int
    bytes_in: int
    bytes_out: int
    used_bytes: int
    breaker_state: str
    breaker_trips: int
    timeouts: dict[str, int] = dc_field(default_factory=dict)  # deadlines missed, by operation


class RedisTier(Tier):
    """Envelopes in Redis under ``prefix``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "kvgate:",
        segment_bytes: int = 2 * MiB,
        ttl_s: int | None = None,
        op_timeout_s: float = 0.1,
        read_timeout_s: float | None = 0.25,
        put_timeout_s: float = 1.0,
        clear_timeout_s: float = 5.0,
        min_bytes_per_s: float = 128 * MiB,
        breaker_failures: int = 5,
        breaker_cooldown_s: float = 2.0,
        max_value_bytes: int = 512 * MiB,
        max_connections: int = 64,
        clear_batch: int = 2000,
    ) -> None:
        """No I/O here: the first call connects (or :meth:`start` checks the server early)."""
        _positive_int(segment_bytes=segment_bytes, max_value_bytes=max_value_bytes,
                      max_connections=max_connections, clear_batch=clear_batch)
        if ttl_s is not None:
            _positive_int(ttl_s=ttl_s)
        for field, value in (("op_timeout_s", op_timeout_s), ("put_timeout_s", put_timeout_s),
                             ("clear_timeout_s", clear_timeout_s), ("min_bytes_per_s", min_bytes_per_s)):
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"{field} must be a positive number")
        self._check_url(url)
        self.url_scheme = url.split(":", 1)[0]
        self.prefix = prefix
        self.segment_bytes = segment_bytes
        self.ttl_s = ttl_s
        self.op_timeout_s = float(op_timeout_s)
        if read_timeout_s is not None and not (isinstance(read_timeout_s, (int, float)) and read_timeout_s > 0):
            raise ValueError("read_timeout_s must be a positive number")
        self.read_timeout_s = float(op_timeout_s if read_timeout_s is None else read_timeout_s)
        self.put_timeout_s = float(put_timeout_s)
        self.clear_timeout_s = float(clear_timeout_s)
        self.min_bytes_per_s = float(min_bytes_per_s)
        self.max_value_bytes = max_value_bytes
        self._layout = self._new_layout(prefix)
        self.breaker = CircuitBreaker(breaker_failures, breaker_cooldown_s)
        self._n = dict.fromkeys(("hits", "misses", "puts", "errors", "fast", "rejected", "corrupt",
                                 "retried", "in", "out"), 0)
        self._guard = Guard(self.breaker, self._n)
        self._redis: Any = self._new_client(url, max_connections)
        self._clearer = self._new_clearer(clear_batch)
        self._closed = False
        self._used = 0

    @classmethod
    async def open(cls, url: str, **kwargs: Any) -> RedisTier:
        tier = cls(url, **kwargs)
        await tier.start()
        return tier

    async def start(self) -> None:
        """Check that the server answers (TierUnavailable if not) and read the byte counter."""
        raw = await self._call("start", self.op_timeout_s, lambda: self._redis.get(self._layout.bytes))
        self._used = int(raw or 0)

    # -- construction hooks (the cluster tier overrides them) ------------------------------------
    @staticmethod
    def _check_url(url: str) -> None:
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("url must be a redis://, rediss:// or unix:// URL")

    def _new_layout(self, prefix: str) -> Layout:
        return Layout(prefix)

    def _new_client(self, url: str, max_connections: int) -> Any:
        return make_client(url, connect_timeout_s=self.op_timeout_s,
                           socket_timeout_s=max(30.0, self.clear_timeout_s), max_connections=max_connections)

    def _new_clearer(self, batch: int) -> Clearer:
        return Clearer(self._redis, self._layout, batch, self._call, self.clear_timeout_s, self._set_used)

    async def __aenter__(self) -> RedisTier:
        return self

    # -- the Tier interface --------------------------------------------------------------------
    async def get(self, key: ChunkKey) -> StoredChunk:
        head = self._head(key)
        for _ in range(_READ_ATTEMPTS):
            raw: bytes | None = await self._call("get", self.read_timeout_s, lambda: self._redis.get(head),
                                                  route=head)
            if raw is None:
                break
            try:
                header = unpack_header(raw)
                if header.inline and len(raw) != HEADER_SIZE + header.length:
                    raise BadHeader("inline length mismatch")
            except BadHeader:
                self._n["corrupt"] += 1
                await self._drop_corrupt(key)
                break
            data: memoryview | None
            if header.inline:
                data = memoryview(raw)[HEADER_SIZE:]  # a view of the reply: no copy
            else:
                budget = self.read_timeout_s + header.length / self.min_bytes_per_s
                parts = await self._call("get", budget, partial(self._segments, head, header), route=head)
                if parts is None:  # that version was replaced or deleted meanwhile: read again
                    self._n["retried"] += 1
                    continue
                data = _join(parts, header.length)
            if data is None:
                self._n["corrupt"] += 1
                await self._drop_corrupt(key)
                break
            self._n["hits"] += 1
            self._n["out"] += data.nbytes
            return StoredChunk(key=key, data=data, tier=self.name)
        self._n["misses"] += 1
        raise ChunkNotFound(key, self.name)

    async def put(self, key: ChunkKey, data: bytes | bytearray | memoryview) -> None:
        view = byte_view(key, data)
        self._check_open()
        size = view.nbytes
        if size > self.max_value_bytes:
            self._n["rejected"] += 1
            raise TierFull(f"chunk of {size} bytes exceeds max_value_bytes={self.max_value_bytes}")
        budget = self.put_timeout_s + size / self.min_bytes_per_s
        self._used = await self._call("put", budget, lambda: put_chunk(
            self._redis, self._layout, key, view, segment_bytes=self.segment_bytes, ttl_s=self.ttl_s))
        self._n["puts"] += 1
        self._n["in"] += size

    async def delete(self, key: ChunkKey) -> bool:
        self._head(key)
        removed, used = await self._call("delete", self.put_timeout_s,
                                         lambda: delete_chunk(self._redis, self._layout, key))
        if used is not None:
            self._used = used
        return removed

    async def contains(self, key: ChunkKey) -> bool:
        head = self._head(key)
        return bool(await self._call("contains", self.op_timeout_s, lambda: self._redis.exists(head), route=head))

    async def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        heads = [self._head(k) for k in keys]
        self._check_open()
        if not heads:
            return []

        async def run() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for head in heads:
                pipe.exists(head)
            return list(await pipe.execute())

        return [bool(n) for n in await self._call("contains", self.op_timeout_s, run)]

    async def delete_group(self, group: str) -> int:
        self._check_open()
        return await self._clearer.delete_group(group)

    async def delete_owner(self, owner: str) -> int:
        self._check_open()
        return await self._clearer.delete_owner(owner)

    async def pin(self, key: ChunkKey) -> None:
        head = self._head(key)

        async def run() -> None:
            raw = await self._redis.getrange(head, 0, HEADER_SIZE - 1)
            if not raw:
                raise ChunkNotFound(key, self.name)
            pipe = self._redis.pipeline(transaction=False)
            pipe.sadd(self._layout.pins, head)
            for name in [head, *self._segment_names(head, raw)]:
                pipe.persist(name)
            await pipe.execute()

        await self._call("pin", self.op_timeout_s, run)

    async def unpin(self, key: ChunkKey) -> None:
        head = self._head(key)

        async def run() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.srem(self._layout.pins, head)
            pipe.getrange(head, 0, HEADER_SIZE - 1)
            raw: bytes
            _, raw = await pipe.execute()
            if raw and self.ttl_s is not None:
                pipe = self._redis.pipeline(transaction=False)
                for name in [head, *self._segment_names(head, raw)]:
                    pipe.expire(name, self.ttl_s)
                await pipe.execute()

        await self._call("unpin", self.op_timeout_s, run)

    async def list_keys(self, group: str | None = None) -> list[ChunkKey]:
        self._check_open()
        return await self._clearer.list_keys(group)

    @property
    def used_bytes(self) -> int:
        return self._used

    async def aclose(self) -> None:
        """Close the connections; later calls raise TierUnavailable. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._redis.aclose()

    # -- extras --------------------------------------------------------------------------------
    async def is_pinned(self, key: ChunkKey) -> bool:
        head = self._head(key)
        return bool(await self._call("pin", self.op_timeout_s, lambda: self._redis.sismember(self._layout.pins, head)))

    @property
    def breaker_open(self) -> bool:
        """Whether calls fail fast now, or wait for a probe to prove the server back (open or
        half-open)."""
        return self.breaker.state != "closed"

    def stats(self) -> RedisTierStats:
        n = self._n
        return RedisTierStats(
            hits=n["hits"], misses=n["misses"], puts=n["puts"], errors=n["errors"],
            fast_failures=n["fast"], rejected_puts=n["rejected"], corrupt=n["corrupt"],
            retried_reads=n["retried"], bytes_in=n["in"], bytes_out=n["out"], used_bytes=self._used,
            breaker_state=self.breaker.state, breaker_trips=self.breaker.trips,
            timeouts={k[len("timeouts_"):]: v for k, v in n.items() if k.startswith("timeouts_")},
        )

    # -- internals -----------------------------------------------------------------------------
    async def _drop_corrupt(self, key: ChunkKey) -> None:
        """A value that is not a whole chunk (torn, foreign, half-evicted) answers EXISTS but can
        never load: delete it, or every lookup would report a hit whose load fails. Best effort."""
        try:
            await self.delete(key)
        except TierError:
            pass

    def _head(self, key: ChunkKey) -> str:
        if not isinstance(key, ChunkKey):
            raise InvalidChunk(f"key must be a ChunkKey, not {type(key).__name__}")
        self._check_open()
        return self._layout.head(key)

    def _segment_names(self, head: str, raw: bytes) -> list[str]:
        try:
            return self._layout.segments(head, unpack_header(raw))
        except BadHeader:
            return []

    async def _segments(self, head: str, header: Header) -> list[bytes] | None:
        pipe = self._redis.pipeline(transaction=False)
        for name in self._layout.segments(head, header):
            pipe.get(name)
        parts = await pipe.execute()
        return None if any(p is None for p in parts) else parts

    def _set_used(self, value: int) -> None:
        self._used = value

    def _check_open(self) -> None:
        if self._closed:
            raise TierUnavailable("the redis tier is closed")

    async def _call(self, what: str, timeout: float, fn: Callable[[], Awaitable[T]], route: str | None = None) -> T:
        """Run ``fn`` under the deadline and the breaker (``route``: a key it touches; the
        cluster tier picks that key's node's breaker by it)."""
        self._check_open()
        return await self._guard.run(what, timeout, fn)


def _join(parts: list[bytes], length: int) -> memoryview | None:
    if sum(len(p) for p in parts) != length:
        return None
    if len(parts) == 1:
        return memoryview(parts[0])
    buf = bytearray(length)
    offset = 0
    for part in parts:
        buf[offset:offset + len(part)] = part
        offset += len(part)
    return memoryview(buf).toreadonly()


def _positive_int(**values: int) -> None:
    for field, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int")
