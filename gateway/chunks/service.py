"""``ChunkService``: authorize, namespace, storage keys, tiers, integrity handling, audit; once,
for the embedded data plane (``gateway.datapath.stores.TierStore``) and the server's chunk
routes (``gateway.chunks.envelopes``, ``gateway.chunks.batches``) alike.

Every way a request can fail before it reaches a tier has one answer in both modes: a capability
refused is ``AccessDenied`` (audited by ``gateway.services.access``); an unknown or disabled tenant is
``AccessDenied`` too, counted as a denial; a KEK that cannot unwrap the namespace now is
``KeysUnavailable`` (a miss in process, a 503 from the server); a database that does not answer
is ``DependencyUnavailable``. Tier errors are classified by ``storage.types.failure_reason``.

``integrity_failure`` handles a stored envelope that failed authentication on the worker: an
``integrity.failure`` audit event and every copy dropped, under the capability that loaded it
(op ``get``). A reporter that names the envelope's digest drops only that copy, never a good one
stored since.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from crypto.errors import KekError, KeyUnavailable
from gateway.errors import AccessDenied, TenantUnavailable
from gateway.services.access import Access
from gateway.services.namespaces import NamespaceResolver, keys_digest
from storage.manager import TierManager
from storage.types import ChunkKey, ChunkNotFound, TierError
from tenancy.namespaces import NamespaceKeys
from tenancy.types import Capability

__all__ = ["ChunkService", "KeysUnavailable", "Opened"]


class KeysUnavailable(Exception):
    """Namespace or data keys cannot be had now (the KEK provider cannot unwrap them): a miss in
    process, a 503 with Retry-After from the server; never a refusal."""

    dependency = "the key provider"


@dataclass(frozen=True, slots=True)
class Opened:
    """A verified capability, its namespace's keys and the storage keys of the chunks asked for."""

    cap: Capability
    ns: NamespaceKeys
    keys: list[ChunkKey]


class ChunkService:
    def __init__(
        self, *, access: Access, resolver: NamespaceResolver, tiers: TierManager, audit: AuditSink,
        stats: Counter[str],
    ) -> None:
        self.access = access
        self.resolver = resolver
        self.tiers = tiers
        self.audit = audit
        self.stats = stats

    def authorize(self, token: str, op: str, chunk_hashes: Sequence[str]) -> Capability:
        """The capability verified for ``op`` on every chunk (its chunk allowlist included)."""
        return self.access.authorize(token, op, chunks=list(chunk_hashes))

    async def namespace(self, cap: Capability) -> NamespaceKeys:
        """The capability's namespace keys (see the module docstring for what each failure is)."""
        try:
            return await self.resolver.keys(cap.tenant, cap.namespace)
        except TenantUnavailable:  # unknown, or disabled after the capability was minted
            self.stats["denials"] += 1
            raise AccessDenied("tenant unavailable") from None
        except (KekError, KeyUnavailable) as exc:
            self.stats["key_unavailable"] += 1
            raise KeysUnavailable("the key-encryption key cannot unwrap this namespace now") from exc

    async def open(self, cap: Capability, chained_hashes: Sequence[bytes]) -> Opened:
        ns = await self.namespace(cap)
        return Opened(cap, ns, self.resolver.chunk_keys(ns, chained_hashes))

    async def integrity_failure(
        self, cap: Capability, key: ChunkKey, *, tier: str | None = None, index: int | None = None,
        actor: Actor | None = None, envelope_sha256: bytes | None = None,
    ) -> bool:
        """Audit an envelope that failed authentication and drop its copies; whether any was
        dropped. With ``envelope_sha256`` only a stored copy with that digest is dropped. ``tier``:
        where the bad copy came from (default: the tier that holds it now)."""
        self.stats["integrity_failures_reported"] += 1
        dropped, kept = False, ""
        try:
            if envelope_sha256 is not None:
                found = await self.tiers.get(key)
                tier = tier or found.tier
                if not hmac.compare_digest(hashlib.sha256(found.data).digest(), envelope_sha256):
                    kept = "the stored copy is another envelope"
            if not kept:
                dropped = await self.tiers.delete(key) > 0
        except ChunkNotFound:
            kept = "no copy is stored"
        except TierError as exc:
            kept = f"tier error: {type(exc).__name__}"
        details: dict[str, object] = {"dropped": dropped}
        if index is not None:
            details["chunk_index"] = index
        if kept:
            details["kept"] = kept
        self.audit.emit(
            AuditEvent(
                Actions.INTEGRITY_FAILURE,
                outcome="failure",
                actor=actor or Actor(tenant=cap.tenant, token_id=cap.cap_id),
                target=Target(
                    tenant=cap.tenant, namespace=cap.namespace, chunk_count=1, chunk_digest=keys_digest([key]),
                    tier_from=tier or "unknown",
                ),
                details=details,
            )
        )
        return dropped
