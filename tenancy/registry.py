"""The registry: tenants, namespaces and epochs, wrapped data keys, pins, clear jobs, secrets.

SQLAlchemy 2.0 async over SQLite (aiosqlite, the embedded default) or Postgres (asyncpg).
Every multi-step change is one transaction; concurrent processes are safe (unique keys and
conditional UPDATEs, never read-modify-write across transactions).
"""

from __future__ import annotations

import functools
import inspect
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ParamSpec, TypeVar, cast

from sqlalchemy import delete, event, func, select, union_all, update
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import CursorResult, Result
from sqlalchemy.exc import DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from tenancy.errors import DependencyUnavailable
from tenancy.models import (
    ClearJob,
    DataKey,
    Namespace,
    Pin,
    Revocation,
    Tenant,
    WrappedSecret,
    utcnow,
)

__all__ = [
    "Registry",
    "RegistryError",
    "UnknownTenant",
    "TenantDisabled",
    "TenantExists",
    "KeyRecord",
    "NamespaceRecord",
    "ClearJobRecord",
    "make_engine",
]

WrapFn = Callable[[int], bytes]


class RegistryError(Exception):
    """The registry database failed or refused a change."""


class UnknownTenant(RegistryError):
    pass


class TenantDisabled(RegistryError):
    pass


class TenantExists(RegistryError):
    pass


@dataclass(frozen=True, slots=True)
class KeyRecord:
    tenant: str
    version: int
    wrapped_key: bytes | None
    kek_id: str
    state: str
    invocations: int
    invocation_limit: int


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    tenant: str
    name: str
    epoch: int
    wrapped_salt: bytes


@dataclass(frozen=True, slots=True)
class ClearJobRecord:
    id: str
    tenant: str
    namespace: str | None
    scope: str
    state: str
    details: dict[str, Any]
    deleted_chunks: int
    deleted_bytes: int
    requested_at: datetime
    completed_at: datetime | None


def make_engine(url: str) -> AsyncEngine:
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_async_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5)


def _key(row: DataKey) -> KeyRecord:
    return KeyRecord(
        row.tenant_id, row.version, row.wrapped_key, row.kek_id, row.state,
        row.invocations, row.invocation_limit,
    )


def _job(row: ClearJob) -> ClearJobRecord:
    return ClearJobRecord(
        row.id, row.tenant_id, row.namespace, row.scope, row.state, dict(row.details or {}),
        row.deleted_chunks, row.deleted_bytes, row.requested_at, row.completed_at,
    )


