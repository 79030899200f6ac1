"""The chain in a real database (SQLite and Postgres): append, idempotence, append-only guard,
filters, the stored-chain check and the Alembic revision."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from audit.db import create_audit_engine, create_audit_schema
from audit.errors import AuditStorageError
from audit.models import APPEND_ONLY_DDL, audit_metadata
from audit.record import GENESIS_HASH, PendingEvent
from audit.store import AuditStore
from audit.types import Actor, AuditEvent, Target
from audit.verify import verify_database
from tests.support.paths import REPO

T0 = datetime(2025, 3, 1, tzinfo=UTC)


def ev(i: int, tenant: str = "t1", now: datetime | None = None) -> PendingEvent:
    event = AuditEvent(
        "pin",
        actor=Actor(subject=f"u{i}", tenant=tenant),
        target=Target(tenant=tenant, chunk_count=i),
        details={"i": i},
    )
    return PendingEvent.from_event(event, now or datetime.now(UTC))


@pytest.fixture
async def store(db_url: str):
    engine = create_audit_engine(db_url)
    await create_audit_schema(engine)
    yield AuditStore(engine)
    await engine.dispose()


async def test_append_builds_one_chain_and_is_idempotent(store: AuditStore) -> None:
    batch = [ev(i) for i in range(10)]
    r1 = await store.append(batch[:6])
    assert (r1.written, r1.duplicates, r1.head.seq) == (6, 0, 6)
    # a replay of an ambiguously committed batch, overlapping a new one, and a repeat inside a batch
    r2 = await store.append(batch[3:] + [batch[9]])
    assert (r2.written, r2.duplicates, r2.head.seq) == (4, 4, 10)
    records = [r async for r in store.iter_records()]
    assert [r.seq for r in records] == list(range(1, 11))
    assert [r.event.event_id for r in records] == [e.event_id for e in batch]
    assert records[0].prev_hash == GENESIS_HASH
    assert all(b.prev_hash == a.hash for a, b in itertools.pairwise(records))
    assert records[4].event == batch[4]  # what was emitted is what is stored, exactly
    report = await verify_database(store)
    assert report.ok and report.rows == 10, report.problems


async def test_concurrent_appends_in_one_process_stay_linear(store: AuditStore) -> None:
    await asyncio.gather(*(store.append([ev(i * 100 + j) for j in range(20)]) for i in range(8)))
    report = await verify_database(store)
    assert report.ok and report.rows == 160, report.problems


async def test_recorded_at_never_goes_back(db_url: str) -> None:
    engine = create_audit_engine(db_url)
    await create_audit_schema(engine)
    times = iter([T0 + timedelta(hours=1), T0])  # the second writer's clock is an hour behind
    store = AuditStore(engine, clock=lambda: next(times))
    try:
        await store.append([ev(1)])
        await store.append([ev(2)])
        a, b = [r async for r in store.iter_records()]
        assert b.recorded_at == a.recorded_at == T0 + timedelta(hours=1)
    finally:
        await engine.dispose()


async def test_filters_by_tenant_and_recorded_window(db_url: str) -> None:
    engine = create_audit_engine(db_url)
    await create_audit_schema(engine)
    times = iter(T0 + timedelta(minutes=m) for m in range(10))
    store = AuditStore(engine, clock=lambda: next(times))
    try:
        for i in range(6):
            await store.append([ev(i, tenant="a" if i % 2 else "b")])
        other = PendingEvent.from_event(
            AuditEvent("authz.denied", "denied", actor=Actor(tenant="a"), target=Target(tenant="c")), T0
        )
        await store.append([other])
        seqs = [r.seq async for r in store.iter_records(tenant="a")]
        assert seqs == [2, 4, 6, 7]  # target tenant a, and what a's principal tried on c
        window = [
            r.seq async for r in store.iter_records(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=4))
        ]
        assert window == [2, 3, 4]
    finally:
        await engine.dispose()


async def test_rows_cannot_be_updated_or_deleted(store: AuditStore) -> None:
    await store.append([ev(1), ev(2)])
    statements = ["UPDATE kv_audit_events SET action = 'x'", "DELETE FROM kv_audit_events WHERE seq = 2"]
    if store.engine.dialect.name == "postgresql":
        statements.append("TRUNCATE kv_audit_events")
    for sql in statements:
        with pytest.raises(Exception, match="append-only"):
            async with store.engine.begin() as conn:
                await conn.execute(text(sql))
    assert (await verify_database(store)).rows == 2


async def test_verify_database_names_a_tampered_row(store: AuditStore) -> None:
    await store.append([ev(i) for i in range(5)])
    # an attacker with DDL rights drops the guard and edits a row
    async with store.engine.begin() as conn:
        if store.engine.dialect.name == "postgresql":
            await conn.execute(text("ALTER TABLE kv_audit_events DISABLE TRIGGER USER"))
        else:
            await conn.execute(text("DROP TRIGGER kv_audit_events_no_update"))
            await conn.execute(text("DROP TRIGGER kv_audit_events_no_delete"))
        await conn.execute(text("UPDATE kv_audit_events SET actor_subject = 'mallory' WHERE seq = 3"))
        await conn.execute(text("DELETE FROM kv_audit_events WHERE seq = 5"))
    report = await verify_database(store)
    assert not report.ok and report.first_bad_seq == 3
    async with store.engine.begin() as conn:
        await conn.execute(text("DELETE FROM kv_audit_events WHERE seq = 1"))
    report = await verify_database(store)
    assert not report.ok and any("seq 2, not 1" in p for p in report.problems)


async def test_unreachable_database_is_a_typed_error(tmp_path: Path) -> None:
    from tests.support.services import free_port

    engine = create_audit_engine(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/x", connect_timeout=2)
    try:
        with pytest.raises(AuditStorageError):
            await AuditStore(engine).append([ev(1)])
    finally:
        await engine.dispose()
    for bad in ("mysql+aiomysql://x/y", "postgresql://x/y", "sqlite:///x.db", "not a url"):
        with pytest.raises(AuditStorageError):
            create_audit_engine(bad)


def _load_revision():
    path = REPO / "migrations" / "versions" / "0002_audit.py"
    spec = importlib.util.spec_from_file_location("kvgate_rev_0002_audit", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_migration_matches_the_models_and_guards_the_table(db_url: str) -> None:
    rev = _load_revision()
    assert (rev.revision, rev.down_revision) == ("0002_audit", "0001_registry")
    assert (rev.PG_UP, rev.SQLITE_UP) == (APPEND_ONLY_DDL["postgresql"], APPEND_ONLY_DDL["sqlite"])
    engine = create_audit_engine(db_url)

    def upgrade(conn) -> list:
        with Operations.context(MigrationContext.configure(conn)):
            rev.upgrade()
        return compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), audit_metadata)

    def downgrade(conn) -> list[str]:
        with Operations.context(MigrationContext.configure(conn)):
            rev.downgrade()
        return inspect(conn).get_table_names()

    try:
        async with engine.begin() as conn:
            assert await conn.run_sync(upgrade) == []
        store = AuditStore(engine)
        await store.append([ev(1)])
        with pytest.raises(Exception, match="append-only"):
            async with engine.begin() as conn:
                await conn.execute(text("DELETE FROM kv_audit_events"))
        assert (await verify_database(store)).ok
        async with engine.begin() as conn:
            assert "kv_audit_events" not in await conn.run_sync(downgrade)
    finally:
        await engine.dispose()
