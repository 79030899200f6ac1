"""Invalidation: what a process drops when a tenant or namespace changes under it.

One rule, used by the admin operations of this process and by the broadcaster for events of
other processes: cached namespace keys (the old epoch) and cached data keys go; for a clear or a
disable, this process's own memory-tier copies go too (shared tiers are cleared by the process
that ran the clear). A subscriber that may have missed events forgets every cached key.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.services.namespaces import NamespaceResolver
from storage.manager import TierManager
from tenancy.keyring import Keyring

__all__ = ["Invalidation"]


class Invalidation:
    def __init__(self, resolver: NamespaceResolver, keyring: Keyring, tiers: TierManager) -> None:
        self.resolver = resolver
        self.keyring = keyring
        self.tiers = tiers
        # told of every forget (``tenant``, or None for all): what else caches registry state
        # (the published prefixes' match table, gateway.services.prefixes)
        self.listeners: list[Callable[[str | None], None]] = []

    def forget_keys(self, tenant: str | None, namespace: str | None = None) -> None:
        """Drop cached namespace keys and data keys (all of them when ``tenant`` is None)."""
        self.resolver.forget(tenant, namespace)
        self.keyring.forget(tenant)
        for listener in self.listeners:
            listener(tenant)

    async def drop_local_copies(self, tenant: str, namespace: str | None = None) -> int:
        """Delete this process's in-memory copies of a tenant's (or a namespace's) chunks."""
        dropped = 0
        for tier in self.tiers.tiers:
            if tier.name != "memory":
                continue
            if namespace is None:
                dropped += await tier.delete_owner(self.resolver.owner_label(tenant))
            else:
                dropped += await tier.delete_group(self.resolver.group_label(tenant, namespace))
        return dropped