class Registry:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._session = async_sessionmaker(engine, expire_on_commit=False)

    @classmethod
    def from_url(cls, url: str) -> Registry:
        return cls(make_engine(url))

    async def aclose(self) -> None:
        await self.engine.dispose()

    async def ping(self) -> None:
        """Raise RegistryError unless the database answers (readiness)."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(select(1))
        except Exception as exc:
            raise RegistryError("the registry database is unreachable") from exc

    # -- tenants -----------------------------------------------------------------------------
    async def create_tenant(self, tenant: str) -> None:
        try:
            async with self._session.begin() as s:
                s.add(Tenant(id=tenant, status="active"))
        except IntegrityError as exc:
            raise TenantExists(f"tenant {tenant!r} exists") from exc

    async def tenant_status(self, tenant: str) -> str:
        async with self._session() as s:
            row = await s.get(Tenant, tenant)
        if row is None:
            raise UnknownTenant("unknown tenant")
        return row.status

    async def require_active(self, tenant: str) -> None:
        status = await self.tenant_status(tenant)
        if status != "active":
            raise TenantDisabled("tenant is disabled")

    async def disable_tenant(self, tenant: str) -> None:
        async with self._session.begin() as s:
            res = await s.execute(
                update(Tenant).where(Tenant.id == tenant).values(status="disabled", disabled_at=utcnow())
            )
            if _rowcount(res) == 0:
                raise UnknownTenant("unknown tenant")

    async def list_tenants(self) -> list[tuple[str, str]]:
        async with self._session() as s:
            # a sharing scope's owner row (tenancy.sharing) holds keys; it is not a tenant
            q = select(Tenant.id, Tenant.status).where(~Tenant.id.startswith("scope:"))
            rows = (await s.execute(q.order_by(Tenant.id))).all()
        return [(r[0], r[1]) for r in rows]

    # -- namespaces --------------------------------------------------------------------------
    async def get_namespace(self, tenant: str, name: str) -> NamespaceRecord | None:
        async with self._session() as s:
            row = await s.get(Namespace, (tenant, name), populate_existing=True)
        if row is None:
            return None
        return NamespaceRecord(tenant, name, row.epoch, row.wrapped_salt)

    async def create_namespace(self, tenant: str, name: str, wrapped_salt: bytes) -> NamespaceRecord:
        """Insert epoch 0 unless the namespace exists; return what is stored (race-safe)."""
        try:
            async with self._session.begin() as s:
                if await s.get(Tenant, tenant) is None:
                    raise UnknownTenant("unknown tenant")
                s.add(Namespace(tenant_id=tenant, name=name, epoch=0, wrapped_salt=wrapped_salt))
        except IntegrityError:
            pass
        rec = await self.get_namespace(tenant, name)
        assert rec is not None
        return rec

    async def list_namespaces(self, tenant: str) -> list[NamespaceRecord]:
        async with self._session() as s:
            rows = (await s.execute(select(Namespace).where(Namespace.tenant_id == tenant))).scalars()
            return [NamespaceRecord(r.tenant_id, r.name, r.epoch, r.wrapped_salt) for r in rows]

    async def bump_epoch(self, tenant: str, name: str, new_epoch: int, wrapped_salt: bytes) -> bool:
        """Set epoch to ``new_epoch`` with a fresh salt if it is still ``new_epoch - 1``; the old
        salt is overwritten (crypto-shredding the old epoch). False if someone else bumped it."""
        async with self._session.begin() as s:
            res = await s.execute(
                update(Namespace)
                .where(Namespace.tenant_id == tenant, Namespace.name == name, Namespace.epoch == new_epoch - 1)
                .values(epoch=new_epoch, wrapped_salt=wrapped_salt, updated_at=utcnow())
            )
            return _rowcount(res) == 1

    # -- data keys ---------------------------------------------------------------------------
    async def active_key(self, tenant: str) -> KeyRecord | None:
        async with self._session() as s:
            row = (
                await s.execute(
                    select(DataKey)
                    .where(DataKey.tenant_id == tenant, DataKey.state == "active")
                    .order_by(DataKey.version.desc())
                    .limit(1)
                )
            ).scalar_one_or_none()
        return None if row is None else _key(row)

    async def get_key(self, tenant: str, version: int) -> KeyRecord | None:
        async with self._session() as s:
            row = await s.get(DataKey, (tenant, version), populate_existing=True)
        return None if row is None else _key(row)

    async def list_keys(self, tenant: str) -> list[KeyRecord]:
        async with self._session() as s:
            rows = (
                await s.execute(select(DataKey).where(DataKey.tenant_id == tenant).order_by(DataKey.version))
            ).scalars()
            return [_key(r) for r in rows]

    async def add_key(
        self, tenant: str, wrap: WrapFn, kek_id: str, invocation_limit: int, *, expect_active: int | None
    ) -> KeyRecord:
        """Create the next key version and retire the active one, atomically.

        ``expect_active`` is the version the caller saw as active (None: none); if another
        process rotated in between, nothing is created and the now-active key is returned.
        ``wrap(version) -> (wrapped_key)`` wraps a fresh key for that version (the context binds it).
        """
        for _ in range(5):
            current = await self.active_key(tenant)
            if (current.version if current else None) != expect_active and current is not None:
                return current
            async with self._session() as s:
                top = (await s.execute(select(func.max(DataKey.version)).where(DataKey.tenant_id == tenant))).scalar()
            version = (top or 0) + 1
            wrapped = wrap(version)
            try:
                async with self._session.begin() as s:
                    if await s.get(Tenant, tenant) is None:
                        raise UnknownTenant("unknown tenant")
                    await s.execute(
                        update(DataKey)
                        .where(DataKey.tenant_id == tenant, DataKey.state == "active")
                        .values(state="retired")
                    )
                    s.add(
                        DataKey(
                            tenant_id=tenant, version=version, wrapped_key=wrapped, kek_id=kek_id,
                            state="active", invocations=0, invocation_limit=invocation_limit,
                        )
                    )
            except IntegrityError:
                continue  # another process took this version number: look again
            rec = await self.get_key(tenant, version)
            assert rec is not None
            return rec
        raise RegistryError("could not create a key version (contention)")

    async def reserve_invocations(self, tenant: str, version: int, count: int) -> bool:
        """Take ``count`` encryptions from the key's budget; False when it would exceed the limit."""
        async with self._session.begin() as s:
            res = await s.execute(
                update(DataKey)
                .where(
                    DataKey.tenant_id == tenant,
                    DataKey.version == version,
                    DataKey.state == "active",
                    DataKey.invocations + count <= DataKey.invocation_limit,
                )
                .values(invocations=DataKey.invocations + count)
            )
            return _rowcount(res) == 1

    async def destroy_keys(self, tenant: str, versions: Sequence[int] | None = None) -> list[int]:
        """Erase wrapped key material (NULL) and mark destroyed. Returns the versions destroyed now."""
        async with self._session.begin() as s:
            q = select(DataKey.version).where(DataKey.tenant_id == tenant, DataKey.state != "destroyed")
            if versions is not None:
                q = q.where(DataKey.version.in_(list(versions)))
            found = [r[0] for r in (await s.execute(q)).all()]
            if found:
                await s.execute(
                    update(DataKey)
                    .where(DataKey.tenant_id == tenant, DataKey.version.in_(found))
                    .values(state="destroyed", wrapped_key=None, destroyed_at=utcnow())
                )
        return sorted(found)

    # -- pins --------------------------------------------------------------------------------
    async def add_pin(self, tenant: str, namespace: str, digest: str) -> bool:
        try:
            async with self._session.begin() as s:
                s.add(Pin(tenant_id=tenant, namespace=namespace, digest=digest))
            return True
        except IntegrityError:
            return False

    async def remove_pin(self, tenant: str, namespace: str, digest: str) -> bool:
        async with self._session.begin() as s:
            res = await s.execute(
                delete(Pin).where(Pin.tenant_id == tenant, Pin.namespace == namespace, Pin.digest == digest)
            )
            return _rowcount(res) > 0

    async def list_pins(self, tenant: str, namespace: str | None = None) -> list[tuple[str, str]]:
        async with self._session() as s:
            q = select(Pin.namespace, Pin.digest).where(Pin.tenant_id == tenant)
            if namespace is not None:
                q = q.where(Pin.namespace == namespace)
            return [(r[0], r[1]) for r in (await s.execute(q)).all()]

    async def remove_pins(self, tenant: str, namespace: str | None = None) -> int:
        async with self._session.begin() as s:
            q = delete(Pin).where(Pin.tenant_id == tenant)
            if namespace is not None:
                q = q.where(Pin.namespace == namespace)
            return _rowcount(await s.execute(q))

    # -- clear jobs --------------------------------------------------------------------------
    async def create_clear_job(self, tenant: str, namespace: str | None, scope: str, details: dict[str, Any]) -> ClearJobRecord:
        job_id = secrets.token_hex(16)
        async with self._session.begin() as s:
            s.add(ClearJob(id=job_id, tenant_id=tenant, namespace=namespace, scope=scope, details=details))
        rec = await self.get_clear_job(job_id)
        assert rec is not None
        return rec

    async def get_clear_job(self, job_id: str) -> ClearJobRecord | None:
        async with self._session() as s:
            row = await s.get(ClearJob, job_id, populate_existing=True)
        return None if row is None else _job(row)

    async def update_clear_job(self, job_id: str, **values: Any) -> None:
        async with self._session.begin() as s:
            await s.execute(update(ClearJob).where(ClearJob.id == job_id).values(**values))

    async def incomplete_clear_jobs(self) -> list[ClearJobRecord]:
        async with self._session() as s:
            rows = (
                await s.execute(
                    select(ClearJob).where(ClearJob.state != "completed").order_by(ClearJob.requested_at)
                )
            ).scalars()
            return [_job(r) for r in rows]

    # -- gateway secrets ---------------------------------------------------------------------
    async def get_secret(self, name: str) -> tuple[bytes, str] | None:
        async with self._session() as s:
            row = (
                await s.execute(
                    select(WrappedSecret).where(WrappedSecret.name == name).order_by(WrappedSecret.version.desc()).limit(1)
                )
            ).scalar_one_or_none()
        return None if row is None else (row.wrapped, row.kek_id)

    async def put_secret_if_absent(self, name: str, wrapped: bytes, kek_id: str) -> tuple[bytes, str]:
        """Store version 1 of a secret unless one exists; return what is stored (race-safe)."""
        try:
            async with self._session.begin() as s:
                s.add(WrappedSecret(name=name, version=1, wrapped=wrapped, kek_id=kek_id))
        except IntegrityError:
            pass
        stored = await self.get_secret(name)
        assert stored is not None
        return stored

    async def wrapped_by_kek(self) -> dict[str, int]:
        """How many live KEK-wrapped keys (gateway secrets, data keys not destroyed) each KEK id
        wrapped; empty for a database without the registry's tables."""
        async with self.engine.connect() as conn:
            if not await conn.run_sync(lambda c: sa_inspect(c).has_table(WrappedSecret.__tablename__)):
                return {}
            ids = union_all(
                select(WrappedSecret.kek_id),
                select(DataKey.kek_id).where(DataKey.wrapped_key.is_not(None)),
            ).subquery()
            rows = await conn.execute(select(ids.c.kek_id, func.count()).group_by(ids.c.kek_id))
            return {str(r[0]): int(r[1]) for r in rows}

    # -- capability revocations --------------------------------------------------------------
    async def add_revocation(
        self, tenant: str, *, cap_id: str | None, not_before: float | None, expires_at: float
    ) -> None:
        async with self._session.begin() as s:
            s.add(Revocation(tenant_id=tenant, cap_id=cap_id, not_before=not_before, expires_at=expires_at))

    async def live_revocations(self, now: float) -> list[tuple[str, str | None, float | None, float]]:
        async with self._session() as s:
            rows = (
                await s.execute(
                    select(Revocation.tenant_id, Revocation.cap_id, Revocation.not_before, Revocation.expires_at)
                    .where(Revocation.expires_at > now)
                )
            ).all()
        return [(r[0], r[1], r[2], r[3]) for r in rows]



