"""Kill -9 of a real ``kvgate serve`` right after N acknowledged admin actions, or N capabilities
minted by 16 concurrent callers: every acknowledged action's or grant's event is in the log (the
admin actions in order), and the chain and the Merkle tree over it verify (a checkpoint of the
survivors, then an export checked against it). SQLite, and a Postgres cluster of this test's own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from audit import AuditSigningKey, AuditStore, create_audit_engine, export_to_files, verify_database, verify_export
from audit.checkpoint import CheckpointDirectory
from audit.checkpointer import Checkpointer
from tests.support.killed_server import ServeProcess, kill_after, kill_after_mints, logged, lost_and_order, minted
from tests.support.postgres import started

pytestmark = [pytest.mark.slow]
N = 30
MINTS = 40


@pytest.fixture(params=["sqlite", "postgres"])
def database(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'state' / 'kvgate.db'}"
        return
    with started() as pg:
        yield pg.url


async def _tree_and_chain(db_url: str, tmp_path: Path, rows: int) -> None:
    engine = create_audit_engine(db_url)
    try:
        report = await verify_database(engine)
        assert report.ok and report.rows == rows, report.problems
        key = AuditSigningKey.generate()
        key.write_public_key(tmp_path / "pub.pem")
        cp = await Checkpointer(AuditStore(engine), key, CheckpointDirectory(tmp_path / "cps")).checkpoint()
        assert cp.tree_size == rows
        cp_file = CheckpointDirectory(tmp_path / "cps").files()[0]
        await export_to_files(engine, key, tmp_path / "x.jsonl", tmp_path / "x.jsonl.manifest.json")
    finally:
        await engine.dispose()
    got = verify_export(tmp_path / "x.jsonl", tmp_path / "x.jsonl.manifest.json", tmp_path / "pub.pem", [cp_file])
    assert got.ok and got.tree_size == rows and got.root_hash == cp.root_hash, got.problems


def test_kill_9_right_after_admin_actions_loses_nothing(database: str, tmp_path: Path) -> None:
    server = ServeProcess(tmp_path / "state", None if database.startswith("sqlite") else database)
    server.start()
    try:
        acked = kill_after(server, N, 0.0, "crash")
    finally:
        server.stop()
    rows = asyncio.run(logged(database))
    lost, in_order = lost_and_order(acked, rows)
    print(f"\n[audit] kill -9 at once after {N} admin actions ({database.split(':')[0]}): {lost} events lost")
    assert lost == 0 and in_order
    asyncio.run(_tree_and_chain(database, tmp_path, len(rows)))


def test_kill_9_right_after_capability_mints_loses_no_grant(database: str, tmp_path: Path) -> None:
    """A capability is a grant: the server answers 201 only once its ``capability.mint`` event is
    durable, so SIGKILL right after the last answer leaves every acknowledged grant in the log."""
    server = ServeProcess(tmp_path / "state", None if database.startswith("sqlite") else database)
    server.start()
    try:
        acked = kill_after_mints(server, MINTS, 0.0, "grants", callers=16)
    finally:
        server.stop()
    assert len({m.cap_id for m in acked}) == MINTS  # every mint was answered 201, each a new grant
    kept = asyncio.run(minted(database))
    lost = [m.cap_id for m in acked if m.cap_id not in kept]
    print(f"\n[audit] kill -9 at once after {MINTS} concurrent mints ({database.split(':')[0]}): {len(lost)} lost")
    assert not lost and len(kept) == MINTS
    asyncio.run(_tree_and_chain(database, tmp_path, len(asyncio.run(logged(database)))))
