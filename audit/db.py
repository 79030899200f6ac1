"""Async engines for the audit log (asyncpg for Postgres, aiosqlite for SQLite) and schema setup.

``create_audit_engine`` sets what the chain writer relies on: a connect timeout and pre-ping on
Postgres, so a restarted server is noticed at once (audit.store plans its event-id lookup
afresh each time, see there); a busy timeout and WAL on SQLite, so several
processes can take turns on ``BEGIN IMMEDIATE``. An engine made elsewhere works too.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from audit.errors import AuditStorageError
from audit.models import audit_metadata

__all__ = ["create_audit_engine", "create_audit_schema", "dialect_of", "drop_audit_schema"]


def dialect_of(engine: AsyncEngine) -> str:
    return engine.dialect.name


def create_audit_engine(url: str, *, connect_timeout: float = 5.0, **kwargs: Any) -> AsyncEngine:
    """An async engine for ``postgresql+asyncpg://`` or ``sqlite+aiosqlite://`` URLs."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise AuditStorageError(f"not a database URL: {exc}") from None
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.get_driver_name() != "asyncpg":
            raise AuditStorageError("the audit log needs postgresql+asyncpg:// on Postgres")
        kwargs.setdefault("pool_pre_ping", True)
        kwargs.setdefault("connect_args", {"timeout": connect_timeout, "command_timeout": 60})
        return create_async_engine(parsed, **kwargs)
    if backend == "sqlite":
        if parsed.get_driver_name() != "aiosqlite":
            raise AuditStorageError("the audit log needs sqlite+aiosqlite:// on SQLite")
        kwargs.setdefault("connect_args", {"timeout": 60.0})
        engine = create_async_engine(parsed, **kwargs)
        on_disk = parsed.database not in (None, "", ":memory:")

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            try:
                cur.execute("PRAGMA busy_timeout = 60000")
                if on_disk:
                    cur.execute("PRAGMA journal_mode = WAL")
            finally:
                cur.close()

        return engine
    raise AuditStorageError(f"unsupported audit database {backend!r}: use Postgres or SQLite")


async def create_audit_schema(engine: AsyncEngine) -> None:
    """Create the audit table and its append-only guard (tests, embedded mode without Alembic)."""
    try:
        async with engine.begin() as conn:
            await conn.run_sync(audit_metadata.create_all)
    except Exception as exc:  # library errors end here
        raise AuditStorageError(f"could not create the audit schema: {exc}") from exc


async def drop_audit_schema(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(audit_metadata.drop_all)
        if engine.dialect.name == "postgresql":
            await conn.exec_driver_sql("DROP FUNCTION IF EXISTS kv_audit_events_refuse_change()")
