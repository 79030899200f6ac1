"""A database owner hides one of tenant acme's audit rows from acme's export: with the append-only
triggers off, raw SQL deletes the row, moves it to another tenant, replaces it by a forged,
self-consistent row, or swaps two of acme's rows (each re-hashed to fit its new place). The rows
are covered by a signed checkpoint, as the server writes every few minutes. The operator then
runs ``kvgate audit export --tenant acme`` and ``kvgate audit verify``: the export is refused
(exit 4, TAMPERED). Untouched, the same commands succeed (the control), and a copy of the
export file with a row removed, added or moved fails ``verify``. SQLite and Postgres.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import delete, insert, update

from audit import AuditWriter, create_audit_engine
from audit.models import audit_events
from audit.record import AuditRecord
from audit.types import Actor, AuditEvent, Target
from tests.support.paths import REPO

TAMPERING = ["delete", "retarget", "forge", "reorder"]
_T = audit_events.c


def kvgate(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False)


async def _write_log(db_url: str, env: dict[str, str]) -> list[AuditRecord]:
    """30 events, acme and globex interleaved, as the gateway writes them; a signed checkpoint
    after the first 20 (the server's periodic one); returns the rows."""
    engine = create_audit_engine(db_url)
    writer = AuditWriter(engine, spool_dir=Path(env["KVGATE_STATE_DIR"]) / "spool-test")
    await writer.start()
    try:
        for i in range(30):
            tenant = "acme" if i % 3 == 0 else "globex"
            writer.emit(AuditEvent("key.rotate", actor=Actor(subject=f"admin-{i}", tenant=tenant),
                                   target=Target(tenant=tenant), details={"i": i}))
            if i == 19:
                await writer.flush(30)
                done = kvgate(env, "audit", "checkpoint")
                assert done.returncode == 0, done.stdout + done.stderr
        await writer.flush(30)
        return [r async for r in writer.store.iter_records()]
    finally:
        await writer.aclose()
        await engine.dispose()


async def _as_owner(db_url: str, rows: list[AuditRecord], how: str) -> None:
    """The database owner's raw SQL, with the append-only triggers disabled."""
    acme = [r for r in rows if r.event.target.tenant == "acme" and r.seq < 20]
    victim, other = acme[3], acme[4]  # seq 10 and 13, both covered by the checkpoint
    if how == "delete":
        stmts = [delete(audit_events).where(_T.seq == victim.seq)]
    elif how == "retarget":
        stmts = [update(audit_events).where(_T.seq == victim.seq).values(target_tenant="globex", actor_tenant="globex")]
    elif how == "forge":
        forged = dataclasses.replace(victim.event, details='{"i":"forged"}')
        rec = AuditRecord.chain(forged, seq=victim.seq, recorded_at=victim.recorded_at, prev_hash=victim.prev_hash)
        stmts = [delete(audit_events).where(_T.seq == victim.seq), insert(audit_events).values(rec.to_row())]
    else:  # reorder: each row put in the other's place, re-hashed to link to its new predecessor
        a = AuditRecord.chain(other.event, seq=victim.seq, recorded_at=victim.recorded_at, prev_hash=victim.prev_hash)
        b = AuditRecord.chain(victim.event, seq=other.seq, recorded_at=other.recorded_at, prev_hash=other.prev_hash)
        stmts = [delete(audit_events).where(_T.seq.in_([victim.seq, other.seq])),
                 insert(audit_events).values([a.to_row(), b.to_row()])]
    engine = create_audit_engine(db_url)
    try:
        async with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                await conn.exec_driver_sql("ALTER TABLE kv_audit_events DISABLE TRIGGER USER")
            else:
                await conn.exec_driver_sql("DROP TRIGGER IF EXISTS kv_audit_events_no_update")
                await conn.exec_driver_sql("DROP TRIGGER IF EXISTS kv_audit_events_no_delete")
            for stmt in stmts:
                await conn.execute(stmt)
    finally:
        await engine.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def operator_env(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, str]:
    db_url = (f"sqlite+aiosqlite:///{tmp_path / 'kvgate.db'}" if request.param == "sqlite"
              else request.getfixturevalue("fresh_pg_url"))
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_STATE_DIR": str(state), "KVGATE_DATABASE_URL": db_url}
    done = kvgate(env, "migrate")
    assert done.returncode == 0, done.stdout + done.stderr
    return env


def _export_and_verify(env: dict[str, str], out: Path) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str] | None]:
    pub = out.with_suffix(".pem")
    exported = kvgate(env, "audit", "export", "--tenant", "acme", "-o", str(out), "--public-key", str(pub))
    if exported.returncode != 0:
        return exported, None
    return exported, kvgate(env, "audit", "verify", str(out), "--public-key", str(pub))


