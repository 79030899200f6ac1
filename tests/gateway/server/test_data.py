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

from crypto.envelope import ChunkCipher, EnvelopeContext
from crypto.segments import IssuedKey
from gateway.protocol import frames
from tenancy.capabilities import attenuate, read_unverified
from tenancy.devissuer import DevIssuer
from tests.support import chunks, server_fixture
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
    """``PUT /v1/chunks`` with one envelope (``fake_envelope()`` unless ``body``)."""
    return await chunks.store(w.http, w.h(token or w.worker_a, cap or w.cap_a), [(h, body if body is not None else fake_envelope())])


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
    assert raw[0][2] == {"hit_chunks": 1, "hit_tokens": 16, "locations": [raw[0][2]["locations"][0]], "degraded": ""}
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
    assert_problem(await chunks.store(w.http, {}, [(h, fake_envelope())]), 401)
    assert_problem(await put(w, h, token=foreign_token(tmp_path, w.live, w.a)), 401)
    assert_problem(await put(w, h, cap=w.cap_b), 403)
    assert_problem(await put(w, h, token=w.admin_a), 403)
    get_only = await w.live.capability(w.http, w.a, ops=["get"])
    assert_problem(await put(w, h, cap=get_only), 403)  # capability without put
    for body in (b"plain text is not an envelope", fake_envelope()[:-1]):  # not an envelope; truncated
        other = random_hash()
        assert "not a kvgate envelope" in assert_problem(await put(w, other, body=body), 400)["detail"]
        assert await chunks.stored(w.http, w.h(w.worker_a, w.cap_a), [other]) == [False]
    twice = chunks.frame([(h, fake_envelope()), (h, fake_envelope())])
    r = await w.http.put("/v1/chunks", content=twice, headers={**w.h(w.worker_a, w.cap_a), "Content-Type": chunks.BATCH})
    assert "twice" in assert_problem(r, 400)["detail"]


async def test_fetch_lookup_and_clear_of_one_chunk(world: World, tmp_path):
    """One chunk read back, found and removed through the routes a worker and an admin use; every
    refusal beside the same request done right."""
    w = world
    h, absent = random_hash(), random_hash()
    env = fake_envelope(1000)
    own = w.h(w.worker_a, w.cap_a)
    assert (await put(w, h, body=env)).status_code == 204
    r = await chunks.post_fetch(w.http, own, [h])
    assert r.status_code == 200 and r.headers["content-type"] == chunks.BATCH
    got = chunks.parse_fetch(r.content)
    assert (got.tenant, got.namespace, got.statuses, got.envelopes()) == (w.a, "default", [frames.OK], [env])
    assert "memory" in await chunks.where(w.http, own, h)
    for ask in (lambda hdr: chunks.post_fetch(w.http, hdr, [h]), lambda hdr: w.http.post("/v1/lookup", json={"hashes": [h]}, headers=hdr)):
        assert_problem(await ask({"X-KV-Capability": w.cap_a}), 401)
        assert_problem(await ask(w.h(foreign_token(tmp_path, w.live, w.a), w.cap_a)), 401)
        assert_problem(await ask(w.h(w.worker_a, w.cap_b)), 403)
        assert_problem(await ask(w.h(w.admin_a, w.cap_a)), 403)
    # tenant B with its own valid capability: A's chunk does not exist for B (a miss, like any absent chunk)
    assert (await chunks.fetch(w.http, w.h(w.worker_b, w.cap_b), [h])).statuses == [frames.MISSING]
    assert await chunks.where(w.http, w.h(w.worker_b, w.cap_b), h) == []
    assert (await chunks.fetch(w.http, own, [absent])).statuses == [frames.MISSING]
    assert await chunks.where(w.http, own, absent) == []
    for bad in ({"hashes": ["nothex"], "keys": True}, {"hashes": [h]}, {"hashes": [h], "keys": False}):
        assert_problem(await w.http.post("/v1/chunks/fetch", json=bad, headers=own), 422)
    assert await chunks.envelope(w.http, own, h) == env  # untouched
    # removing it: B's admin clearing the same hash in B's tenant removes nothing of A's, and cannot name A
    admin_b = w.h(w.live.admin_token(w.b))
    r = await chunks.remove(w.http, admin_b, w.b, "default", [h])
    assert r.status_code == 200 and r.json()["deleted_chunk_copies"] == 0
    assert_problem(await chunks.remove(w.http, admin_b, w.a, "default", [h]), 403)
    assert_problem(await chunks.remove(w.http, w.h(w.worker_a), w.a, "default", [h]), 403)  # a worker is no admin
    assert await chunks.envelope(w.http, own, h) == env
    r = await chunks.remove(w.http, w.h(w.admin_a), w.a, "default", [h])
    assert r.status_code == 200 and r.json()["deleted_chunk_copies"] >= 1
    assert await chunks.envelope(w.http, own, h) is None


