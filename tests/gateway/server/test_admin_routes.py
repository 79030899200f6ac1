"""Issue 5, admin API: every admin endpoint under a live server, on SQLite and Postgres -- success,
401, 403 (wrong role; the OTHER tenant's admin, for an existing tenant and for one that does not
exist, which must look the same), 409/422 where they apply; every error an RFC 9457 problem."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
import pytest

from tests.support import chunks, server_fixture
from tests.support.server_fixture import (
    LiveServer,
    assert_problem,
    fake_envelope,
    random_hash,
)

live_any = server_fixture.live_any  # a fixture, registered in this module

ABSENT = "no-such-tenant"


@dataclass
class Admins:
    live: LiveServer
    http: httpx.AsyncClient
    a: str
    b: str
    admin_a: str
    admin_b: str
    worker_a: str
    operator: str

    def h(self, token: str | None) -> dict[str, str]:
        return self.live.headers(token)


@pytest.fixture
async def admins(live_any: LiveServer):
    live = live_any
    async with live.client() as http:
        a, b = await live.create_tenant(http), await live.create_tenant(http)
        yield Admins(
            live, http, a, b, live.admin_token(a), live.admin_token(b), live.worker_token(a), live.operator_token()
        )


async def denied_alike(x: Admins, method: str, url_of, body_of=None, params_of=None) -> None:
    """401 without a token or with a bad one; 403 for a worker, and for B's admin on A and on a
    tenant that does not exist, with identical bodies (existence must not leak)."""
    def call(token, tenant):
        kw = {}
        if body_of is not None:
            kw["json"] = body_of(tenant)
        if params_of is not None:
            kw["params"] = params_of(tenant)
        return x.http.request(method, url_of(tenant), headers=x.h(token), **kw)

    assert_problem(await call(None, x.a), 401)
    assert_problem(await call("e30.e30.e30", x.a), 401)
    assert_problem(await call(x.worker_a, x.a), 403)
    other = assert_problem(await call(x.admin_b, x.a), 403)
    absent = assert_problem(await call(x.admin_b, ABSENT), 403)
    assert other == absent


async def test_clear(admins: Admins):
    x = admins
    cap = await x.live.capability(x.http, x.a)
    h = random_hash()
    r = await chunks.store(x.http, x.live.headers(x.worker_a, cap), [(h, fake_envelope())])
    assert r.status_code == 204
    await denied_alike(x, "POST", lambda t: "/v1/admin/clear", body_of=lambda t: {"scope": "tenant", "tenant": t})
    # a chunk-list clear needs the namespace
    assert_problem(await x.http.post("/v1/admin/clear", json={"scope": "chunks", "tenant": x.a, "hashes": [h]}, headers=x.h(x.admin_a)), 422)
    assert_problem(await x.http.post("/v1/admin/clear", json={"scope": "namespace", "tenant": x.a, "namespace": ""}, headers=x.h(x.admin_a)), 422)
    # the operator on an absent tenant: 403 as well
    assert_problem(await x.http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": ABSENT}, headers=x.h(x.operator)), 403)
    r = await x.http.post("/v1/admin/clear", json={"scope": "chunks", "tenant": x.a, "namespace": "default", "hashes": [h]}, headers=x.h(x.admin_a))
    assert r.status_code == 200 and r.json()["scope"] == "chunks" and r.json()["deleted_chunk_copies"] >= 1
    r = await x.http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": x.a}, headers=x.h(x.admin_a))
    assert r.status_code == 200
    body = r.json()
    assert body["tenant"] == x.a and body["scope"] == "tenant" and body["destroyed_key_versions"]
    # the tenant's capabilities are revoked by the clear
    assert_problem(await x.http.post("/v1/lookup", json={"hashes": [h]}, headers=x.live.headers(x.worker_a, cap)), 403)


async def test_move(admins: Admins):
    x = admins
    cap = await x.live.capability(x.http, x.a)
    h = random_hash()
    assert (await chunks.store(x.http, x.live.headers(x.worker_a, cap), [(h, fake_envelope())])).status_code == 204
    body = {"tenant": x.a, "namespace": "default", "hashes": [h], "from": "memory", "to": "disk"}
    await denied_alike(x, "POST", lambda t: "/v1/admin/move", body_of=lambda t: {**body, "tenant": t})
    r = await x.http.post("/v1/admin/move", json=body, headers=x.h(x.admin_a))
    assert r.status_code == 200 and r.json() == {"requested": 1, "moved": 1}
    assert await chunks.where(x.http, x.live.headers(x.worker_a, cap), h) == ["disk"]
    for bad in ({**body, "to": "tape"}, {**body, "hashes": []}, {**body, "hashes": ["nothex"]}, {"namespace": "default"}):
        assert_problem(await x.http.post("/v1/admin/move", json=bad, headers=x.h(x.admin_a)), 422)


async def test_tenants_create_and_disable(admins: Admins):
    x = admins
    await denied_alike(x, "POST", lambda t: "/v1/admin/tenants", body_of=lambda t: {"tenant": t})
    # an admin cannot create or disable even its own tenant (operators only)
    assert_problem(await x.http.post("/v1/admin/tenants", json={"tenant": x.a}, headers=x.h(x.admin_a)), 403)
    new = f"{x.a}-new"
    r = await x.http.post("/v1/admin/tenants", json={"tenant": new}, headers=x.h(x.operator))
    assert r.status_code == 201 and r.json()["tenant"] == new and r.json()["key_version"] >= 1
    assert_problem(await x.http.post("/v1/admin/tenants", json={"tenant": new}, headers=x.h(x.operator)), 409)
    for bad in ({"tenant": ""}, {"tenant": "x" * 129}, {}):
        assert_problem(await x.http.post("/v1/admin/tenants", json=bad, headers=x.h(x.operator)), 422)

    await denied_alike(x, "DELETE", lambda t: f"/v1/admin/tenants/{t}")
    assert_problem(await x.http.delete(f"/v1/admin/tenants/{x.a}", headers=x.h(x.admin_a)), 403)
    assert_problem(await x.http.delete(f"/v1/admin/tenants/{ABSENT}", headers=x.h(x.operator)), 403)
    worker = x.live.worker_token(new)
    cap = await x.live.capability(x.http, new, token=worker)
    r = await x.http.delete(f"/v1/admin/tenants/{new}", headers=x.h(x.operator))
    assert r.status_code == 200 and r.json()["status"] == "disabled"
    # a disabled tenant: no new capabilities, and the old one is revoked
    assert_problem(await x.http.post("/v1/capabilities", json={"namespace": "d", "ops": ["get"]}, headers=x.h(worker)), 403)
    assert_problem(
        await x.http.post("/v1/lookup", json={"hashes": [random_hash()]}, headers=x.live.headers(worker, cap)), 403
    )


async def test_rotate(admins: Admins):
    x = admins
    await denied_alike(x, "POST", lambda t: f"/v1/admin/tenants/{t}/keys/rotate")
    r1 = await x.http.post(f"/v1/admin/tenants/{x.a}/keys/rotate", headers=x.h(x.admin_a))
    r2 = await x.http.post(f"/v1/admin/tenants/{x.a}/keys/rotate", headers=x.h(x.operator))
    assert r1.status_code == r2.status_code == 200
    assert r2.json()["key_version"] == r1.json()["key_version"] + 1
    assert_problem(await x.http.post(f"/v1/admin/tenants/{ABSENT}/keys/rotate", headers=x.h(x.operator)), 403)
    assert_problem(await x.http.post(f"/v1/admin/tenants/{'x' * 129}/keys/rotate", headers=x.h(x.operator)), 422)


async def test_audit_export_manifest_and_key(admins: Admins):
    x = admins
    await x.http.post(f"/v1/admin/tenants/{x.a}/keys/rotate", headers=x.h(x.admin_a))
    await x.http.post(f"/v1/admin/tenants/{x.b}/keys/rotate", headers=x.h(x.admin_b))
    await x.live.call(x.live.runtime.audit.flush, 10)
    until = "2999-01-01T00:00:00+00:00"
    for path in ("/v1/admin/audit/export", "/v1/admin/audit/export/manifest"):
        await denied_alike(x, "GET", lambda t, p=path: p, params_of=lambda t: {"tenant": t})
        for bad in ({"format": "xml"}, {"since": "2024-01-01T00:00:00"}, {"since": "yesterday"}, {"tenant": ""}):
            assert_problem(await x.http.get(path, params=bad, headers=x.h(x.admin_a)), 422)
    r = await x.http.get("/v1/admin/audit/export", params={"until": until}, headers=x.h(x.admin_a))
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in r.text.splitlines() if line]
    assert rows and any(row.get("action") == "key.rotate" for row in rows)
    # only rows about A: done to A or by A's principals (B's denied attempts on A included)
    assert all(x.a in ((row.get("target") or {}).get("tenant"), (row.get("actor") or {}).get("tenant")) for row in rows)
    assert not any((row.get("target") or {}).get("tenant") == x.b for row in rows)
    csv = await x.http.get("/v1/admin/audit/export", params={"format": "csv", "until": until}, headers=x.h(x.admin_a))
    assert csv.status_code == 200 and csv.headers["content-type"].startswith("text/csv")
    m = await x.http.get("/v1/admin/audit/export/manifest", params={"until": until}, headers=x.h(x.admin_a))
    assert m.status_code == 200 and m.json()
    everything = await x.http.get("/v1/admin/audit/export", params={"until": until}, headers=x.h(x.operator))
    assert x.a in everything.text and x.b in everything.text

    assert_problem(await x.http.get("/v1/admin/audit/public-key"), 401)
    assert_problem(await x.http.get("/v1/admin/audit/public-key", headers=x.h("bad")), 401)
    assert_problem(await x.http.get("/v1/admin/audit/public-key", headers=x.h(x.worker_a)), 403)
    pem = await x.http.get("/v1/admin/audit/public-key", headers=x.h(x.admin_a))
    assert pem.status_code == 200 and b"PUBLIC KEY" in pem.content


async def test_metrics_needs_an_operator(admins: Admins):
    x = admins
    assert_problem(await x.http.get("/metrics"), 401)
    assert_problem(await x.http.get("/metrics", headers=x.h("bad")), 401)
    assert_problem(await x.http.get("/metrics", headers=x.h(x.admin_a)), 403)
    assert_problem(await x.http.get("/metrics", headers=x.h(x.worker_a)), 403)
    r = await x.http.get("/metrics", headers=x.h(x.operator))
    assert r.status_code == 200 and "kvgate_http_requests" in r.text


async def test_audit_checkpoints_and_consistency(admins: Admins, tmp_path):
    """Issue 16, REST: operators write a checkpoint; admins read the latest and consistency
    proofs; every export writes one first; all verify offline with the exported public key."""
    from audit.checkpoint import parse_checkpoint, verify_checkpoint_consistency
    from audit.signing import load_public_key_pem

    x = admins
    path = "/v1/admin/audit/checkpoints"
    assert_problem(await x.http.post(path), 401)
    assert_problem(await x.http.post(path, headers=x.h(x.admin_a)), 403)  # the whole log: operators only
    assert_problem(await x.http.post(path, headers=x.h(x.worker_a)), 403)
    r = await x.http.post(path, headers=x.h(x.operator))
    assert r.status_code == 201, r.text
    key = load_public_key_pem((await x.http.get("/v1/admin/audit/public-key", headers=x.h(x.admin_a))).content)
    first = parse_checkpoint(r.json(), key)
    assert first.tree_size > 0
    latest = await x.http.get(path + "/latest", headers=x.h(x.admin_a))
    assert latest.status_code == 200 and latest.json()["root_hash"] == first.root_hash
    assert_problem(await x.http.get(path + "/latest", headers=x.h(x.worker_a)), 403)
    await x.http.post(f"/v1/admin/tenants/{x.a}/keys/rotate", headers=x.h(x.admin_a))
    exported = await x.http.get("/v1/admin/audit/export", headers=x.h(x.admin_a))  # checkpoints first
    assert exported.status_code == 200
    second = parse_checkpoint((await x.http.get(path + "/latest", headers=x.h(x.admin_a))).json(), key)
    assert second.tree_size > first.tree_size
    proof = await x.http.get("/v1/admin/audit/consistency", headers=x.h(x.admin_a),
                             params={"first": first.tree_size, "second": second.tree_size})
    assert proof.status_code == 200, proof.text
    assert verify_checkpoint_consistency(first, second, proof.json()) is None
    for bad in ({"first": 0, "second": 1}, {"first": 5, "second": 2}, {"first": 1, "second": 10**9}):
        assert_problem(await x.http.get("/v1/admin/audit/consistency", params=bad, headers=x.h(x.admin_a)), 422)
