"""Audit event contract. Imports nothing of the project.

Producers (the gateway core, the server, tenancy enforcement) build an :class:`AuditEvent` and hand
it to an :class:`AuditSink`. ``emit`` never blocks on a database and never raises for I/O: the sink
queues the event and a background writer persists it (hash-chained) later.

Control actions (clear, move, rotations, tenant lifecycle) must not be acknowledged before their
event is durable: they call :func:`record_durably`, which awaits a :class:`DurableAuditSink`'s
``record`` (the event is in the database or fsync-ed in the local spool when it returns) and
falls back to ``emit`` for a sink that only queues (test doubles).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["Actor", "Target", "AuditEvent", "AuditSink", "DurableAuditSink", "Actions", "record_durably"]


class Actions:
    """Action names (dotted, lowercase)."""

    CLEAR_REQUESTED = "clear.requested"
    CLEAR_COMPLETED = "clear.completed"
    MOVE = "move"
    PIN = "pin"
    UNPIN = "unpin"
    KEY_CREATE = "key.create"
    KEY_ROTATE = "key.rotate"
    KEY_DESTROY = "key.destroy"
    KEY_LEASE = "key.lease"  # no longer emitted (the data-key lease is gone); older logs still hold it
    KEY_ISSUE = "key.issue"  # per-envelope keys issued to a remote worker: one event per request, with the count
    KEK_ROTATE = "kek.rotate"
    CHUNK_DELETE = "chunk.delete"
    TENANT_CREATE = "tenant.create"
    TENANT_DISABLE = "tenant.disable"
    CAPABILITY_MINT = "capability.mint"
    CAPABILITY_REVOKE = "capability.revoke"
    AUTHZ_DENIED = "authz.denied"
    AUTHN_FAILED = "authn.failed"
    INTEGRITY_FAILURE = "integrity.failure"
    AUDIT_CHECKPOINT = "audit.checkpoint"
    SCOPE_CHANGE = "scope.change"  # a sharing scope created, or a member added or removed
    PREFIX_PUBLISH = "prefix.publish"
    PREFIX_WARM = "prefix.warm"  # the chunks a warm-up stores, checked and recorded
    PREFIX_REVOKE = "prefix.revoke"


@dataclass(frozen=True, slots=True)
class Actor:
    subject: str | None = None
    issuer: str | None = None
    tenant: str | None = None
    client_id: str | None = None
    token_id: str | None = None
    source: str | None = None


@dataclass(frozen=True, slots=True)
class Target:
    tenant: str | None = None
    namespace: str | None = None
    chunk_count: int | None = None
    chunk_digest: str | None = None  # sha256 over the sorted chunk keys, hex
    tier_from: str | None = None
    tier_to: str | None = None


@dataclass(frozen=True, slots=True)
class AuditEvent:
    action: str
    outcome: str = "success"  # "success" | "failure" | "denied"
    actor: Actor = field(default_factory=Actor)
    target: Target = field(default_factory=Target)
    details: dict[str, Any] = field(default_factory=dict)
    # normally None (a UUIDv7 is given at emit); a producer that may record the same event twice
    # across a crash (a resumed clear) names it, so the log keeps it once
    event_id: str | None = None


@runtime_checkable
class AuditSink(Protocol):
    def emit(self, event: AuditEvent) -> None:
        """Queue an event; never blocks on I/O, never raises for I/O."""
        ...


@runtime_checkable
class DurableAuditSink(AuditSink, Protocol):
    async def record(self, event: AuditEvent) -> None:
        """Queue an event and return once it is durable (database or fsync-ed spool)."""
        ...


async def record_durably(sink: AuditSink, event: AuditEvent) -> None:
    """``await sink.record(event)`` where the sink can; ``sink.emit(event)`` otherwise."""
    record = getattr(sink, "record", None)
    if record is None:
        sink.emit(event)
        return
    await record(event)