async def test_put_over_the_limit(tmp_path):
    from tests.support.server_fixture import running_server

    with running_server(tmp_path / "s", max_chunk_bytes=4096, max_batch_bytes=1 << 20) as live:
        async with live.client() as http:
            a = await live.create_tenant(http)
            cap, tok = await live.capability(http, a), live.worker_token(a)
            hdr = live.headers(tok, cap)
            h = random_hash()
            small = fake_envelope(1000)
            assert (await chunks.store(http, hdr, [(h, small)])).status_code == 204
            big = fake_envelope(5000)
            assert "4096" in assert_problem(await chunks.store(http, hdr, [(h, big)]), 400)["detail"]  # an item over the chunk limit
            # far over the batch limit: refused before a byte of it is read; without a token, 401 first
            assert_problem(await chunks.store(http, hdr, [(h, b"\0" * (2 << 20))]), 413)
            assert_problem(await chunks.store(http, {}, [(h, b"\0" * (2 << 20))]), 401)
            # a chunked body (no Content-Length) is refused too, and nothing changed
            async def gen():
                yield chunks.frame([(h, big)])

            r = await http.put("/v1/chunks", content=gen(), headers={**hdr, "Content-Type": chunks.BATCH})
            assert r.status_code in (411, 413, 422) and r.headers["content-type"].startswith("application/problem+json")
            assert await chunks.envelope(http, hdr, h) == small


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


async def _audit_rows(w: World, action: str) -> list[dict]:
    await w.live.call(w.live.runtime.audit.flush, 10)
    r = await w.http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"}, headers=w.h(w.admin_a))
    assert r.status_code == 200
    return [row for row in map(json.loads, r.text.splitlines()) if row.get("action") == action]


def _sealed(tenant: str, item: dict, plain: bytes, key_version: int | None = None) -> bytes:
    """An envelope sealed as a remote worker seals it, with the key, salt and storage key the
    server issued (``key_version``: another version written in its header)."""
    ctx = EnvelopeContext(tenant, "default", item["storage_key"], "f" * 64, item["key_version"] if key_version is None else key_version)
    keys = IssuedKey(base64.b64decode(item["salt"]), base64.b64decode(item["key"]))
    return bytes(ChunkCipher(segment_bytes=4096).seal(keys, ctx, plain))


