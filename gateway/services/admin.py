"""Control operations: secure clear, key rotation, tenant lifecycle, moves between tiers.

Secure clear is crypto-shredding plus deletion (docs/architecture.md, section 1), recorded around
the work so a crash in between is found and finished at the next start:
    1. a clear job is written (``requested``: the epochs and key versions it will shred, who
       asked); ``clear.requested`` is made durable (database or fsync-ed spool) before anything is
       shredded or deleted, and a resumed job records it again under the same event id (derived
       from the job id) with the original requester, so the log holds it exactly once;
    2. shred: namespace epochs bumped with fresh salts (previous storage keys and binding secrets
       become impossible to derive); for a tenant clear every data-key version recorded in step 1
       is destroyed and every capability of the tenant revoked. State ``shredded``;
    3. delete the ciphertext from every tier and the pins; ``completed``; ``clear.completed`` (counts).
Every control action here returns only after its audit event is durable (``record_durably``).
Each step is idempotent: bumping an epoch is conditional on its recorded value, destroying a
destroyed key is a no-op, deleting deleted chunks deletes nothing."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from gateway import errors
from gateway.errors import InvalidRequest, TenantUnavailable
from gateway.services.access import Access
from gateway.services.invalidation import Invalidation
from gateway.services.namespaces import NamespaceResolver, keys_digest
from gateway.types import ClearResult, check_name
from storage.manager import TierManager
from storage.types import ChunkKey, ChunkNotFound
from tenancy.keyring import Keyring
from tenancy.models import utcnow
from tenancy.registry import (
    ClearJobRecord,
    Registry,
    TenantDisabled,
    TenantExists,
    UnknownTenant,
)

if TYPE_CHECKING:
    from gateway.services.broadcast import Broadcaster

__all__ = ["Admin"]

_tracer = trace.get_tracer("kvgate.admin")
_RESUME = Actor(subject="kvgate:resume")


def _requested_event_id(job_id: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"kvgate:clear.requested:{job_id}"))


class Admin:
    def __init__(
        self,
        *,
        registry: Registry,
        keyring: Keyring,
        resolver: NamespaceResolver,
        access: Access,
        tiers: TierManager,
        invalidation: Invalidation,
        audit: AuditSink,
        broadcaster: Broadcaster | None = None,
    ) -> None:
        self.registry = registry
        self.keyring = keyring
        self.resolver = resolver
        self.access = access
        self.tiers = tiers
        self.invalidation = invalidation
        self.audit = audit
        self.broadcaster = broadcaster  # when scale-out is configured

    async def _publish(self, kind: str, tenant: str, **fields: Any) -> None:
        if self.broadcaster is not None:
            await self.broadcaster.publish(kind, tenant, **fields)

    # -- tenants -----------------------------------------------------------------------------
    async def create_tenant(self, tenant: str, *, actor: Actor | None = None) -> int:
        """Register a tenant and its first data-key version; returns that version."""
        check_name(tenant, "tenant")
        try:
            await self.registry.create_tenant(tenant)
        except TenantExists:
            raise errors.TenantExists("tenant exists") from None
        version = await self.keyring.create(tenant)
        for action, details in ((Actions.TENANT_CREATE, {}), (Actions.KEY_CREATE, {"version": version})):
            self.audit.emit(AuditEvent(action, actor=actor or Actor(), target=Target(tenant=tenant), details=details))
        await self._durable()
        return version

    async def _durable(self) -> None:
        """Wait until every event emitted so far is durable (one flush for several events)."""
        flush = getattr(self.audit, "flush", None)
        if flush is not None:
            await flush(30.0)

    async def _record(self, event: AuditEvent) -> None:
        await record_durably(self.audit, event)

    async def disable_tenant(self, tenant: str, *, actor: Actor | None = None) -> None:
        try:
            await self.registry.disable_tenant(tenant)
        except UnknownTenant:
            raise TenantUnavailable("unknown tenant") from None
        before = await self._revoke_tenant(tenant, actor)
        self.invalidation.forget_keys(tenant)
        await self._publish("disable", tenant, revoke_before=before)
        await self._record(AuditEvent(Actions.TENANT_DISABLE, actor=actor or Actor(), target=Target(tenant=tenant)))

    async def rotate_key(self, tenant: str, *, actor: Actor | None = None) -> int:
        try:
            await self.registry.require_active(tenant)
        except (UnknownTenant, TenantDisabled):  # an outage is not a refusal: it propagates (503)
            raise TenantUnavailable("tenant unavailable") from None
        version = await self.keyring.rotate(tenant)
        await self._publish("rotate", tenant, version=version)
        await self._record(
            AuditEvent(Actions.KEY_ROTATE, actor=actor or Actor(), target=Target(tenant=tenant), details={"version": version})
        )
        return version

    async def _revoke_tenant(self, tenant: str, actor: Actor | None) -> float:
        return await self.access.revoke_tenant(tenant, actor)

    # -- tiers -------------------------------------------------------------------------------
    async def move(self, keys: Sequence[ChunkKey], src: str, dst: str, *, actor: Actor | None = None) -> int:
        """Move chunks between tiers; returns how many moved (absent ones are skipped)."""
        try:
            self.tiers.tier(src), self.tiers.tier(dst)
        except KeyError as exc:
            raise InvalidRequest(str(exc)) from None
        moved = 0
        for key in keys:
            try:
                await self.tiers.move(key, src, dst)
                moved += 1
            except ChunkNotFound:
                continue
        await self._record(  # a control action: acknowledged only once its event is durable
            AuditEvent(
                Actions.MOVE,
                actor=actor or Actor(),
                target=Target(chunk_count=moved, chunk_digest=keys_digest(keys), tier_from=src, tier_to=dst),
                details={"requested": len(keys)},
            )
        )
        return moved

    # -- secure clear ------------------------------------------------------------------------
    async def clear(
        self,
        tenant: str,
        namespace: str | None = None,
        *,
        chunks: Sequence[ChunkKey] | None = None,
        actor: Actor | None = None,
    ) -> ClearResult:
        """Clear a tenant, one namespace, or a list of chunks (of that tenant)."""
        check_name(tenant, "tenant")
        try:
            await self.registry.tenant_status(tenant)
        except UnknownTenant:
            raise TenantUnavailable("unknown tenant") from None
        if chunks is not None:
            owner = self.resolver.owner_label(tenant)
            if any(k.owner != owner for k in chunks):
                raise InvalidRequest("every chunk must belong to the tenant being cleared")
            details: dict[str, Any] = {"digests": sorted(k.digest for k in chunks), "groups": sorted({k.group for k in chunks})}
            scope = "chunks"
        elif namespace is not None:
            check_name(namespace, "namespace")
            rec = await self.registry.get_namespace(tenant, namespace)
            scope, details = "namespace", {"epochs": {namespace: rec.epoch} if rec else {}}
        else:
            nss = await self.registry.list_namespaces(tenant)
            keys = await self.registry.list_keys(tenant)
            scope = "tenant"
            details = {
                "epochs": {n.name: n.epoch for n in nss},
                "key_versions": [k.version for k in keys if k.state != "destroyed"],
            }
        with _tracer.start_as_current_span("kvgate.clear") as span:
            span.set_attributes({"kvgate.tenant": self.resolver.owner_label(tenant)[:16], "kvgate.scope": scope})
            return await self._record_and_run(tenant, namespace, scope, details, chunks, actor)

    async def _record_and_run(
        self, tenant: str, namespace: str | None, scope: str, details: dict[str, Any],
        chunks: Sequence[ChunkKey] | None, actor: Actor | None,
    ) -> ClearResult:
        requester = actor or Actor()
        details = {**details, "requested_by": asdict(requester)}
        if chunks:
            details["chunk_count"] = len(chunks)
        job = await self.registry.create_clear_job(tenant, namespace, scope, details)
        await self._record_requested(job, requester, resumed=False)  # durable before any shredding
        return await self._run(job, actor)

    async def _record_requested(self, job: ClearJobRecord, requester: Actor, *, resumed: bool) -> None:
        details: dict[str, Any] = {"job_id": job.id, "scope": job.scope}
        if resumed:
            details["resumed"] = True
        await self._record(
            AuditEvent(
                Actions.CLEAR_REQUESTED,
                actor=requester,
                target=Target(tenant=job.tenant, namespace=job.namespace, chunk_count=job.details.get("chunk_count")),
                details=details,
                event_id=_requested_event_id(job.id),
            )
        )

    async def resume_clears(self) -> list[ClearResult]:
        """Finish every clear a crash interrupted (called at start). A job still ``requested`` may
        have crashed before its ``clear.requested`` was durable: it is recorded now, with the
        requester kept in the job (the same event id, so never twice)."""
        results = []
        for job in await self.registry.incomplete_clear_jobs():
            if job.state == "requested":
                who = job.details.get("requested_by")
                requester = Actor(**who) if isinstance(who, dict) else _RESUME
                await self._record_requested(job, requester, resumed=True)
            results.append(await self._run(job, _RESUME))
        return results

    async def _run(self, job: ClearJobRecord, actor: Actor | None) -> ClearResult:
        tenant = job.tenant
        destroyed: list[int] = []
        epochs: dict[str, int] = {}
        if job.state == "requested":
            for name, old in job.details.get("epochs", {}).items():
                new = old + 1
                salt = await self.resolver.new_epoch_salt(tenant, name, new)
                await self.registry.bump_epoch(tenant, name, new, salt)
                epochs[name] = new
            self.invalidation.forget_keys(tenant, job.namespace if job.scope != "tenant" else None)
            revoke_before = None
            if job.scope == "tenant":
                destroyed = await self.keyring.destroy(tenant, job.details.get("key_versions", []))
                revoke_before = await self._revoke_tenant(tenant, actor)
                if destroyed:
                    await self._record(
                        AuditEvent(Actions.KEY_DESTROY, actor=actor or Actor(), target=Target(tenant=tenant),
                                   details={"versions": destroyed, "job_id": job.id})
                    )
            await self.registry.update_clear_job(job.id, state="shredded")
            fields: dict[str, Any] = {"namespace": job.namespace} if job.scope == "namespace" else {}
            if revoke_before is not None:
                fields["revoke_before"] = revoke_before
            await self._publish("clear", tenant, **fields)
        deleted = 0
        if job.scope == "tenant":
            deleted = await self.tiers.delete_owner(self.resolver.owner_label(tenant))
            await self.registry.remove_pins(tenant)
        elif job.scope == "namespace":
            assert job.namespace is not None
            deleted = await self.tiers.delete_group(self.resolver.group_label(tenant, job.namespace))
            await self.registry.remove_pins(tenant, job.namespace)
        else:
            groups = job.details.get("groups", [])
            for digest in job.details.get("digests", []):
                for group in groups:
                    if await self.tiers.delete(self.resolver.chunk_key_of_labels(tenant, group, digest)):
                        deleted += 1
        await self.registry.update_clear_job(job.id, state="completed", deleted_chunks=deleted, completed_at=utcnow())
        await self._record(
            AuditEvent(
                Actions.CLEAR_COMPLETED,
                actor=actor or Actor(),
                target=Target(tenant=tenant, namespace=job.namespace, chunk_count=deleted),
                details={"job_id": job.id, "scope": job.scope, "destroyed_key_versions": destroyed, "epochs": epochs},
            )
        )
        return ClearResult(job.id, tenant, job.namespace, deleted, destroyed, epochs)

