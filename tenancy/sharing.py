"""Sharing scopes and published prefixes in the registry (docs/architecture.md, "Published prefixes").

A scope owns keys as a tenant does (namespace epochs and salts, data-key versions wrapped by the
KEK), under an internal owner id, ``scope_owner(name)`` = ``"scope:" + name``: a ``kv_tenants``
row that no tenant can ever be, since a tenant name never holds ``:`` (``tenancy.names``), so
every key machine of a tenant (keyring, namespace resolver, labels) serves a scope unchanged and a
scope's keys, labels and envelope contexts never equal a tenant's. Members are tenants, or every
tenant (``everyone``). A publication keeps its token ids so that the chained hashes a warm-up
reports can be recomputed and checked; its chunks are recorded per model fingerprint digest.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker

from tenancy.models import Publication, PublishedChunk, ScopeMember, SharingScope, Tenant, utcnow
from tenancy.names import check_name
from tenancy.registry import Registry, RegistryError, UnknownTenant, _rowcount, _translating

__all__ = [
    "OWNER_PREFIX",
    "SCOPE_NAMESPACE",
    "PublicationRecord",
    "ScopeExists",
    "ScopeRecord",
    "SharingRegistry",
    "SharingTable",
    "UnknownPublication",
    "UnknownScope",
    "is_scope_owner",
    "scope_owner",
]

OWNER_PREFIX = "scope:"
SCOPE_NAMESPACE = "published"
"""The one namespace of a scope's owner: every publication of the scope is stored there."""


def scope_owner(scope: str) -> str:
    """The internal owner id of a scope's keys (never a tenant name: see the module docstring)."""
    return OWNER_PREFIX + check_name(scope, "scope")


def is_scope_owner(owner: str) -> bool:
    return owner.startswith(OWNER_PREFIX)


class ScopeExists(RegistryError):
    pass


class UnknownScope(RegistryError):
    pass


class UnknownPublication(RegistryError):
    pass


@dataclass(frozen=True, slots=True)
class ScopeRecord:
    name: str
    everyone: bool
    members: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PublicationRecord:
    id: str
    scope: str
    model: str
    digest: str
    num_tokens: int
    key_version: int
    state: str
    created_at: datetime
    revoked_at: datetime | None
    tokens: bytes


@dataclass(frozen=True, slots=True)
class SharingTable:
    """What readers need, read in one go: each scope's members (``everyone``: every tenant), the
    chained hashes (hex) of every active publication's recorded chunks, and the ids of its active
    publications, by scope."""

    everyone: frozenset[str]
    members: dict[str, frozenset[str]]
    hashes: dict[str, frozenset[str]]
    publications: dict[str, frozenset[str]]


def _pub(row: Publication) -> PublicationRecord:
    return PublicationRecord(
        row.id, row.scope, row.model, row.digest, row.num_tokens, row.key_version, row.state,
        row.created_at, row.revoked_at, row.tokens,
    )