async def test_envelope_keys_seal_and_the_fetch_opens(world: World):
    """Sealing keys: a fresh salt per envelope, its key and storage key; the fetch hands each
    stored envelope the same key for the same salt, and it opens the envelope. Counted (metrics,
    /metrics, per capability) and audited once per request."""
    w = world
    plane = w.live.state.plane
    own = w.h(w.worker_a, w.cap_a)
    hashes = [random_hash() for _ in range(3)]
    before = w.live.runtime.metrics.envelope_keys_issued["seal"]
    r = await w.http.post(KEYS, json=_seal(*hashes), headers=own)
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
    # opening: the fetch sends each envelope's key from its header's version and salt, in one call
    plain = [bytes([k]) * 5000 for k in range(3)]
    envelopes = [_sealed(w.a, i, p) for i, p in zip(items, plain, strict=True)]
    assert (await chunks.store(w.http, own, list(zip(hashes, envelopes, strict=True)))).status_code == 204
    fetched = await chunks.fetch(w.http, own, hashes)
    assert fetched.statuses == [frames.OK] * 3 and fetched.envelopes() == envelopes
    assert [(it.key, it.salt, it.storage_key.hex(), it.key_version) for it, _e in fetched.items] == [
        (base64.b64decode(i["key"]), base64.b64decode(i["salt"]), i["storage_key"], i["key_version"]) for i in items
    ]
    for (it, env), i, p in zip(fetched.items, items, plain, strict=True):
        ctx = EnvelopeContext(w.a, "default", i["storage_key"], "f" * 64, it.key_version)
        assert bytes(ChunkCipher(segment_bytes=4096).open(IssuedKey(it.salt, it.key), ctx, env)) == p
    assert plane.issued_to(cap_id) == 6
    # an unknown (or destroyed) key version: that item has no key and ends the prefix, the one before has
    r = await w.http.post(KEYS, json=_seal(random_hash()), headers=own)
    (odd,) = r.json()["keys"]
    unknown = _sealed(w.a, odd, b"x" * 100, key_version=99)
    assert (await chunks.store(w.http, own, [(odd["hash"], unknown)])).status_code == 204
    fetched = await chunks.fetch(w.http, own, [hashes[0], odd["hash"], hashes[1]])
    assert fetched.statuses == [frames.OK, frames.KEY_UNAVAILABLE]
    assert fetched.items[1][0].key == bytes(32) and fetched.items[1][1] == b""
    assert plane.issued_to(cap_id) == 8  # only keys issued count (the seal's 1, the fetch's 1)
    # counted in /metrics, by purpose
    metrics = (await w.http.get("/metrics", headers=w.h(w.live.operator_token()))).text
    for purpose, least in (("seal", 4), ("open", 4)):
        lines = [x for x in metrics.splitlines() if x.startswith("kvgate_envelope_keys_issued_total") and f'purpose="{purpose}"' in x]
        assert len(lines) == 1 and float(lines[0].rsplit(" ", 1)[1]) >= least
    # audited in aggregate: one event per request, with the count
    rows = await _audit_rows(w, "key.issue")
    mine = [row for row in rows if row["details"]["cap_id"] == cap_id]
    assert [(row["details"]["purpose"], row["details"]["issued"], row["details"]["route"]) for row in mine] == [
        ("seal", 3, KEYS), ("open", 3, "/v1/chunks/fetch"), ("seal", 1, KEYS), ("open", 1, "/v1/chunks/fetch"),
    ]
    assert mine[-1]["details"]["unavailable"] == 1
    assert all(row["target"]["tenant"] == w.a for row in mine)
    assert [row["details"]["capability_total"] for row in mine] == [3, 6, 7, 8]


