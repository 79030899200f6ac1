"""Appending to the chain and reading it back.

One linear chain, whatever the number of writing processes: ``append`` serialises on the chain
head for the whole transaction (Postgres: ``pg_advisory_xact_lock``; SQLite: ``BEGIN IMMEDIATE``),
reads the last row, numbers and hashes the batch after it and inserts it. Commit releases the
head, so the next writer sees the new last row.

Idempotence: every event carries a unique ``event_id`` (a UNIQUE column). Under the head lock the
batch's ids already present are skipped, so replaying a batch whose commit was acknowledged
ambiguously (connection lost after COMMIT) writes nothing twice and never breaks the chain.
Postgres plans the event-id lookup afresh per batch (``plan_cache_mode``); the INSERT keeps its plan.

``recorded_at`` is ``max(now, previous recorded_at)``: monotonic along ``seq`` even when the
writers' clocks differ, so a time window on it is a contiguous run of the chain.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from sqlalchemy import Select, func, insert, or_, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from audit.errors import AuditError, AuditStorageError
from audit.models import audit_events
from audit.record import GENESIS_HASH, AuditRecord, PendingEvent

__all__ = ["CHAIN_LOCK_KEY", "AppendResult", "AuditStore", "ChainHead"]

# A fixed 63-bit advisory lock key (advisory locks are per database).
CHAIN_LOCK_KEY = int.from_bytes(hashlib.sha256(b"kvgate.audit.chain").digest()[:8], "big") >> 1
_T = audit_events.c
# Postgres: take the chain head and plan the event-id lookup afresh (set_config(..., true) is SET
# LOCAL: it ends with the transaction); then back to cached plans for the INSERT. See above.
_LOCK_AND_CUSTOM_PLANS = text(
    "SELECT pg_advisory_xact_lock(:k), set_config('plan_cache_mode', 'force_custom_plan', true)"
)
_CACHED_PLANS = text("SELECT set_config('plan_cache_mode', 'auto', true)")


@dataclass(frozen=True, slots=True)
class ChainHead:
    seq: int
    hash: str
    recorded_at: datetime | None


@dataclass(frozen=True, slots=True)
class AppendResult:
    written: int
    duplicates: int
    head: ChainHead


def _utcnow() -> datetime:
    return datetime.now(UTC)


class AuditStore:
    """The chain in one database. Does not own the engine (``aclose`` of the writer does)."""

    def __init__(self, engine: AsyncEngine, *, clock: Callable[[], datetime] = _utcnow) -> None:
        self.engine = engine
        self._clock = clock
        self._sqlite = engine.dialect.name == "sqlite"

    async def append(self, events: Sequence[PendingEvent]) -> AppendResult:
        """Chain and insert ``events`` in order in one transaction; skip ids already stored."""
        try:
            async with self.engine.connect() as conn:
                if self._sqlite:
                    conn = await conn.execution_options(isolation_level="AUTOCOMMIT")
                    await conn.exec_driver_sql("BEGIN IMMEDIATE")
                    try:
                        result = await self._append_locked(conn, events)
                        await conn.exec_driver_sql("COMMIT")
                    except BaseException:
                        await conn.exec_driver_sql("ROLLBACK")
                        raise
                    return result
                async with conn.begin():
                    await conn.execute(_LOCK_AND_CUSTOM_PLANS, {"k": CHAIN_LOCK_KEY})
                    return await self._append_locked(conn, events)
        except AuditError:
            raise
        except Exception as exc:  # SQLAlchemy, asyncpg, sqlite3, OSError: translated here
            raise AuditStorageError(f"audit append failed: {type(exc).__name__}: {exc}") from exc

    async def _append_locked(self, conn: AsyncConnection, events: Sequence[PendingEvent]) -> AppendResult:
        head = await self._head(conn)
        ids = list(dict.fromkeys(e.event_id for e in events))
        present: set[str] = set()
        if ids:
            rows = await conn.execute(select(_T.event_id).where(_T.event_id.in_(ids)))
            present = set(rows.scalars())
        if not self._sqlite:  # the INSERT keeps its cached plan
            await conn.execute(_CACHED_PLANS)
        seen: set[str] = set()
        fresh: list[PendingEvent] = []
        for e in events:
            if e.event_id not in present and e.event_id not in seen:
                seen.add(e.event_id)
                fresh.append(e)
        if not fresh:
            return AppendResult(written=0, duplicates=len(events), head=head)
        now = self._clock()
        recorded_at = now if head.recorded_at is None or now > head.recorded_at else head.recorded_at
        records: list[AuditRecord] = []
        seq, prev = head.seq, head.hash
        for e in fresh:
            seq += 1
            rec = AuditRecord.chain(e, seq=seq, recorded_at=recorded_at, prev_hash=prev)
            prev = rec.hash
            records.append(rec)
        await conn.execute(insert(audit_events), [r.to_row() for r in records])
        return AppendResult(
            written=len(records),
            duplicates=len(events) - len(records),
            head=ChainHead(seq=seq, hash=prev, recorded_at=recorded_at),
        )

    @staticmethod
    async def _head(conn: AsyncConnection) -> ChainHead:
        row = (await conn.execute(select(_T.seq, _T.hash, _T.recorded_at).order_by(_T.seq.desc()).limit(1))).first()
        if row is None:
            return ChainHead(seq=0, hash=GENESIS_HASH, recorded_at=None)
        return ChainHead(seq=row.seq, hash=row.hash, recorded_at=row.recorded_at)

    async def head(self) -> ChainHead:
        try:
            async with self.engine.connect() as conn:
                return await self._head(conn)
        except Exception as exc:
            raise AuditStorageError(f"could not read the audit chain head: {exc}") from exc

    async def last_seq(self, *, until: datetime | None = None) -> int:
        """The largest seq recorded before ``until`` (all rows when None); 0 for none."""
        stmt = select(func.max(_T.seq))
        if until is not None:
            stmt = stmt.where(_T.recorded_at < until)
        try:
            async with self.engine.connect() as conn:
                return int((await conn.execute(stmt)).scalar_one() or 0)
        except Exception as exc:
            raise AuditStorageError(f"could not read the audit chain: {exc}") from exc

    async def count(self) -> int:
        try:
            async with self.engine.connect() as conn:
                return int((await conn.execute(select(func.count()).select_from(audit_events))).scalar_one())
        except Exception as exc:
            raise AuditStorageError(f"could not count audit rows: {exc}") from exc

    @staticmethod
    def query(
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        tenant: str | None = None,
        after_seq: int | None = None,
        through_seq: int | None = None,
    ) -> Select[Any]:
        """Rows in chain order; ``since <= recorded_at < until``; ``tenant`` matches the target's
        or the actor's tenant (a tenant sees what was done to it and what its principals did);
        ``after_seq``: only rows with a larger seq."""
        stmt = select(audit_events).order_by(_T.seq)
        if after_seq is not None:
            stmt = stmt.where(_T.seq > after_seq)
        if through_seq is not None:
            stmt = stmt.where(_T.seq <= through_seq)
        if since is not None:
            stmt = stmt.where(_T.recorded_at >= since)
        if until is not None:
            stmt = stmt.where(_T.recorded_at < until)
        if tenant is not None:
            stmt = stmt.where(or_(_T.target_tenant == tenant, _T.actor_tenant == tenant))
        return stmt

    async def iter_records(
        self,
        *,
        since: datetime | None = None,
        until: datetime | None = None,
        tenant: str | None = None,
        after_seq: int | None = None,
        through_seq: int | None = None,
        batch: int = 1000,
    ) -> AsyncIterator[AuditRecord]:
        """Stream records in seq order from one snapshot (a server-side cursor on Postgres)."""
        stmt = self.query(since=since, until=until, tenant=tenant, after_seq=after_seq, through_seq=through_seq)
        stmt = stmt.execution_options(yield_per=batch)
        try:
            async with self.engine.connect() as conn:
                result = await conn.stream(stmt)
                async for row in result.mappings():
                    yield AuditRecord.from_row(cast(Mapping[str, Any], row))
        except AuditError:
            raise
        except Exception as exc:
            raise AuditStorageError(f"reading the audit log failed: {exc}") from exc
