"""The redis-py side of the Redis tier: the client we build and the errors we translate.

This is the only place (with :mod:`storage.redis`) that imports redis-py, and nothing here runs
at import time beyond class definitions.

The client never retries on its own (``Retry(NoBackoff(), 0)``: a lookup must fail within its
budget and let the circuit breaker decide), sends a command's pieces one by one without joining
payloads (:class:`_Connection`), reads with a 1 MiB ``socket_read_size``, and takes connections
from a ``BlockingConnectionPool`` (a burst waits within each operation's timeout instead of failing
with "too many connections"). Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    OutOfMemoryError,
    RedisError,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from storage._redis_breaker import CircuitBreaker
from storage.types import TierError, TierFull, TierTimeout, TierUnavailable

__all__ = ["OOM", "UNREACHABLE", "Guard", "classify", "make_client"]

T = TypeVar("T")

_DRAIN_AT = 256 * 1024
UNREACHABLE = "unreachable"
OOM = "oom"
REFUSED = "refused"


class _Connection(aioredis.Connection):
    async def _send_packed_command(self, command: Iterable[bytes]) -> None:
        writer = self._writer
        if writer is None:  # connected, then closed meanwhile (a cluster client resetting a node)
            raise RedisConnectionError("the connection was closed before the command was sent")
        for piece in command:
            writer.write(piece)
            if len(piece) >= _DRAIN_AT:  # bound what the transport copies into its buffer
                await writer.drain()
        await writer.drain()


def make_client(
    url: str, *, connect_timeout_s: float, socket_timeout_s: float, max_connections: int
) -> aioredis.Redis:
    """A client for ``url`` (redis:// or rediss://; unix sockets via unix://). No I/O here."""
    kwargs: dict[str, Any] = {
        "max_connections": max_connections,
        "timeout": None,  # waiting for a free connection is bounded by each operation's timeout
        "socket_connect_timeout": connect_timeout_s,
        "socket_timeout": socket_timeout_s,  # a last-resort bound; operations have tighter ones
        "socket_read_size": 1024 * 1024,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 0,
    }
    pool = aioredis.BlockingConnectionPool.from_url(url, **kwargs)
    if pool.connection_class is aioredis.Connection:
        pool.connection_class = _Connection
    return aioredis.Redis(connection_pool=pool, retry=Retry(NoBackoff(), 0))


def classify(exc: BaseException) -> str | None:
    """What a redis-py or socket error means for the tier: UNREACHABLE (the breaker counts it),
    OOM (the server refuses writes: maxmemory), REFUSED (any other server-side error reply),
    or None (not an error of the server or the link)."""
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError, BusyLoadingError, OSError, TimeoutError)):
        return UNREACHABLE
    if isinstance(exc, AuthenticationError):
        return UNREACHABLE
    if isinstance(exc, OutOfMemoryError) or (isinstance(exc, ResponseError) and str(exc).startswith("OOM")):
        return OOM
    if isinstance(exc, ResponseError):
        return REFUSED
    if isinstance(exc, RedisError):
        return UNREACHABLE
    if isinstance(exc, asyncio.IncompleteReadError):
        return UNREACHABLE
    return None


class Guard:
    """Runs every call of a tier under a deadline and the breaker, and is where redis-py's errors
    become the tier's (the package boundary): unreachable or too slow -> TierUnavailable (a
    breaker failure); out of memory -> TierFull; any other error reply -> TierUnavailable."""

    def __init__(self, breaker: CircuitBreaker, counts: dict[str, int]) -> None:
        self.breaker = breaker
        self._n = counts  # "errors", "fast", "rejected" are counted here

    async def run(self, what: str, timeout: float, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            self._n["fast"] += 1
            raise TierUnavailable(f"redis {what}: circuit open after repeated failures, failing fast")
        try:
            async with asyncio.timeout(timeout):
                result = await fn()
        except TierError:  # the server answered (a miss, say)
            self.breaker.success()
            raise
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        except BaseException as exc:
            kind = classify(exc)
            if kind is None:
                self.breaker.abandon()
                raise
            self._n["errors"] += 1
            if kind == UNREACHABLE:
                self.breaker.failure()
                if isinstance(exc, TimeoutError):
                    self._n["timeouts"] = self._n.get("timeouts", 0) + 1
                    self._n[f"timeouts_{what}"] = self._n.get(f"timeouts_{what}", 0) + 1
                    raise TierTimeout(f"redis {what} failed: timed out after {timeout * 1000:.0f} ms") from exc
                raise TierUnavailable(f"redis {what} failed: unreachable ({type(exc).__name__})") from exc
            self.breaker.success()
            if kind == OOM:
                self._n["rejected"] += 1
                raise TierFull(f"redis {what} refused: the server is out of memory") from exc
            raise TierUnavailable(f"redis {what} refused by the server: {exc}") from exc
        self.breaker.success()
        return result
