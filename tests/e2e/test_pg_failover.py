"""Postgres failover under a live server, as an operator runs it.

A primary with a synchronous streaming replica (two throwaway clusters on free ports), a
``kvgate serve`` whose database URL names both hosts with ``target_session_attrs=read-write``,
admin actions acknowledged before and after the primary is killed (SIGKILL of its postmaster)
and the replica promoted. Checked: the server reaches the new primary by itself, every admin
action acknowledged to a caller has its audit event there, and the exported log verifies offline
against a checkpoint signed before the failover (the chain continues on the new primary).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.postgres import PG_BIN, ThrowawayPostgres
from tests.support.server_fixture import running_server

pytestmark = [pytest.mark.slow]

KVGATE = [sys.executable, "-m", "gateway"]


def _psql(pg: ThrowawayPostgres, sql: str) -> str:
    done = subprocess.run(
        [*pg.prefix, str(PG_BIN / "psql"), "-h", "127.0.0.1", "-p", str(pg.port), "-U", "postgres", "-d", "postgres",
         "-At", "-c", sql],
        capture_output=True, text=True, timeout=60, check=True,
    )
    return done.stdout.strip()


def _replica_of(primary: ThrowawayPostgres) -> ThrowawayPostgres:
    """A hot standby of ``primary`` (pg_basebackup -R), started, streaming."""
    replica = ThrowawayPostgres()
    replica._run(
        str(PG_BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
        "-D", str(replica.data), "-R", "-X", "stream", "--no-sync",
    )
    replica.start()
    return replica


def _wait(what: str, check, timeout_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.2)


def _postmaster_pid(pg: ThrowawayPostgres) -> int:
    return int((pg.data / "postmaster.pid").read_text().splitlines()[0])


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVGATE, *args], env=env, capture_output=True, text=True, timeout=300, check=False)


def test_failover_to_a_promoted_sync_replica_loses_no_acknowledged_audit_event(tmp_path: Path):
    primary = ThrowawayPostgres()
    replica: ThrowawayPostgres | None = None
    try:
        primary.init()
        primary.start()
        replica = _replica_of(primary)
        _wait("the replica streaming", lambda: _psql(primary, "select count(*) from pg_stat_replication") == "1")
        # synchronous replication: a commit returns once the standby has it
        _psql(primary, "alter system set synchronous_standby_names = '*'")
        _psql(primary, "select pg_reload_conf()")
        _wait("the standby synchronous",
              lambda: _psql(primary, "select sync_state from pg_stat_replication") == "sync")
        url = (f"postgresql+asyncpg://postgres@/postgres?host=127.0.0.1:{primary.port}"
               f"&host=127.0.0.1:{replica.port}&target_session_attrs=read-write")
        state = tmp_path / "state"
        acked: list[str] = []  # tenants whose creation was acknowledged
        refused = 0
        with running_server(state, db_url=url, tiers=["memory"]) as live:
            op = live.operator_token()

            def create(name: str) -> int:
                r = httpx.post(live.base_url + "/v1/admin/tenants", json={"tenant": name},
                               headers=live.headers(op), timeout=30)
                if r.status_code in (200, 201):
                    acked.append(name)
                return r.status_code

            for i in range(5):  # positive control: the multi-host URL serves before any failure
                assert create(f"before-{i}") in (200, 201)
            cp = httpx.post(live.base_url + "/v1/admin/audit/checkpoints", headers=live.headers(op), timeout=60)
            assert cp.status_code == 201, cp.text
            (tmp_path / "before.json").write_text(json.dumps(cp.json()))
            assert _psql(replica, "select count(*) from kv_audit_events") == _psql(primary, "select count(*) from kv_audit_events")

            os.kill(_postmaster_pid(primary), signal.SIGKILL)
            killed_at = time.monotonic()
            status = create("during-0")  # the primary is gone, nothing promoted yet: refused, never lost
            assert status == 503 or status in (200, 201), status
            refused += status == 503
            replica._run(str(PG_BIN / "pg_ctl"), "-D", str(replica.data), "promote", "-w", "-t", "60")

            def recovered() -> bool:
                nonlocal refused
                status = create(f"after-{len(acked)}")
                refused += status == 503
                return status in (200, 201)

            _wait("a tenant created on the promoted replica", recovered, timeout_s=90)
            recovery_s = time.monotonic() - killed_at
            for i in range(5):
                assert create(f"later-{i}") in (200, 201)  # the requests after the recovery too
            asyncio.run(live.call(live.runtime.audit.flush, 10))
        print(f"\nfailover: recovered {recovery_s:.1f} s after the kill, {refused} requests refused (503) meanwhile")

        rows = _psql(replica, "select target_tenant from kv_audit_events where action = 'tenant.create'")
        for name in acked:
            assert name in rows.split(), f"the acknowledged creation of {name} has no audit event on the new primary"
        assert _psql(replica, "select pg_is_in_recovery()") == "f"

        env = {**os.environ, "KVGATE_STATE_DIR": str(state), "KVGATE_DATABASE_URL": url}
        export = tmp_path / "audit.jsonl"
        done = _cli(env, "audit", "export", "--output", str(export), "--public-key", str(tmp_path / "pub.pem"))
        assert done.returncode == 0, done.stderr
        ok = _cli(env, "audit", "verify", str(export), "--public-key", str(tmp_path / "pub.pem"),
                  "--checkpoint", str(tmp_path / "before.json"))
        assert ok.returncode == 0, ok.stdout + ok.stderr  # the chain continues past the failover
        exported = export.read_text()
        assert all(f'"{name}"' in exported for name in acked)
    finally:
        for pg in (replica, primary):
            if pg is None:
                continue
            try:
                pg.cleanup()
            except RuntimeError:  # the killed primary's stale pid file
                shutil.rmtree(pg.root, ignore_errors=True)

