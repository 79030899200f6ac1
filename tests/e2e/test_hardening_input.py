"""Issue 15, points 1 and 2, run as an attacker (or a careless admin) would run them against a
live server: a misspelt field destroys nothing, a destructive request names its scope, and every
name on every route is canonical -- refused with 422 before any work, and the refusal audited
with the value escaped. Each refusal sits beside a positive control that succeeds."""

from __future__ import annotations

import json

import pytest

from gateway.protocol import frames
from tests.support import chunks, server_fixture
from tests.support.server_fixture import LiveServer, assert_problem, fake_envelope, random_hash

live_any = server_fixture.live_any  # a fixture, registered in this module


async def _stored_chunk(live: LiveServer, http, tenant: str) -> tuple[str, str, str]:
    cap = await live.capability(http, tenant)
    h = random_hash()
    tok = live.worker_token(tenant)
    assert (await chunks.store(http, live.headers(tok, cap), [(h, fake_envelope())])).status_code == 204
    return cap, tok, h


async def _still_readable(live: LiveServer, http, tok: str, cap: str, h: str) -> bool:
    """The chunk is fetched, with a key to open it (its key version is live)."""
    r = await chunks.post_fetch(http, live.headers(tok, cap), [h])
    if r.status_code != 200:
        return False
    ((item, _envelope),) = chunks.parse_fetch(r.content).items
    return item.status == frames.OK and item.key != bytes(32)


# -- point 1: nothing destructive by accident ----------------------------------------------------
MISSPELT_CLEARS = [
    {"namespce": "scratch"},  # the request: a typo, no scope
    {},  # nothing named at all
    {"scope": "tenant"},  # the tenant not named, even though it is the caller's own
    {"scope": "namespace", "tenant": "{a}"},  # a namespace clear without the namespace
    {"scope": "namespace", "tenant": "{a}", "namespce": "scratch"},
    {"scope": "tenant", "tenant": "{a}", "namespace": "scratch"},  # mixed scopes
    {"scope": "chunks", "tenant": "{a}", "namespace": "default"},  # a chunk clear without chunks
    {"scope": "everything", "tenant": "{a}"},
    {"scope": "tenant", "tenant": "{a}", "dry_run": True},  # an option the API does not have
]


@pytest.mark.parametrize("body", MISSPELT_CLEARS, ids=[str(b) for b in MISSPELT_CLEARS])
async def test_misspelt_clear_destroys_nothing(live_any: LiveServer, body: dict):
    live = live_any
    async with live.client() as http:
        a = await live.create_tenant(http)
        cap, tok, h = await _stored_chunk(live, http, a)
        sent = {k: (v.format(a=a) if isinstance(v, str) else v) for k, v in body.items()}
        assert_problem(await http.post("/v1/admin/clear", json=sent, headers=live.headers(live.admin_token(a))), 422)
        # nothing destroyed: the key version still opens, the capability still works, the chunk is there
        assert await _still_readable(live, http, tok, cap, h)
        r = await http.post("/v1/lookup", json={"hashes": [h]}, headers=live.headers(tok, cap))
        assert r.status_code == 200 and r.json()["hit_chunks"] == 1
        # positive control: the same admin, scope named, clears (and then the capability is gone)
        r = await http.post("/v1/admin/clear", json={"scope": "tenant", "tenant": a}, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200 and r.json()["scope"] == "tenant" and r.json()["destroyed_key_versions"]
        assert_problem(await http.post("/v1/lookup", json={"hashes": [h]}, headers=live.headers(tok, cap)), 403)


async def test_namespace_clear_names_its_scope(live_any: LiveServer):
    live = live_any
    async with live.client() as http:
        a = await live.create_tenant(http)
        cap, tok, h = await _stored_chunk(live, http, a)
        scratch = await live.capability(http, a, namespace="scratch")
        body = {"scope": "namespace", "tenant": a, "namespace": "scratch"}
        r = await http.post("/v1/admin/clear", json=body, headers=live.headers(live.admin_token(a)))
        assert r.status_code == 200 and r.json()["scope"] == "namespace" and r.json()["destroyed_key_versions"] == []
        assert await _still_readable(live, http, tok, cap, h)  # another namespace: untouched
        assert scratch


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/v1/admin/move", {"namespace": "default", "hashes": ["0" * 64], "from": "memory", "to": "disk"}),
        ("POST", "/v1/admin/move", {"tenant": "{a}", "namespace": "default", "hashes": ["0" * 64], "from": "memory", "to": "disk", "force": 1}),
        ("POST", "/v1/capabilities", {"namespace": "default", "ops": ["get"], "tennant": "{b}"}),
        ("POST", "/v1/admin/tenants", {"tenant": "x-{a}", "status": "disabled"}),
    ],
)
async def test_unknown_or_missing_fields_are_refused(live_any: LiveServer, method: str, path: str, body: dict):
    live = live_any
    async with live.client() as http:
        a, b = await live.create_tenant(http), await live.create_tenant(http)
        sent = {k: (v.format(a=a, b=b) if isinstance(v, str) else v) for k, v in body.items()}
        token = live.operator_token() if "tenants" in path else live.token(a, ("kv.worker", "kv.admin"))
        assert_problem(await http.request(method, path, json=sent, headers=live.headers(token)), 422)


