"""A cluster event channel over Redis pub/sub: publish and receive small opaque messages.

The gateway decides what the messages mean (gateway.services.broadcast); this module only moves bytes, so
redis-py stays inside ``storage``. A subscriber whose connection drops reconnects with backoff and
is told (``on_reconnect``) that it may have missed messages.

On a Redis Cluster (``redis+cluster://h1:p1,h2:p2``) the channel is classic pub/sub on one node: a
cluster propagates PUBLISH to every node over its bus, so subscribers on any node receive it. The
channel talks to the first seed; when that node is lost it moves to the next seed (and tells
``on_reconnect``, so caches are dropped as on any reconnect); a failed publish is retried once on
the next seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["RedisEventChannel"]

log = logging.getLogger("kvgate.storage.events")


class RedisEventChannel:
    def __init__(self, url: str, channel: str) -> None:
        self.channel = channel
        self._urls = [url]
        if url.startswith(("redis+cluster://", "rediss+cluster://")):
            from storage._cluster_client import parse_cluster_url

            spec = parse_cluster_url(url)
            self._urls = [spec.node_url(host, port) for host, port in spec.nodes]
        self._at = 0
        self._client = self._connect()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    def _connect(self) -> Any:
        import redis.asyncio as aioredis  # redis-py only where scale-out is configured

        return aioredis.from_url(self._urls[self._at], socket_timeout=2.0, socket_connect_timeout=2.0)

    async def _next_node(self) -> None:
        """Move to the next seed (a cluster whose node was lost); a no-op with one URL."""
        if len(self._urls) == 1:
            return
        old = self._client
        self._at = (self._at + 1) % len(self._urls)
        self._client = self._connect()
        with contextlib.suppress(Exception):
            await old.aclose()

    async def publish(self, message: bytes | str) -> bool:
        """Send one message; False (logged, never raised) when Redis cannot be reached."""
        for _attempt in range(min(2, len(self._urls))):
            try:
                await self._client.publish(self.channel, message)
                return True
            except Exception as exc:
                log.warning("could not publish on %s: %s", self.channel, type(exc).__name__)
                await self._next_node()
        return False

    async def subscribe(
        self,
        on_message: Callable[[bytes], Awaitable[None]],
        on_reconnect: Callable[[], None],
        *,
        ready_timeout: float = 5.0,
    ) -> None:
        """Start receiving in a background task; returns once subscribed (or after the timeout)."""
        self._task = asyncio.create_task(self._listen(on_message, on_reconnect), name=f"events:{self.channel}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), ready_timeout)

    async def _listen(self, on_message: Callable[[bytes], Awaitable[None]], on_reconnect: Callable[[], None]) -> None:
        backoff = 0.2
        while True:
            try:
                async with self._client.pubsub() as ps:
                    await ps.subscribe(self.channel)
                    if self._ready.is_set():  # a reconnect: messages may have been missed
                        on_reconnect()
                    self._ready.set()
                    backoff = 0.2
                    async for msg in ps.listen():
                        if msg.get("type") == "message":
                            await on_message(msg.get("data") or b"")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("subscription to %s lost (%s); retrying", self.channel, type(exc).__name__)
                await self._next_node()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._client.aclose()
