"""The access service: capabilities minted, verified and revoked, and every denial audited.

The REST server, the remote data plane and the core's data operations all decide access here,
so a capability is checked the same way on every path and a denial is counted and audited once.

A capability is a grant: ``mint`` hands the token back only once its ``capability.mint`` event
is durable (committed, or fsync-ed to the audit spool), so a crash cannot leave a grant in a
caller's hands that the audit log never saw. Concurrent mints share one commit (the audit
writer writes whatever is queued when it wakes). Denials are emitted and batched: a refusal
hands nothing out.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from gateway.errors import AccessDenied, InvalidRequest, TenantUnavailable
from gateway.metrics import Metrics
from gateway.types import check_name
from tenancy.capabilities import CapabilityAuthority, read_unverified
from tenancy.errors import CapabilityDenied, CapabilityRequestInvalid
from tenancy.registry import Registry, TenantDisabled, UnknownTenant
from tenancy.types import Capability

__all__ = ["Access", "refused_receipt_event"]

_REQUEST_CHARS = 128  # a request id as a refused receipt's event names it


def refused_receipt_event(
    tenant: str, namespace: str, request: str, reason: str, actor: Actor | None = None,
) -> AuditEvent:
    """The ``authz.denied`` event (op ``handoff``) of a P/D receipt a vLLM consumer refused for a
    request of ``tenant`` and ``namespace`` (``gateway.vllm.handoff``): the same event embedded
    and, with the reporting worker as ``actor``, on a server (``Access.refused_receipt``)."""
    return AuditEvent(
        Actions.AUTHZ_DENIED, outcome="denied", actor=actor or Actor(), target=Target(tenant=tenant, namespace=namespace),
        details={"op": "handoff", "reason": reason, "request": request[:_REQUEST_CHARS]},
    )


class Access:
    def __init__(self, authority: CapabilityAuthority, registry: Registry, audit: AuditSink, metrics: Metrics) -> None:
        self.authority = authority
        self.registry = registry
        self.audit = audit
        self.metrics = metrics
        # the sharing scopes a tenant reads now (gateway.services.prefixes), named in each
        # capability minted for reads; None where there are no published prefixes
        self.scopes_of: Callable[[str], Awaitable[Sequence[str]]] | None = None

    async def mint(
        self, tenant: str, namespace: str, ops: Sequence[str], ttl: int | None = None, *, actor: Actor | None = None
    ) -> str:
        """Mint a capability for an authenticated principal (the caller has checked its roles);
        returns it once its audit event is durable (AuditStorageError if that cannot be done)."""
        check_name(tenant, "tenant")
        check_name(namespace, "namespace")
        try:
            await self.registry.require_active(tenant)
        except (UnknownTenant, TenantDisabled) as exc:
            raise TenantUnavailable("tenant unavailable") from exc
        scopes: Sequence[str] = ()
        if self.scopes_of is not None and {"lookup", "get"} & set(ops):
            scopes = await self.scopes_of(tenant)
        try:
            token, cap = self.authority.issue(tenant, namespace, ops, ttl, scopes=scopes)
        except CapabilityRequestInvalid as exc:
            raise InvalidRequest(str(exc)) from None
        await record_durably(
            self.audit,
            AuditEvent(
                Actions.CAPABILITY_MINT,
                actor=actor or Actor(tenant=tenant),
                target=Target(tenant=tenant, namespace=namespace),
                details={
                    "cap_id": cap.cap_id, "ops": sorted(cap.ops), "expires_at": cap.expires_at,
                    **({"scopes": sorted(cap.scopes)} if cap.scopes else {}),
                },
            ),
        )
        return token

    def authorize(self, token: str, op: str, *, chunks: Sequence[str] = ()) -> Capability:
        """Verify a capability for one operation (and, if the holder restricted it to a chunk
        allowlist, for every chunk named); every denial is audited and raises AccessDenied.

        The work done does not depend on whether the tenant, namespace or chunk exists: the
        check is a MAC chain and a revocation-set lookup, nothing else. The capability alone
        names the tenant and namespace a request works in."""
        try:
            namespace = read_unverified(token).namespace
            return self.authority.verify(token, tenant=None, namespace=namespace, op=op, chunks=chunks)
        except CapabilityDenied as exc:
            self.denied(op, exc.reason)
            raise AccessDenied(exc.reason) from None

    async def refused_receipt(self, token: str, request: str, reason: str, *, actor: Actor | None = None) -> None:
        """A remote worker's report that it refused a P/D receipt for a request holding ``token``:
        the capability verified (op ``lookup``; a refusal is AccessDenied, audited as any), then
        ``refused_receipt_event`` recorded durably in the capability's tenant and namespace."""
        cap = self.authorize(token, "lookup")
        await record_durably(self.audit, refused_receipt_event(cap.tenant, cap.namespace, request, reason, actor))

    def denied(self, op: str, reason: str) -> None:
        """Count and audit a refusal (capability checks, and a tenant gone since minting)."""
        self.metrics.denials += 1
        self.audit.emit(AuditEvent(Actions.AUTHZ_DENIED, outcome="denied", details={"op": op, "reason": reason}))

    async def revoke_tenant(self, tenant: str, actor: Actor | None) -> float:
        """Revoke every capability of ``tenant`` minted until now (here, in the registry for
        other processes and restarts, and in the audit log); returns the cut-off time."""
        now = time.time()
        until = now + self.authority.max_ttl + 60
        self.authority.revocations.revoke_tenant(tenant, before=now)
        await self.registry.add_revocation(tenant, cap_id=None, not_before=now, expires_at=until)
        self.audit.emit(
            AuditEvent(
                Actions.CAPABILITY_REVOKE,
                actor=actor or Actor(),
                target=Target(tenant=tenant),
                details={"scope": "tenant", "before": now},
            )
        )
        return now

    def revoked_elsewhere(self, tenant: str, before: float) -> None:
        """Another process revoked ``tenant``'s capabilities (a broadcast): apply it here."""
        self.authority.revocations.revoke_tenant(tenant, before=before)