async def test_rotate_and_disable_take_their_tenant_from_the_path_only(live_any: LiveServer):
    live = live_any
    async with live.client() as http:
        a, b = await live.create_tenant(http), await live.create_tenant(http)
        op = live.headers(live.operator_token())
        # a body naming another tenant (or anything) is refused, not ignored
        assert_problem(await http.post(f"/v1/admin/tenants/{a}/keys/rotate", json={"tenant": b}, headers=op), 413)
        assert_problem(await http.request("DELETE", f"/v1/admin/tenants/{a}", json={"tenant": b}, headers=op), 413)
        # positive controls
        r = await http.post(f"/v1/admin/tenants/{a}/keys/rotate", headers=op)
        assert r.status_code == 200 and r.json()["tenant"] == a
        r = await http.delete(f"/v1/admin/tenants/{b}", headers=op)
        assert r.status_code == 200 and r.json() == {"tenant": b, "status": "disabled", "key_version": None}


# -- point 2: names are canonical ----------------------------------------------------------------
BAD_NAMES = {
    "nul": "acme\x00",
    "upper case": "Acme",
    "trailing space": "acme ",
    "cyrillic a": "\u0430cme",
    "zero width": "ac\u200bme",
    "combining accent": "acme\u0301",
    "trailing dot": "acme.",
    "percent": "ac%me",
    "fullwidth": "\uff41cme",
    "too long": "a" * 65,
}


def _routes(a: str, bad: str) -> list[tuple[str, str, dict]]:
    """(method, url, request kwargs) of every route that takes a name, with ``bad`` in it."""
    from urllib.parse import quote

    hashes = ["0" * 64]
    return [
        ("POST", "/v1/admin/tenants", {"json": {"tenant": bad}}),
        ("POST", "/v1/capabilities", {"json": {"namespace": bad, "ops": ["get"]}}),
        ("POST", "/v1/capabilities", {"json": {"namespace": "default", "ops": ["get"], "tenant": bad}}),
        ("POST", "/v1/admin/clear", {"json": {"scope": "tenant", "tenant": bad}}),
        ("POST", "/v1/admin/clear", {"json": {"scope": "namespace", "tenant": a, "namespace": bad}}),
        ("POST", "/v1/admin/move", {"json": {"tenant": a, "namespace": bad, "hashes": hashes, "from": "memory", "to": "disk"}}),
        ("POST", "/v1/admin/move", {"json": {"tenant": bad, "namespace": "default", "hashes": hashes, "from": "memory", "to": "disk"}}),
        ("POST", f"/v1/admin/tenants/{quote(bad, safe='')}/keys/rotate", {}),
        ("DELETE", f"/v1/admin/tenants/{quote(bad, safe='')}", {}),
        ("GET", "/v1/admin/audit/export", {"params": {"tenant": bad}}),
        ("GET", "/v1/admin/audit/export/manifest", {"params": {"tenant": bad}}),
    ]


@pytest.mark.parametrize("kind", sorted(BAD_NAMES))
async def test_bad_names_are_refused_and_audited_on_every_route(live_any: LiveServer, kind: str):
    live = live_any
    bad = BAD_NAMES[kind]
    async with live.client() as http:
        a = await live.create_tenant(http)
        op = live.headers(live.operator_token())
        for method, url, kw in _routes(a, bad):
            r = await http.request(method, url, headers=op, **kw)
            assert_problem(r, 422)
            assert r.headers.get("connection") != "close", (method, url)  # refused, connection kept
        # no tenant was created under a lookalike name, and the real one is untouched
        await live.call(live.runtime.audit.flush, 10)

        async def denials():
            return [
                (rec.event, json.loads(rec.event.details)) async for rec in live.runtime.audit.store.iter_records()
                if rec.event.action == "authz.denied" and '"invalid name"' in rec.event.details
            ]

        rows = await live.call(denials)
        from tenancy.names import escape

        mine = [(e, d) for e, d in rows if d.get("value") == escape(bad)]
        assert len(mine) >= len(_routes(a, bad)), (len(mine), [d for _, d in rows][-3:])
        assert all(d["value"].isascii() and d["value"].isprintable() for _, d in mine)
        assert all(e.actor.subject for e, _ in mine)  # who probed is on record
        # positive control: the canonical name works on the same routes
        r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"], "tenant": a}, headers=op)
        assert r.status_code == 201, r.text


async def test_lookalike_tenants_cannot_be_created(live_any: LiveServer):
    live = live_any
    async with live.client() as http:
        op = live.headers(live.operator_token())
        base = f"lk-{random_hash()[:8]}"
        assert (await http.post("/v1/admin/tenants", json={"tenant": base}, headers=op)).status_code == 201
        for variant in (base.upper(), base + " ", base + "\u200b", "\u0430" + base[1:], base + "\x00"):
            assert_problem(await http.post("/v1/admin/tenants", json={"tenant": variant}, headers=op), 422)
        # positive control: the same name again is the 409 it should be
        assert_problem(await http.post("/v1/admin/tenants", json={"tenant": base}, headers=op), 409)


def test_cli_refuses_bad_names(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from gateway.cli.main import app

    monkeypatch.setenv("KVGATE_STATE_DIR", str(tmp_path / "state"))
    runner = CliRunner()
    for args in (
        ["tenants", "create", "Acme"], ["tenants", "create", "acme\u200b"], ["tenants", "disable", "acme "],
        ["keys", "rotate", "\u0430cme"], ["clear", "acme", "--namespace", "Default"], ["clear", "acme."],
        ["audit", "export", "--tenant", "ACME"],
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, (args, res.exit_code, res.output)
        assert "must be 1..64 characters" in res.output
    assert not (tmp_path / "state").exists()  # refused before any work: no state created
