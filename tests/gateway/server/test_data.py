"""Issue 5, data plane: every endpoint under a live server, on SQLite and Postgres -- success,
401 (no token, invalid token), 403 (wrong role, other tenant's capability) and 404/413/422 where
they apply, every error an RFC 9457 problem."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass

import httpx
import pytest

from tenancy.capabilities import attenuate, read_unverified
from tenancy.devissuer import DevIssuer
from tests.support import server_fixture
from tests.support.server_fixture import (
    LiveServer,
    assert_problem,
    fake_envelope,
    random_hash,
)

live_any = server_fixture.live_any  # a fixture, registered in this module


@dataclass
class World:
    live: LiveServer
    http: httpx.AsyncClient
    a: str
    b: str
    worker_a: str
    worker_b: str
    admin_a: str
    cap_a: str  # lookup, get, put
    cap_b: str
    pin_a: str  # pin (minted by the admin)

    def h(self, token: str | None, cap: str | None = None) -> dict[str, str]:
        return self.live.headers(token, cap)


@pytest.fixture
async def world(live_any: LiveServer):
    live = live_any
    async with live.client() as http:
        a, b = await live.create_tenant(http), await live.create_tenant(http)
        w = World(
            live, http, a, b, live.worker_token(a), live.worker_token(b), live.admin_token(a),
            await live.capability(http, a), await live.capability(http, b),
            await live.capability(http, a, ops=["pin"], token=live.admin_token(a)),
        )
        yield w


def foreign_token(tmp_path, live: LiveServer, tenant: str) -> str:
    """Right issuer URL and claims, wrong signing key."""
    return DevIssuer(tmp_path / "other", issuer_url=live.issuer.issuer_url).mint(tenant, ["kv.worker"])


async def put(w: World, h: str, cap: str | None = None, token: str | None = None, body: bytes | None = None):
    return await w.http.put(
        f"/v1/chunks/{h}", content=body if body is not None else fake_envelope(),
        headers=w.h(token or w.worker_a, cap or w.cap_a),
    )


# -- capabilities ---------------------------------------------------------------------------------
async def test_capabilities(world: World, tmp_path):
    w = world
    ok = await w.http.post("/v1/capabilities", json={"namespace": "ns", "ops": ["get"], "ttl": 60}, headers=w.h(w.worker_a))
    assert ok.status_code == 201
    body = ok.json()
    assert (body["tenant"], body["namespace"], body["ops"]) == (w.a, "ns", ["get"])
    req = {"namespace": "ns", "ops": ["get"]}
    assert_problem(await w.http.post("/v1/capabilities", json=req), 401)
    assert_problem(await w.http.post("/v1/capabilities", json=req, headers=w.h("not-a-jwt")), 401)
    assert_problem(await w.http.post("/v1/capabilities", json=req, headers=w.h(foreign_token(tmp_path, w.live, w.a))), 401)
    # wrong tenant, for an existing and for an absent one; wrong role (pin needs kv.admin)
    for tenant in (w.b, "no-such-tenant"):
        assert_problem(await w.http.post("/v1/capabilities", json={**req, "tenant": tenant}, headers=w.h(w.worker_a)), 403)
    assert_problem(await w.http.post("/v1/capabilities", json={"namespace": "ns", "ops": ["pin"]}, headers=w.h(w.worker_a)), 403)
    # an operator on an absent tenant: 403 as well
    op = w.live.operator_token()
    assert_problem(await w.http.post("/v1/capabilities", json={**req, "tenant": "no-such-tenant"}, headers=w.h(op)), 403)
    for bad in ({"namespace": "", "ops": ["get"]}, {"namespace": "ns", "ops": []}, {"namespace": "ns", "ops": ["fly"]},
                {"namespace": "ns", "ops": ["get"], "ttl": 0}):
        body = assert_problem(await w.http.post("/v1/capabilities", json=bad, headers=w.h(w.worker_a)), 422)
        assert body["errors"]


# -- lookup ---------------------------------------------------------------------------------------
async def test_lookup(world: World, tmp_path):
    w = world
    h1, h2 = random_hash(), random_hash()
    assert (await put(w, h1)).status_code == 204
    r = await w.http.post("/v1/lookup", json={"hashes": [h1, h2], "chunk_tokens": 16}, headers=w.h(w.worker_a, w.cap_a))
    assert r.status_code == 200 and r.json()["hit_chunks"] == 1 and r.json()["hit_tokens"] == 16
    assert r.json()["locations"] and r.json()["locations"][0]
    # tenant B, same hash: a miss (its storage key is unrelated)
    r = await w.http.post("/v1/lookup", json={"hashes": [h1]}, headers=w.h(w.worker_b, w.cap_b))
    assert r.status_code == 200 and r.json()["hit_chunks"] == 0
    body = {"hashes": [h1]}
    assert_problem(await w.http.post("/v1/lookup", json=body, headers={"X-KV-Capability": w.cap_a}), 401)
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(foreign_token(tmp_path, w.live, w.a), w.cap_a)), 401)
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(w.worker_a, w.cap_b)), 403)  # B's capability
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(w.worker_b, w.cap_a)), 403)
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(w.admin_a, w.cap_a)), 403)  # role
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(w.worker_a)), 403)  # no capability
    assert_problem(await w.http.post("/v1/lookup", json=body, headers=w.h(w.worker_a, "garbage")), 403)
    for bad in ({"hashes": []}, {"hashes": ["xyz"]}, {"hashes": [h1.upper()]}, {}):
        assert_problem(await w.http.post("/v1/lookup", json=bad, headers=w.h(w.worker_a, w.cap_a)), 422)


async def test_the_raw_lookup_answers_as_the_fastapi_route_does(world: World, monkeypatch: pytest.MonkeyPatch):
    """``POST /v1/lookup`` is answered by a raw ASGI endpoint the router finds ahead of the FastAPI
    route (``gateway.server.rawlookup``). Every request below, good and bad, gets the same status,
    content type and body from it as from the FastAPI route (reached by taking the raw route out
    of the app's routes, as ``KVGATE_RAW_PATHS=false`` leaves them), and the raw endpoint really
    answered the first pass (a spy counts it) and not the second."""
    from starlette.routing import Route

    from gateway.server import rawlookup

    w = world
    h1, h2 = random_hash(), random_hash()
    assert (await put(w, h1)).status_code == 204
    own, json_ct = w.h(w.worker_a, w.cap_a), {"Content-Type": "application/json"}
    for _ in range(200):  # until the slower tiers' copies are written behind: the answers stay put
        r = await w.http.post("/v1/lookup", json={"hashes": [h1]}, headers=own)
        if r.json()["locations"] == [list(w.live.settings.tiers)]:
            break
        await asyncio.sleep(0.05)
    assert r.json()["locations"] == [list(w.live.settings.tiers)]
    cases: list[tuple[str, dict[str, str], bytes]] = [
        ("hit, tokens", own, json.dumps({"hashes": [h1, h2], "chunk_tokens": 16}).encode()),
        ("whole prefix, last chunk", own, json.dumps({"hashes": [h1], "chunk_tokens": 16, "last_chunk_tokens": 5}).encode()),
        ("miss", own, json.dumps({"hashes": [h2, h1]}).encode()),
        ("B's capability", w.h(w.worker_a, w.cap_b), json.dumps({"hashes": [h1]}).encode()),
        ("role", w.h(w.admin_a, w.cap_a), json.dumps({"hashes": [h1]}).encode()),
        ("no capability", w.h(w.worker_a), json.dumps({"hashes": [h1]}).encode()),
        ("garbage capability", w.h(w.worker_a, "garbage"), json.dumps({"hashes": [h1]}).encode()),
        ("no token", {"X-KV-Capability": w.cap_a}, json.dumps({"hashes": [h1]}).encode()),
        ("empty list", own, b'{"hashes": []}'),
        ("bad hash", own, b'{"hashes": ["xyz"]}'),
        ("no hashes", own, b"{}"),
        ("unknown field", own, json.dumps({"hashes": [h1], "chunk_token": 16}).encode()),
        ("not JSON", own, b'{"hashes": ['),
        ("a list", own, b"[1, 2]"),
        ("too many", own, json.dumps({"hashes": [h1] * 4097}).encode()),
        ("zero tokens", own, json.dumps({"hashes": [h1], "chunk_tokens": 0}).encode()),
        ("no body", own, b""),
        ("not UTF-8", own, b'{"hashes": ["\xeb"]}'),
    ]
    calls: list[str] = []
    serve = rawlookup._serve

    async def spy(*args, **kw):
        calls.append("raw")
        await serve(*args, **kw)

    monkeypatch.setattr(rawlookup, "_serve", spy)

    async def answers(content_type: dict[str, str]) -> list[tuple[int, str, object, str]]:
        out = []
        for _name, headers, body in cases:
            r = await w.http.post("/v1/lookup", content=body, headers={**headers, **content_type})
            ct = r.headers.get("content-type", "")
            out.append((r.status_code, ct, r.json() if "json" in ct else r.text, r.headers.get("www-authenticate", "")))
        return out

    raw = await answers(json_ct)
    raw_text = await answers({"Content-Type": "text/plain"})
    assert len(calls) == 2 * len(cases) - 2  # every request the gatekeeper let through (not the 401s)
    router = w.live._server.config.app.router  # the app the live server runs
    raw_routes = [r for r in router.routes if isinstance(r, Route) and isinstance(r.app, rawlookup.RawLookup)]
    assert len(raw_routes) == 1
    monkeypatch.setattr(router, "routes", [r for r in router.routes if r not in raw_routes])
    calls.clear()
    routed = await answers(json_ct)
    routed_text = await answers({"Content-Type": "text/plain"})
    assert calls == []
    for (name, _h, _b), got, want in zip(cases, raw + raw_text, routed + routed_text, strict=False):
        assert got == want, name
    for (name, _h, _b), got, want in zip(cases, raw_text, routed_text, strict=True):
        assert got == want, name
    # and what they are: a hit, a miss, the refusals, the invalid bodies
    statuses = dict(zip([c[0] for c in cases], [a[0] for a in raw], strict=True))
    assert raw[0][2] == {"hit_chunks": 1, "hit_tokens": 16, "locations": [raw[0][2]["locations"][0]]}
    assert raw[1][2]["hit_tokens"] == 5 and raw[2][2]["hit_chunks"] == 0
    assert [statuses[n] for n in ("B's capability", "role", "no capability", "garbage capability")] == [403] * 4
    assert statuses["no token"] == 401
    assert {statuses[c[0]] for c in cases[8:-1]} == {422} and statuses["not UTF-8"] == 400
    assert {a[0] for a in raw_text[:8] if a[0] not in (401, 403)} == {422}  # a text body is not JSON


async def test_the_gatekeepers_lookup_bounds_its_body(world: World):
    """The raw lookup reads its body under the gatekeeper's bounds: a declared length over the
    lookup's limit is a 413 before the body is read, a chunked body over it a 413 as it arrives;
    a lookup after them on the same client is answered (the server is fine)."""
    w = world
    own = {**w.h(w.worker_a, w.cap_a), "Content-Type": "application/json"}
    huge = b'{"hashes": ["' + b"a" * (600 << 10) + b'"]}'
    assert_problem(await w.http.post("/v1/lookup", content=huge, headers=own), 413)

    async def stream():
        for _ in range(10):
            yield b" " * (100 << 10)

    assert_problem(await w.http.post("/v1/lookup", content=stream(), headers=own), 413)
    h = random_hash()
    assert (await put(w, h)).status_code == 204
    r = await w.http.post("/v1/lookup", json={"hashes": [h]}, headers=own)
    assert r.status_code == 200 and r.json()["hit_chunks"] == 1


# -- chunks ---------------------------------------------------------------------------------------
async def test_put_chunk(world: World, tmp_path):
    w = world
    h = random_hash()
    assert (await put(w, h)).status_code == 204
    assert_problem(await w.http.put(f"/v1/chunks/{h}", content=fake_envelope()), 401)
    assert_problem(await put(w, h, token=foreign_token(tmp_path, w.live, w.a)), 401)
    assert_problem(await put(w, h, cap=w.cap_b), 403)
    assert_problem(await put(w, h, token=w.admin_a), 403)
    get_only = await w.live.capability(w.http, w.a, ops=["get"])
    assert_problem(await put(w, h, cap=get_only), 403)  # capability without put
    assert_problem(await put(w, h, body=b"plain text is not an envelope"), 422)
    assert_problem(await put(w, h, body=fake_envelope()[:-1]), 422)  # truncated
    assert_problem(await put(w, "0" * 63), 422)
    assert_problem(await put(w, "G" * 64), 422)


async def test_get_head_delete_chunk(world: World, tmp_path):
    w = world
    h, absent = random_hash(), random_hash()
    env = fake_envelope(1000)
    assert (await put(w, h, body=env)).status_code == 204
    r = await w.http.get(f"/v1/chunks/{h}", headers=w.h(w.worker_a, w.cap_a))
    assert r.status_code == 200 and r.content == env
    assert r.headers["content-type"] == "application/octet-stream" and r.headers["x-kv-tier"]
    r = await w.http.head(f"/v1/chunks/{h}", headers=w.h(w.worker_a, w.cap_a))
    assert r.status_code == 200 and "memory" in r.headers["x-kv-tiers"]
    for method in ("GET", "HEAD", "DELETE"):
        url = f"/v1/chunks/{h}"
        assert_problem(await w.http.request(method, url), 401)
        assert_problem(await w.http.request(method, url, headers=w.h(foreign_token(tmp_path, w.live, w.a), w.cap_a)), 401)
        assert_problem(await w.http.request(method, url, headers=w.h(w.worker_a, w.cap_b)), 403)
        assert_problem(await w.http.request(method, url, headers=w.h(w.admin_a, w.cap_a)), 403)
        # tenant B with its own valid capability: A's chunk does not exist for B (404, like any absent chunk)
        assert_problem(await w.http.request(method, url, headers=w.h(w.worker_b, w.cap_b)), 404)
        assert_problem(await w.http.request(method, f"/v1/chunks/{absent}", headers=w.h(w.worker_a, w.cap_a)), 404)
        assert_problem(await w.http.request(method, "/v1/chunks/nothex", headers=w.h(w.worker_a, w.cap_a)), 422)
    assert (await w.http.get(f"/v1/chunks/{h}", headers=w.h(w.worker_a, w.cap_a))).status_code == 200  # untouched
    assert (await w.http.delete(f"/v1/chunks/{h}", headers=w.h(w.worker_a, w.cap_a))).status_code == 204
    assert_problem(await w.http.get(f"/v1/chunks/{h}", headers=w.h(w.worker_a, w.cap_a)), 404)


async def test_put_over_the_limit_is_413(tmp_path):
    from tests.support.server_fixture import running_server

    with running_server(tmp_path / "s", max_chunk_bytes=4096) as live:
        async with live.client() as http:
            a = await live.create_tenant(http)
            cap, tok = await live.capability(http, a), live.worker_token(a)
            h = random_hash()
            small = fake_envelope(1000)
            assert (await http.put(f"/v1/chunks/{h}", content=small, headers=live.headers(tok, cap))).status_code == 204
            big = fake_envelope(5000)
            assert_problem(await http.put(f"/v1/chunks/{h}", content=big, headers=live.headers(tok, cap)), 413)
            # far over the limit: refused before a byte of it is read; without a token, 401 first
            assert_problem(await http.put(f"/v1/chunks/{h}", content=b"\0" * (2 << 20), headers=live.headers(tok, cap)), 413)
            assert_problem(await http.put(f"/v1/chunks/{h}", content=b"\0" * (2 << 20)), 401)
            # a chunked body (no Content-Length) is refused too, and nothing changed
            async def gen():
                yield big

            r = await http.put(f"/v1/chunks/{h}", content=gen(), headers=live.headers(tok, cap))
            assert r.status_code in (411, 413, 422) and r.headers["content-type"].startswith("application/problem+json")
            got = await http.get(f"/v1/chunks/{h}", headers=live.headers(tok, cap))
            assert got.content == small


# -- pins -----------------------------------------------------------------------------------------
async def test_pins(world: World, tmp_path):
    w = world
    h, absent = random_hash(), random_hash()
    assert (await put(w, h)).status_code == 204
    hdr = w.h(w.admin_a, w.pin_a)
    assert (await w.http.post("/v1/pins", json={"hash": h}, headers=hdr)).status_code == 204
    assert_problem(await w.http.post("/v1/pins", json={"hash": h}), 401)
    assert_problem(await w.http.post("/v1/pins", json={"hash": h}, headers=w.h("x.y.z", w.pin_a)), 401)
    assert_problem(await w.http.post("/v1/pins", json={"hash": h}, headers=w.h(w.worker_a, w.pin_a)), 403)  # role
    assert_problem(await w.http.post("/v1/pins", json={"hash": h}, headers=w.h(w.admin_a, w.cap_a)), 403)  # no pin op
    admin_b = w.live.admin_token(w.b)
    assert_problem(await w.http.post("/v1/pins", json={"hash": h}, headers=w.h(admin_b, w.pin_a)), 403)
    assert_problem(await w.http.post("/v1/pins", json={"hash": absent}, headers=hdr), 404)
    assert_problem(await w.http.post("/v1/pins", json={"hash": "nothex"}, headers=hdr), 422)
    assert_problem(await w.http.post("/v1/pins", json={}, headers=hdr), 422)
    assert_problem(await w.http.delete(f"/v1/pins/{h}"), 401)
    assert_problem(await w.http.delete(f"/v1/pins/{h}", headers=w.h(w.worker_a, w.pin_a)), 403)
    assert_problem(await w.http.delete(f"/v1/pins/{h}", headers=w.h(admin_b, w.pin_a)), 403)
    assert_problem(await w.http.delete("/v1/pins/nothex", headers=hdr), 422)
    assert (await w.http.delete(f"/v1/pins/{h}", headers=hdr)).status_code == 204
    assert_problem(await w.http.delete(f"/v1/pins/{h}", headers=hdr), 404)  # no longer pinned
    assert_problem(await w.http.delete(f"/v1/pins/{absent}", headers=hdr), 404)


# -- per-envelope keys (remote mode) ----------------------------------------------------------------
KEYS = "/v1/keys/envelopes"


def _seal(*hashes: str) -> dict[str, object]:
    return {"purpose": "seal", "hashes": list(hashes)}


def _open(*refs: tuple[str, int, str]) -> dict[str, object]:
    return {"purpose": "open", "envelopes": [{"hash": h, "key_version": v, "salt": s} for h, v, s in refs]}


async def _audit_rows(w: World, action: str) -> list[dict]:
    await w.live.call(w.live.runtime.audit.flush, 10)
    r = await w.http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"}, headers=w.h(w.admin_a))
    assert r.status_code == 200
    return [row for row in map(json.loads, r.text.splitlines()) if row.get("action") == action]


async def test_envelope_keys_seal_and_open(world: World):
    """Sealing keys: a fresh salt per envelope, its key and storage key; opening keys: the same key
    for the same salt. Counted (stats, /metrics, per capability) and audited once per request."""
    w = world
    plane = w.live.state.plane
    hashes = [random_hash() for _ in range(3)]
    before = w.live.runtime.metrics.envelope_keys_issued["seal"]
    r = await w.http.post(KEYS, json=_seal(*hashes), headers=w.h(w.worker_a, w.cap_a))
    assert r.status_code == 200
    got = r.json()
    assert (got["tenant"], got["namespace"], got["chunk_tokens"]) == (w.a, "default", w.live.settings.chunk_tokens)
    items = got["keys"]
    assert [i["hash"] for i in items] == hashes
    salts = {base64.b64decode(i["salt"]) for i in items}
    assert len(salts) == 3 and all(len(x) == 32 for x in salts)  # one fresh salt per envelope
    assert all(len(base64.b64decode(i["key"])) == 32 and i["key_version"] >= 1 for i in items)
    ns = await w.live.call(w.live.runtime.resolver.keys, w.a, "default")
    assert [i["storage_key"] for i in items] == [ns.storage_key(bytes.fromhex(h)) for h in hashes]
    assert "dek" not in got and "index_key" not in got and "binding_secret" not in got
    assert w.live.runtime.metrics.envelope_keys_issued["seal"] == before + 3
    cap_id = read_unverified(w.cap_a).cap_id
    assert plane.issued_to(cap_id) == 3
    # opening: the key of each envelope from its header's version and salt, in one call
    refs = [(i["hash"], i["key_version"], i["salt"]) for i in items]
    r = await w.http.post(KEYS, json=_open(*refs), headers=w.h(w.worker_a, w.cap_a))
    assert r.status_code == 200
    assert [(i["key"], i["storage_key"]) for i in r.json()["keys"]] == [(i["key"], i["storage_key"]) for i in items]
    assert plane.issued_to(cap_id) == 6
    # a destroyed or unknown key version: that item has no key (a miss), the others do
    r = await w.http.post(KEYS, json=_open(refs[0], (hashes[1], 99, refs[1][2])), headers=w.h(w.worker_a, w.cap_a))
    assert [i["key"] is None for i in r.json()["keys"]] == [False, True]
    assert plane.issued_to(cap_id) == 7  # only keys issued count
    # counted in /metrics, by purpose
    metrics = (await w.http.get("/metrics", headers=w.h(w.live.operator_token()))).text
    seal_lines = [x for x in metrics.splitlines() if x.startswith("kvgate_envelope_keys_issued_total") and 'purpose="seal"' in x]
    assert len(seal_lines) == 1 and float(seal_lines[0].rsplit(" ", 1)[1]) >= 3
    # audited in aggregate: one event per request, with the count
    rows = await _audit_rows(w, "key.issue")
    mine = [row for row in rows if row["details"]["cap_id"] == cap_id]
    assert [(row["details"]["purpose"], row["details"]["issued"]) for row in mine] == [("seal", 3), ("open", 3), ("open", 1)]
    assert all(row["target"]["tenant"] == w.a for row in mine)
    assert [row["details"]["capability_total"] for row in mine] == [3, 6, 7]


async def test_envelope_keys_are_capability_checked(world: World, tmp_path):
    w = world
    h = random_hash()
    ok = await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, w.cap_a))
    assert ok.status_code == 200  # the positive control
    salt = ok.json()["keys"][0]["salt"]
    version = ok.json()["keys"][0]["key_version"]
    for body in (_seal(h), _open((h, version, salt))):
        assert_problem(await w.http.post(KEYS, json=body, headers={"X-KV-Capability": w.cap_a}), 401)
        assert_problem(await w.http.post(KEYS, json=body, headers=w.h(foreign_token(tmp_path, w.live, w.a), w.cap_a)), 401)
        assert_problem(await w.http.post(KEYS, json=body, headers=w.h(w.worker_a)), 403)  # no capability
        assert_problem(await w.http.post(KEYS, json=body, headers=w.h(w.worker_a, w.cap_b)), 403)  # B's capability
        assert_problem(await w.http.post(KEYS, json=body, headers=w.h(w.admin_a, w.cap_a)), 403)  # not a worker
    get_only = await w.live.capability(w.http, w.a, ops=["get", "lookup"])
    put_only = await w.live.capability(w.http, w.a, ops=["put"])
    assert_problem(await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, get_only)), 403)  # sealing needs put
    assert_problem(await w.http.post(KEYS, json=_open((h, version, salt)), headers=w.h(w.worker_a, put_only)), 403)
    assert (await w.http.post(KEYS, json=_open((h, version, salt)), headers=w.h(w.worker_a, get_only))).status_code == 200
    # a capability its holder narrowed to a chunk allowlist: keys for those chunks only
    narrowed = attenuate(w.cap_a, chunks=[h])
    assert (await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, narrowed))).status_code == 200
    assert_problem(await w.http.post(KEYS, json=_seal(h, random_hash()), headers=w.h(w.worker_a, narrowed)), 403)
    for bad in (
        {"purpose": "seal", "hashes": []}, {"purpose": "seal", "hashes": ["nothex"]}, {"purpose": "fly", "hashes": [h]},
        {"purpose": "seal", "hashes": [h] * 4097}, {"purpose": "open", "envelopes": [{"hash": h, "key_version": 1}]},
        _open((h, 1, "short")), _open((h, -1, salt)), {"hashes": [h]}, {**_seal(h), "extra": 1},
    ):
        assert_problem(await w.http.post(KEYS, json=bad, headers=w.h(w.worker_a, w.cap_a)), 422)


async def test_envelope_keys_are_bounded_per_capability(world: World):
    """Past a capability's budget: a typed 403, nothing issued or counted; a new capability has a
    new budget."""
    w = world
    plane = w.live.state.plane
    saved = plane.max_keys_per_capability
    plane.max_keys_per_capability = 5
    try:
        cap = await w.live.capability(w.http, w.a)
        hdr = w.h(w.worker_a, cap)
        assert (await w.http.post(KEYS, json=_seal(*[random_hash() for _ in range(4)]), headers=hdr)).status_code == 200
        issued = w.live.runtime.metrics.envelope_keys_issued.total()
        body = assert_problem(await w.http.post(KEYS, json=_seal(random_hash(), random_hash()), headers=hdr), 403)
        assert body["type"] == "urn:kvgate:problem:key-budget-spent"
        assert w.live.runtime.metrics.envelope_keys_issued.total() == issued
        assert plane.issued_to(read_unverified(cap).cap_id) == 4
        assert (await w.http.post(KEYS, json=_seal(random_hash()), headers=hdr)).status_code == 200  # 5: the last
        refused = [row for row in await _audit_rows(w, "key.issue") if row["outcome"] == "denied"]
        assert [(row["details"]["cap_id"], row["details"]["requested"]) for row in refused] == [(read_unverified(cap).cap_id, 2)]
        fresh = await w.live.capability(w.http, w.a)
        assert (await w.http.post(KEYS, json=_seal(random_hash(), random_hash()), headers=w.h(w.worker_a, fresh))).status_code == 200
    finally:
        plane.max_keys_per_capability = saved


async def test_the_data_key_lease_is_gone(world: World):
    w = world
    for body in (None, {"version": 1}):
        assert_problem(await w.http.post("/v1/keys/lease", json=body, headers=w.h(w.worker_a, w.cap_a)), 404)
    paths = (await w.http.get("/openapi.json")).json()["paths"]
    assert "/v1/keys/lease" not in paths and "post" in paths[KEYS]


# -- unauthenticated surface -------------------------------------------------------------------
async def test_health_and_unknown_routes(world: World):
    w = world
    assert (await w.http.get("/healthz")).json() == {"status": "ok"}
    r = await w.http.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    # under /v1 nothing is answered before the bearer token is verified, not even "no such route"
    assert_problem(await w.http.get("/v1/nothing-here"), 401)
    assert_problem(await w.http.patch(f"/v1/chunks/{random_hash()}"), 401)
    assert_problem(await w.http.get("/v1/nothing-here", headers=w.h(w.worker_a)), 404)
    assert_problem(await w.http.patch(f"/v1/chunks/{random_hash()}", headers=w.h(w.worker_a)), 405)
    assert (await w.http.get("/openapi.json")).json()["info"]["title"] == "kvgate"
