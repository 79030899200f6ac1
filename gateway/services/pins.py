"""Pins: a pinned chunk is never evicted. Kept in the tiers (the eviction rule) and in the
registry (so a restart, and a secure clear, know them), and audited; one implementation for the
core's prompt pins and the REST chunk pins."""

from __future__ import annotations

from collections.abc import Sequence

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from gateway.errors import ChunkMissing
from gateway.services.namespaces import keys_digest
from storage.manager import TierManager
from storage.types import ChunkKey, ChunkNotFound
from tenancy.registry import Registry
from tenancy.types import Capability

__all__ = ["Pins"]


class Pins:
    def __init__(self, tiers: TierManager, registry: Registry, audit: AuditSink) -> None:
        self.tiers = tiers
        self.registry = registry
        self.audit = audit

    async def set(self, cap: Capability, keys: Sequence[ChunkKey], *, pin: bool = True, strict: bool = False) -> int:
        """Pin (or unpin) chunks of the capability's namespace; returns how many changed.

        ``strict``: a chunk that is not stored (pin) or not pinned (unpin) raises ChunkMissing
        and nothing is audited; otherwise such chunks are skipped (pin) or counted (unpin)."""
        changed = 0
        for key in keys:
            if pin:
                try:
                    await self.tiers.pin(key)
                except ChunkNotFound:
                    if strict:
                        raise ChunkMissing("not found") from None
                    continue
                await self.registry.add_pin(cap.tenant, cap.namespace, key.digest)
            else:
                await self.tiers.unpin(key)
                removed = await self.registry.remove_pin(cap.tenant, cap.namespace, key.digest)
                if strict and not removed:
                    raise ChunkMissing("not pinned")
            changed += 1
        self.audit.emit(
            AuditEvent(
                Actions.PIN if pin else Actions.UNPIN,
                actor=Actor(tenant=cap.tenant, token_id=cap.cap_id),
                target=Target(tenant=cap.tenant, namespace=cap.namespace, chunk_count=changed, chunk_digest=keys_digest(keys)),
            )
        )
        return changed