def _is_outage(exc: BaseException) -> bool:
    """The database did not answer (refused, reset, timed out, shutting down), as opposed to an
    answer we did not like (an integrity error, bad data)."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    if isinstance(exc, DBAPIError):
        # a connection refused at connect time (the server shutting down or starting up) is
        # wrapped as a plain DBAPIError, not invalidated: its driver error says what it was
        return bool(exc.connection_invalidated) or _driver_outage(exc.orig)
    if isinstance(exc, (OSError, TimeoutError)):
        return True
    return _driver_outage(exc)


# SQLSTATE of a server that does not take work now: class 08 (connection exception), and
# admin_shutdown, crash_shutdown, cannot_connect_now of class 57 (operator intervention)
_OUTAGE_STATES = ("57P01", "57P02", "57P03")


def _driver_outage(exc: BaseException | None) -> bool:
    """The driver's own connection errors, and what SQLAlchemy's adapter wraps them in (the
    asyncpg exception is its ``__cause__``): CannotConnectNowError, ConnectionDoesNotExistError..."""
    for _ in range(4):
        if exc is None:
            return False
        state = str(getattr(exc, "sqlstate", "") or "")
        if state.startswith("08") or state in _OUTAGE_STATES:
            return True
        name = type(exc).__name__
        if type(exc).__module__.startswith("asyncpg") and ("Connect" in name or "Connection" in name):
            return True
        if isinstance(exc, (OSError, TimeoutError)):
            return True
        exc = exc.__cause__
    return False


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (its result is a CursorResult; ``execute`` is typed as Result)."""
    return cast("CursorResult[Any]", result).rowcount


def _translating(fn: Callable[_P, Awaitable[_R]]) -> Callable[_P, Coroutine[Any, Any, _R]]:
    @functools.wraps(fn)
    async def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await fn(*args, **kwargs)
        except Exception as exc:
            if _is_outage(exc):
                raise DependencyUnavailable("database") from exc
            raise

    return call


# Every query method: an outage becomes DependencyUnavailable at the package boundary.
for _name, _fn in list(vars(Registry).items()):
    if inspect.iscoroutinefunction(_fn) and not _name.startswith("_") and _name not in ("aclose", "ping"):
        setattr(Registry, _name, _translating(_fn))