async def test_envelope_keys_are_capability_checked(world: World, tmp_path):
    """Keys to seal (``POST /v1/keys/envelopes``) and to open (the fetch stream) go only to a worker
    whose capability allows the operation on those chunks."""
    w = world
    h = random_hash()
    ok = await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, w.cap_a))
    assert ok.status_code == 200  # the positive control
    (item,) = ok.json()["keys"]
    assert (await chunks.store(w.http, w.h(w.worker_a, w.cap_a), [(h, _sealed(w.a, item, b"kv" * 100))])).status_code == 204
    asks = (
        lambda hdr: w.http.post(KEYS, json=_seal(h), headers=hdr),
        lambda hdr: chunks.post_fetch(w.http, hdr, [h]),
    )
    for ask in asks:
        assert_problem(await ask({"X-KV-Capability": w.cap_a}), 401)
        assert_problem(await ask(w.h(foreign_token(tmp_path, w.live, w.a), w.cap_a)), 401)
        assert_problem(await ask(w.h(w.worker_a)), 403)  # no capability
        assert_problem(await ask(w.h(w.worker_a, w.cap_b)), 403)  # B's capability
        assert_problem(await ask(w.h(w.admin_a, w.cap_a)), 403)  # not a worker
    get_only = await w.live.capability(w.http, w.a, ops=["get", "lookup"])
    put_only = await w.live.capability(w.http, w.a, ops=["put"])
    assert_problem(await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, get_only)), 403)  # sealing needs put
    assert_problem(await chunks.post_fetch(w.http, w.h(w.worker_a, put_only), [h]), 403)  # opening needs get
    got = await chunks.fetch(w.http, w.h(w.worker_a, get_only), [h])
    assert got.statuses == [frames.OK] and got.items[0][0].key == base64.b64decode(item["key"])
    # a capability its holder narrowed to a chunk allowlist: keys for those chunks only
    narrowed = attenuate(w.cap_a, chunks=[h])
    assert (await w.http.post(KEYS, json=_seal(h), headers=w.h(w.worker_a, narrowed))).status_code == 200
    assert_problem(await w.http.post(KEYS, json=_seal(h, random_hash()), headers=w.h(w.worker_a, narrowed)), 403)
    assert (await chunks.post_fetch(w.http, w.h(w.worker_a, narrowed), [h])).status_code == 200
    assert_problem(await chunks.post_fetch(w.http, w.h(w.worker_a, narrowed), [h, random_hash()]), 403)
    salt = item["salt"]
    for bad in (
        {"purpose": "seal", "hashes": []}, {"purpose": "seal", "hashes": ["nothex"]}, {"purpose": "fly", "hashes": [h]},
        {"purpose": "seal", "hashes": [h] * 4097}, {"hashes": [h]}, {**_seal(h), "extra": 1},
        # keys to open are not asked for: they come with the envelopes (POST /v1/chunks/fetch)
        {"purpose": "open", "envelopes": [{"hash": h, "key_version": item["key_version"], "salt": salt}]},
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


async def test_the_data_key_lease_and_the_per_chunk_routes_are_gone(world: World):
    w = world
    own = w.h(w.worker_a, w.cap_a)
    for body in (None, {"version": 1}):
        assert_problem(await w.http.post("/v1/keys/lease", json=body, headers=own), 404)
    h = random_hash()
    assert (await put(w, h)).status_code == 204  # stored, and still no route reads it one by one
    for method in ("GET", "HEAD", "PUT", "DELETE"):
        r = await w.http.request(method, f"/v1/chunks/{h}", headers=own)
        assert r.status_code == 404, (method, r.status_code)
    assert await chunks.stored(w.http, own, [h]) == [True]
    paths = (await w.http.get("/openapi.json")).json()["paths"]
    assert "/v1/keys/lease" not in paths and "post" in paths[KEYS]
    assert not [p for p in paths if p.startswith("/v1/chunks/{")], sorted(paths)
    assert "put" in paths["/v1/chunks"] and "post" in paths["/v1/chunks/fetch"]


# -- unauthenticated surface -------------------------------------------------------------------
async def test_health_and_unknown_routes(world: World):
    w = world
    assert (await w.http.get("/healthz")).json() == {"status": "ok"}
    r = await w.http.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] is True
    # under /v1 nothing is answered before the bearer token is verified, not even "no such route"
    assert_problem(await w.http.get("/v1/nothing-here"), 401)
    assert_problem(await w.http.patch("/v1/chunks"), 401)
    assert_problem(await w.http.get("/v1/nothing-here", headers=w.h(w.worker_a)), 404)
    assert_problem(await w.http.patch("/v1/chunks", headers=w.h(w.worker_a)), 405)
    assert (await w.http.get("/openapi.json")).json()["info"]["title"] == "kvgate"
