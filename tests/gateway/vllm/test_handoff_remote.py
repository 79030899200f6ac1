"""A P/D receipt refused in remote mode, against a live ``kvgate serve`` on Postgres: the
connector's report (``audit_refused_receipt`` through a ``RemoteBackend``) lands in the server's
audit log as ``authz.denied`` (op ``handoff``) in the request's tenant and namespace, with the
worker as actor; ``POST /v1/handoff/refusals`` with a forged, other-tenant or narrowed capability,
run as an attacker would, is refused and records nothing of the kind."""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from gateway.vllm import backend as backends
from gateway.vllm.backend import RemoteBackend
from gateway.vllm.handoff import OTHER_OWNER, audit_refused_receipt
from tenancy.capabilities import attenuate
from tests.support import server_fixture
from tests.support.server_fixture import LiveServer

live_server_pg = server_fixture.live_server_pg  # a fixture, registered in this module

ROUTE = "/v1/handoff/refusals"


async def _handoff_rows(live: LiveServer, *, flush: bool = True) -> list[dict]:
    """The ``authz.denied`` events of op ``handoff`` in the server's Postgres audit table
    (``flush``: after the server's audit queue is written)."""
    if flush:
        await live.call(live.runtime.audit.flush, 10)
    engine = create_async_engine(live.settings.db_url)
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text(
                "SELECT outcome, target_tenant, target_namespace, actor_subject, actor_tenant, details "
                "FROM kv_audit_events WHERE action = 'authz.denied' ORDER BY seq"
            ))).mappings().all()
    finally:
        await engine.dispose()
    out = [{**row, "details": json.loads(row["details"])} for row in rows]
    return [row for row in out if row["details"].get("op") == "handoff"]


async def _wait_rows(live: LiveServer, n: int, timeout_s: float = 15.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = await _handoff_rows(live)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


async def _drained() -> None:
    """Every other task of the running loop (the backend's) ended."""
    await asyncio.gather(*(t for t in asyncio.all_tasks() if t is not asyncio.current_task()))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _renamed(cap: str, **root: str) -> str:
    """``cap`` with fields of its root block rewritten (canonical JSON) and its tag kept."""
    parts = cap.split(".")
    block = json.loads(base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4)))
    block.update(root)
    parts[2] = _b64(json.dumps(block, sort_keys=True, separators=(",", ":")).encode())
    return ".".join(parts)


async def test_a_refused_receipt_in_remote_mode_lands_in_the_servers_audit_log(live_server_pg: LiveServer):
    live = live_server_pg
    async with live.client() as http:
        await live.create_tenant(http, "acme")
        await live.create_tenant(http, "globex")
        cap_b = await live.capability(http, "globex", namespace="decode-ns")
    worker = live.token("globex", server_fixture.WORKER, subject="svc-decode-worker")
    backend = RemoteBackend(live.base_url, worker, live.settings.chunk_tokens, timeout_s=10.0)
    await asyncio.to_thread(backends.start, backend)
    try:
        # what the scheduler calls for a receipt of another owner: returns at once
        t0 = time.monotonic()
        audit_refused_receipt(backend, cap_b, "req-" + "x" * 200, OTHER_OWNER)
        assert time.monotonic() - t0 < 0.5
        rows = await _wait_rows(live, 1)
        await asyncio.to_thread(backend.loop.call, _drained())  # the report's call has ended
    finally:
        await asyncio.to_thread(backends.close, backend)
    (row,) = rows
    assert (row["outcome"], row["target_tenant"], row["target_namespace"]) == ("denied", "globex", "decode-ns")
    assert (row["actor_subject"], row["actor_tenant"]) == ("svc-decode-worker", "globex")
    assert row["details"] == {"op": "handoff", "reason": OTHER_OWNER, "request": ("req-" + "x" * 200)[:128]}


async def test_the_refusal_route_verifies_the_capability(live_server_pg: LiveServer):
    live = live_server_pg
    async with live.client() as http:
        await live.create_tenant(http, "acme")
        await live.create_tenant(http, "globex")
        cap_a = await live.capability(http, "acme")
        cap_b = await live.capability(http, "globex")
        worker_b = live.worker_token("globex")
        body = {"request": "req-1", "reason": OTHER_OWNER}
        parts = cap_b.split(".")
        attacks = {
            "no capability": live.headers(worker_b),
            "another tenant's genuine capability": live.headers(worker_b, cap_a),
            "own capability renamed to another tenant": live.headers(worker_b, _renamed(cap_b, t="acme")),
            "own capability in another namespace": live.headers(worker_b, _renamed(cap_b, ns="secret")),
            "a tag of the attacker's": live.headers(worker_b, ".".join([*parts[:-1], _b64(secrets.token_bytes(32))])),
            "own capability narrowed to put": live.headers(worker_b, attenuate(cap_b, ops=["put"])),
        }
        for name, headers in attacks.items():
            r = await http.post(ROUTE, json=body, headers=headers)
            assert r.status_code == 403, (name, r.status_code, r.text)
        assert await _handoff_rows(live) == []
        # out of bounds: a request id past 128 characters, a reason that is not a refusal
        for bad in ({"request": "r" * 129, "reason": OTHER_OWNER}, {"request": "r", "reason": "receipt_late"}):
            assert (await http.post(ROUTE, json=bad, headers=live.headers(worker_b, cap_b))).status_code == 422
        assert await _handoff_rows(live) == []
        # the positive control: the same request with the genuine capability, in the table once answered
        r = await http.post(ROUTE, json=body, headers=live.headers(worker_b, cap_b))
        assert r.status_code == 204, r.text
    rows = await _handoff_rows(live, flush=False)
    assert [(row["target_tenant"], row["target_namespace"], row["details"]) for row in rows] == [
        ("globex", "default", {"op": "handoff", "reason": OTHER_OWNER, "request": "req-1"}),
    ]


def test_the_route_takes_every_reason_a_consumer_refuses_for():
    from typing import get_args

    from gateway.server.data import RefusalReason
    from gateway.vllm.handoff import FALLBACK_REASONS, LATE

    assert set(get_args(RefusalReason)) == set(FALLBACK_REASONS) - {LATE}
