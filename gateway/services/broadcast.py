"""Cluster events over Redis pub/sub (docs/architecture.md, section 4).

Gateway servers and embedded workers share one Redis and one registry. When one process clears a
tenant or namespace, rotates or destroys keys, or disables a tenant, every other process must drop
what it holds in memory: cached namespace keys (previous epoch), cached data keys, in-process memory
tier copies, and it must learn the capability revocation. The acting process publishes one small
JSON message on ``{prefix}events``; every subscriber applies it. A process that was down missed
nothing it needs: it starts with empty caches and reads epochs, keys and revocations from the
registry. A subscriber whose connection drops reconnects and, having possibly missed messages,
drops every cached namespace and data key (they are re-read from the registry on next use)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from gateway.services.access import Access
from gateway.services.invalidation import Invalidation
from storage.events import RedisEventChannel

__all__ = ["Broadcaster"]

log = logging.getLogger("kvgate.broadcast")


class Broadcaster:
    def __init__(self, invalidation: Invalidation, access: Access, redis_url: str, *, prefix: str = "kvgate:") -> None:
        self.invalidation = invalidation
        self.access = access
        self.origin = f"{os.getpid()}:{os.urandom(4).hex()}"
        self._events = RedisEventChannel(redis_url, f"{prefix}events")
        self.received = 0

    @property
    def channel(self) -> str:
        return self._events.channel

    async def start(self) -> None:
        await self._events.subscribe(self._apply, self._forget_all)

    async def aclose(self) -> None:
        await self._events.aclose()

    async def publish(self, kind: str, tenant: str, **fields: Any) -> None:
        """Tell every other process; failures are logged, never raised (the registry is the truth)."""
        await self._events.publish(json.dumps({"kind": kind, "tenant": tenant, "origin": self.origin, **fields}))

    def _forget_all(self) -> None:
        self.invalidation.forget_keys(None)

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
        self.invalidation.forget_keys(tenant, namespace)
        if "revoke_before" in msg:
            self.access.revoked_elsewhere(tenant, float(msg["revoke_before"]))
        if kind in ("clear", "disable"):
            # drop this process's own (memory) copies; shared tiers were cleared by the sender
            await self.invalidation.drop_local_copies(tenant, namespace)
