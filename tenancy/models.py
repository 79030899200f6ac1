"""Registry tables (owned by tenancy; one Alembic history in migrations/ creates them).

Secrets in these tables are stored only wrapped by the KEK: data keys, namespace epoch salts and
the master secret. A destroyed data key or a replaced epoch salt leaves no copy behind.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

__all__ = [
    "RegistryBase",
    "registry_metadata",
    "Tenant",
    "Namespace",
    "DataKey",
    "Pin",
    "ClearJob",
    "WrappedSecret",
    "Revocation",
    "SharingScope",
    "ScopeMember",
    "Publication",
    "PublishedChunk",
    "utcnow",
]

registry_metadata = MetaData(
    naming_convention={
        "ix": "ix_%(column_0_label)s",
        "uq": "uq_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)


def utcnow() -> datetime:
    return datetime.now(UTC)


class RegistryBase(DeclarativeBase):
    metadata = registry_metadata


class Tenant(RegistryBase):
    __tablename__ = "kv_tenants"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | disabled
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Namespace(RegistryBase):
    __tablename__ = "kv_namespaces"
    tenant_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("kv_tenants.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0)
    wrapped_salt: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DataKey(RegistryBase):
    __tablename__ = "kv_data_keys"
    tenant_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("kv_tenants.id", ondelete="CASCADE"), primary_key=True
    )
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    wrapped_key: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    kek_id: Mapped[str] = mapped_column(String(256))
    state: Mapped[str] = mapped_column(String(16), default="active")  # active|retired|destroyed
    invocations: Mapped[int] = mapped_column(BigInteger, default=0)
    invocation_limit: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    destroyed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Pin(RegistryBase):
    __tablename__ = "kv_pins"
    tenant_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    namespace: Mapped[str] = mapped_column(String(128), primary_key=True)
    digest: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ClearJob(RegistryBase):
    """A secure clear, recorded before any deletion so a crash in between is resumed at start."""

    __tablename__ = "kv_clear_jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    namespace: Mapped[str | None] = mapped_column(String(128), nullable=True)
    scope: Mapped[str] = mapped_column(String(16))  # tenant | namespace | chunks
    # requested -> shredded (keys destroyed, epochs bumped) -> completed
    state: Mapped[str] = mapped_column(String(16), default="requested", index=True)
    details: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    deleted_chunks: Mapped[int] = mapped_column(BigInteger, default=0)
    deleted_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class WrappedSecret(RegistryBase):
    """Gateway-wide secrets (the namespace master secret, the capability key), KEK-wrapped."""

    __tablename__ = "kv_secrets"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, default=1)
    wrapped: Mapped[bytes] = mapped_column(LargeBinary)
    kek_id: Mapped[str] = mapped_column(String(256))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class Revocation(RegistryBase):
    """Revoked capabilities: one id (cap_id set) or every capability of a tenant minted before
    ``not_before`` (cap_id empty)."""

    __tablename__ = "kv_revocations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(String(128), index=True)
    cap_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    not_before: Mapped[float | None] = mapped_column(nullable=True)
    expires_at: Mapped[float] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SharingScope(RegistryBase):
    """A sharing scope for published prefixes (docs/architecture.md, "Published prefixes"): a
    named group of tenants, or every tenant. Its keys are those of the internal owner
    ``tenancy.sharing.scope_owner(name)``, a kv_tenants row that no tenant name can equal."""

    __tablename__ = "kv_scopes"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    everyone: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class ScopeMember(RegistryBase):
    __tablename__ = "kv_scope_members"
    scope: Mapped[str] = mapped_column(
        String(64), ForeignKey("kv_scopes.name", ondelete="CASCADE"), primary_key=True
    )
    tenant_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("kv_tenants.id", ondelete="CASCADE"), primary_key=True, index=True
    )


class Publication(RegistryBase):
    """A published prefix: its token ids (int32 little endian), kept to check the chained hashes
    a warm-up reports. state: active -> revoking (shredding and deleting) -> revoked."""

    __tablename__ = "kv_prefixes"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    scope: Mapped[str] = mapped_column(String(64), ForeignKey("kv_scopes.name"), index=True)
    model: Mapped[str] = mapped_column(String(256))
    digest: Mapped[str] = mapped_column(String(64))
    tokens: Mapped[bytes] = mapped_column(LargeBinary)
    num_tokens: Mapped[int] = mapped_column(Integer)
    key_version: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default="active", index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class PublishedChunk(RegistryBase):
    """A whole chunk of a published prefix as a warm-up stored it, for one model fingerprint."""

    __tablename__ = "kv_prefix_chunks"
    prefix_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("kv_prefixes.id", ondelete="CASCADE"), primary_key=True
    )
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    chained_hash: Mapped[str] = mapped_column(String(64))