@pytest.mark.slow
@pytest.mark.parametrize("how", TAMPERING)
async def test_a_row_hidden_from_a_tenant_export_fails_the_export(operator_env: dict[str, str], tmp_path: Path, how: str) -> None:
    db_url = operator_env["KVGATE_DATABASE_URL"]
    rows = await _write_log(db_url, operator_env)
    exported, verified = _export_and_verify(operator_env, tmp_path / "before.jsonl")  # the control
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert verified is not None and verified.returncode == 0 and "OK" in verified.stdout, verified.stdout

    await _as_owner(db_url, rows, how)

    exported, verified = _export_and_verify(operator_env, tmp_path / "after.jsonl")
    assert verified is None, f"{how}: the export was written and verify said: {verified.stdout}"
    assert exported.returncode == 4 and "TAMPERED" in exported.stdout, exported.stdout + exported.stderr


@pytest.mark.slow
async def test_a_tenant_export_file_with_a_row_removed_added_or_moved_fails_verify(
    operator_env: dict[str, str], tmp_path: Path
) -> None:
    await _write_log(operator_env["KVGATE_DATABASE_URL"], operator_env)
    out = tmp_path / "acme.jsonl"
    exported, verified = _export_and_verify(operator_env, out)
    assert exported.returncode == 0 and verified is not None and verified.returncode == 0, exported.stdout
    lines = out.read_bytes().splitlines(keepends=True)
    pub = out.with_suffix(".pem")
    for name, edited in (("removed", lines[:3] + lines[4:]), ("added", lines[:3] + [lines[3]] + lines[3:]),
                         ("moved", lines[:2] + [lines[3], lines[2]] + lines[4:])):
        copy = tmp_path / f"{name}.jsonl"
        copy.write_bytes(b"".join(edited))
        (tmp_path / f"{name}.jsonl.manifest.json").write_bytes((tmp_path / "acme.jsonl.manifest.json").read_bytes())
        done = kvgate(operator_env, "audit", "verify", str(copy), "--public-key", str(pub))
        assert done.returncode == 1 and "FAILED" in done.stdout, (name, done.stdout)


@pytest.mark.slow
async def test_a_tenant_admins_export_over_http_is_refused_after_a_row_is_deleted(tmp_path: Path) -> None:
    from sqlalchemy import text

    from audit.verify import verify_export
    from tests.support.server_fixture import running_server

    with running_server(tmp_path / "state") as live:
        async with live.client() as http:
            a = await live.create_tenant(http)
            admin = live.headers(live.admin_token(a))
            for _ in range(3):
                assert (await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=admin)).status_code == 200
            r = await http.post("/v1/admin/audit/checkpoints", headers=live.headers(live.operator_token()))
            assert r.status_code == 201, r.text
            until = {"until": "2999-01-01T00:00:00+00:00"}
            r = await http.get("/v1/admin/audit/export", params=until, headers=admin)  # the control
            m = await http.get("/v1/admin/audit/export/manifest", params=until, headers=admin)
            assert r.status_code == 200 and m.status_code == 200, r.text
            pub = await http.get("/v1/admin/audit/public-key", headers=admin)
            for name, data in (("a.jsonl", r.content), ("a.jsonl.manifest.json", m.content), ("k.pem", pub.content)):
                (tmp_path / name).write_bytes(data)
            report = verify_export(tmp_path / "a.jsonl", tmp_path / "a.jsonl.manifest.json", tmp_path / "k.pem")
            assert report.ok and report.rows >= 4, report.problems

            engine = create_audit_engine(live.settings.db_url)  # the database owner, on the server's file
            try:
                async with engine.begin() as conn:
                    await conn.exec_driver_sql("DROP TRIGGER IF EXISTS kv_audit_events_no_delete")
                    seq = (await conn.execute(text(
                        "SELECT min(seq) FROM kv_audit_events WHERE action = 'key.rotate' AND target_tenant = :t"
                    ), {"t": a})).scalar_one()
                    await conn.execute(text("DELETE FROM kv_audit_events WHERE seq = :s"), {"s": seq})
            finally:
                await engine.dispose()

            r = await http.get("/v1/admin/audit/export", params=until, headers=admin)
            assert r.status_code == 409 and "checkpoint" in r.json()["detail"], r.text
            r = await http.get("/v1/admin/audit/export/manifest", params=until, headers=admin)
            assert r.status_code == 409, r.text