class SharingRegistry:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self._session = async_sessionmaker(registry.engine, expire_on_commit=False)

    # -- scopes ------------------------------------------------------------------------------
    async def create_scope(self, name: str, *, everyone: bool, members: Sequence[str] = ()) -> ScopeRecord:
        """A scope and its owner row; UnknownTenant where a member is not registered."""
        owner = scope_owner(name)
        exists = False
        try:
            async with self._session.begin() as s:
                for tenant in members:
                    if is_scope_owner(tenant) or await s.get(Tenant, tenant) is None:
                        raise UnknownTenant(f"unknown tenant {tenant!r}")
                s.add(Tenant(id=owner, status="active"))
                s.add(SharingScope(name=name, everyone=everyone))
                await s.flush()
                for tenant in sorted(set(members)):
                    s.add(ScopeMember(scope=name, tenant_id=tenant))
        except IntegrityError:
            exists = True
        if exists:  # raised outside the handler: a refusal, with no database error in its chain
            raise ScopeExists(f"scope {name!r} exists")
        return ScopeRecord(name, everyone, tuple(sorted(set(members))))

    async def get_scope(self, name: str) -> ScopeRecord:
        async with self._session() as s:
            row = await s.get(SharingScope, name, populate_existing=True)
            if row is None:
                raise UnknownScope(f"unknown scope {name!r}")
            members = (await s.execute(select(ScopeMember.tenant_id).where(ScopeMember.scope == name))).scalars()
            return ScopeRecord(name, row.everyone, tuple(sorted(members)))

    async def list_scopes(self) -> list[ScopeRecord]:
        async with self._session() as s:
            rows = (await s.execute(select(SharingScope).order_by(SharingScope.name))).scalars().all()
            pairs = (await s.execute(select(ScopeMember.scope, ScopeMember.tenant_id))).all()
        members: dict[str, list[str]] = {}
        for scope, tenant in pairs:
            members.setdefault(scope, []).append(tenant)
        return [ScopeRecord(r.name, r.everyone, tuple(sorted(members.get(r.name, [])))) for r in rows]

    async def add_member(self, scope: str, tenant: str) -> bool:
        """False where the tenant is a member already."""
        try:
            async with self._session.begin() as s:
                if await s.get(SharingScope, scope) is None:
                    raise UnknownScope(f"unknown scope {scope!r}")
                if is_scope_owner(tenant) or await s.get(Tenant, tenant) is None:
                    raise UnknownTenant(f"unknown tenant {tenant!r}")
                s.add(ScopeMember(scope=scope, tenant_id=tenant))
            return True
        except IntegrityError:
            return False

    async def remove_member(self, scope: str, tenant: str) -> bool:
        async with self._session.begin() as s:
            if await s.get(SharingScope, scope) is None:
                raise UnknownScope(f"unknown scope {scope!r}")
            res = await s.execute(delete(ScopeMember).where(ScopeMember.scope == scope, ScopeMember.tenant_id == tenant))
            return _rowcount(res) > 0

    async def scopes_of(self, tenant: str) -> list[str]:
        """The scopes ``tenant`` reads (a member, or a scope of every tenant)."""
        async with self._session() as s:
            everyone = (await s.execute(select(SharingScope.name).where(SharingScope.everyone.is_(True)))).scalars()
            named = (await s.execute(select(ScopeMember.scope).where(ScopeMember.tenant_id == tenant))).scalars()
            return sorted({*everyone, *named})

    # -- publications ------------------------------------------------------------------------
    async def add_publication(
        self, scope: str, model: str, digest: str, tokens: bytes, num_tokens: int, key_version: int,
    ) -> PublicationRecord:
        pub_id = secrets.token_hex(12)
        async with self._session.begin() as s:
            if await s.get(SharingScope, scope) is None:
                raise UnknownScope(f"unknown scope {scope!r}")
            s.add(Publication(
                id=pub_id, scope=scope, model=model, digest=digest, tokens=tokens, num_tokens=num_tokens,
                key_version=key_version, state="active",
            ))
        return await self.get_publication(pub_id)

    async def get_publication(self, pub_id: str) -> PublicationRecord:
        async with self._session() as s:
            row = await s.get(Publication, pub_id, populate_existing=True)
        if row is None:
            raise UnknownPublication("unknown prefix")
        return _pub(row)

    async def list_publications(self, scope: str | None = None) -> list[PublicationRecord]:
        async with self._session() as s:
            q = select(Publication).order_by(Publication.created_at)
            if scope is not None:
                q = q.where(Publication.scope == scope)
            return [_pub(r) for r in (await s.execute(q)).scalars()]

    async def record_chunks(self, pub_id: str, fingerprint: str, hashes: Sequence[str]) -> None:
        """Record the chunks a warm-up stores (idempotent: the same hashes for the same
        fingerprint, since they are computed from the publication's tokens)."""
        async with self._session.begin() as s:
            row = await s.get(Publication, pub_id)
            if row is None or row.state != "active":
                raise UnknownPublication("unknown prefix")
            have = {
                r[0]: r[1] for r in (await s.execute(
                    select(PublishedChunk.idx, PublishedChunk.chained_hash)
                    .where(PublishedChunk.prefix_id == pub_id, PublishedChunk.fingerprint == fingerprint)
                )).all()
            }
            for idx, h in enumerate(hashes):
                if idx not in have:
                    s.add(PublishedChunk(prefix_id=pub_id, fingerprint=fingerprint, idx=idx, chained_hash=h))

    async def chunks_of(self, pub_id: str) -> list[str]:
        """Every chained hash (hex) recorded for the publication, whatever its state."""
        async with self._session() as s:
            rows = await s.execute(select(PublishedChunk.chained_hash).where(PublishedChunk.prefix_id == pub_id))
            return sorted({r[0] for r in rows})

    async def set_state(self, pub_id: str, state: str, *, expect: Sequence[str]) -> bool:
        """Move a publication to ``state`` if it is in one of ``expect`` (race-safe)."""
        values: dict[str, object] = {"state": state}
        if state == "revoked":
            values["revoked_at"] = utcnow()
        async with self._session.begin() as s:
            res = await s.execute(
                update(Publication).where(Publication.id == pub_id, Publication.state.in_(list(expect))).values(**values)
            )
            return _rowcount(res) == 1

    async def table(self) -> SharingTable:
        async with self._session() as s:
            scopes = (await s.execute(select(SharingScope.name, SharingScope.everyone))).all()
            pairs = (await s.execute(select(ScopeMember.scope, ScopeMember.tenant_id))).all()
            chunks = (await s.execute(
                select(Publication.scope, PublishedChunk.chained_hash)
                .join(PublishedChunk, PublishedChunk.prefix_id == Publication.id)
                .where(Publication.state == "active")
            )).all()
            active = (await s.execute(select(Publication.scope, Publication.id).where(Publication.state == "active"))).all()
        members: dict[str, set[str]] = {name: set() for name, _e in scopes}
        for scope, tenant in pairs:
            members.setdefault(scope, set()).add(tenant)
        hashes: dict[str, set[str]] = {}
        for scope, h in chunks:
            hashes.setdefault(scope, set()).add(h)
        publications: dict[str, set[str]] = {}
        for scope, pub_id in active:
            publications.setdefault(scope, set()).add(pub_id)
        return SharingTable(
            everyone=frozenset(name for name, e in scopes if e),
            members={k: frozenset(v) for k, v in members.items()},
            hashes={k: frozenset(v) for k, v in hashes.items()},
            publications={k: frozenset(v) for k, v in publications.items()},
        )


# Every query method: a database outage becomes DependencyUnavailable, as in tenancy.registry.
for _name, _fn in list(vars(SharingRegistry).items()):
    if not _name.startswith("_") and inspect.iscoroutinefunction(_fn):
        setattr(SharingRegistry, _name, _translating(_fn))
