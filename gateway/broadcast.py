"""Cluster events over Redis pub/sub (DESIGN section 3, scale-out).

Gateway servers and embedded workers share one Redis and one registry. When one process clears a
tenant or namespace, rotates or destroys keys, or disables a tenant, every other process must drop
what it holds in memory: cached namespace keys (old epoch), cached data keys, in-process memory
tier copies, and it must learn the capability revocation. The acting process publishes one small
JSON message on ``{prefix}events``; every subscriber applies it. A process that was down missed
nothing it needs: it starts with empty caches and reads epochs, keys and revocations from the
registry. A subscriber whose connection drops reconnects and, having possibly missed messages,
drops every cached namespace and data key (they are re-read from the registry on next use).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Any

from gateway.core import Gateway

__all__ = ["Broadcaster"]

log = logging.getLogger("kvgate.broadcast")


class Broadcaster:
    def __init__(self, gateway: Gateway, redis_url: str, *, prefix: str = "kvgate:") -> None:
        import redis.asyncio as aioredis  # redis-py only where scale-out is configured

        self.gw = gateway
        self.channel = f"{prefix}events"
        self.origin = f"{os.getpid()}:{os.urandom(4).hex()}"
        self._client = aioredis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self.received = 0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._listen(), name="kvgate-broadcast")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._ready.wait(), 5.0)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        await self._client.aclose()

    async def publish(self, kind: str, tenant: str, **fields: Any) -> None:
        """Tell every other process; failures are logged, never raised (the registry is the truth)."""
        message = json.dumps({"kind": kind, "tenant": tenant, "origin": self.origin, **fields})
        try:
            await self._client.publish(self.channel, message)
        except Exception as exc:  # redis down: others catch up from the registry on reconnect
            log.warning("could not publish %s: %s", kind, type(exc).__name__)

    async def _listen(self) -> None:
        backoff = 0.2
        while True:
            try:
                async with self._client.pubsub() as ps:
                    await ps.subscribe(self.channel)
                    if self._ready.is_set():  # a reconnect: messages may have been missed
                        self._forget_all()
                    self._ready.set()
                    backoff = 0.2
                    async for msg in ps.listen():
                        if msg.get("type") == "message":
                            await self._apply(msg.get("data"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("broadcast subscription lost (%s); retrying", type(exc).__name__)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _forget_all(self) -> None:
        self.gw._ns_cache.clear()
        self.gw.keyring._cache.clear()
        self.gw.keyring._budgets.clear()

    async def _apply(self, raw: bytes | str | None) -> None:
        try:
            msg = json.loads(raw or b"")
            kind, tenant = msg["kind"], msg["tenant"]
        except (ValueError, KeyError, TypeError):
            log.warning("ignored a malformed broadcast")
            return
        if msg.get("origin") == self.origin:
            return
        self.received += 1
        namespace = msg.get("namespace")
        self.gw.forget_namespace(tenant, namespace)
        self.gw.keyring.forget(tenant)
        if "revoke_before" in msg:
            self.gw.authority.revocations.revoke_tenant(tenant, before=float(msg["revoke_before"]))
        if kind in ("clear", "disable"):
            # drop this process's own (memory) copies; shared tiers were cleared by the sender
            for tier in self.gw.tiers.tiers:
                if tier.name != "memory":
                    continue
                if namespace is None:
                    await tier.delete_owner(self.gw.deriver.owner_label(tenant))
                else:
                    await tier.delete_group(self.gw.deriver.group_label(tenant, namespace))
