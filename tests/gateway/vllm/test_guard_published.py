"""Published prefixes reach vLLM's own prefix cache through the tenant's cache_salt: the middleware,
against a live kvgate server over HTTP, gives a member a salt that changes when a prefix of its
scope is revoked or when it leaves the scope (so nothing vLLM cached of a scope under the old
salt is matched again), and stays the same while nothing changes (the positive control); a
tenant in no scope keeps the salt it has without published prefixes."""

from __future__ import annotations

import json
import secrets

import httpx
import pytest

from gateway.vllm.guard import GuardConfig, TenantGuard
from gateway.vllm.middleware import KvgateMiddleware
from gateway.vllm.salt import cache_salt
from tenancy.oidc import IssuerConfig
from tests.support.asgi import echo_body
from tests.support.server_fixture import LiveServer, running_server

SECRET = bytes(range(32))


_echo = echo_body  # answers with the body the middleware passed on


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory):
    with running_server(tmp_path_factory.mktemp("guard-published")) as server:
        yield server


async def _salt(live: LiveServer, tenant: str) -> str:
    issuer = IssuerConfig(issuer=live.base_url + "/dev-issuer", audience="kvgate", allow_http=True)
    guard = TenantGuard(GuardConfig(issuers=[issuer], salt_secret=SECRET, gateway_url=live.base_url))
    try:
        app = KvgateMiddleware(_echo, guard)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
            r = await c.post("/v1/completions", json={"prompt": "hi"},
                             headers={"Authorization": f"Bearer {live.worker_token(tenant)}"})
        assert r.status_code == 200, r.text
        return str(json.loads(r.content)["cache_salt"])
    finally:
        await guard.aclose()


async def test_published_revoke_and_leaving_a_scope_change_the_members_cache_salt(live: LiveServer):
    member, outsider = f"m-{secrets.token_hex(3)}", f"o-{secrets.token_hex(3)}"
    scope = f"s-{secrets.token_hex(4)}"
    op = live.headers(live.operator_token())
    async with live.client() as http:
        for t in (member, outsider):
            await live.create_tenant(http, t)
        alone = await _salt(live, member)
        assert alone == cache_salt(SECRET, member, "default", 0)  # no scope: the salt it always had
        r = await http.post("/v1/admin/scopes", json={"name": scope, "members": [member]}, headers=op)
        assert r.status_code == 201, r.text
        r = await http.post("/v1/admin/prefixes", json={"scope": scope, "model": "m", "token_ids": list(range(40))}, headers=op)
        assert r.status_code == 201, r.text
        prefix_id = r.json()["id"]
        published = await _salt(live, member)
        assert published != alone
        assert await _salt(live, member) == published  # the positive control: nothing changed, same salt
        outsiders = await _salt(live, outsider)
        assert outsiders == cache_salt(SECRET, outsider, "default", 0)

        r = await http.delete(f"/v1/admin/prefixes/{prefix_id}", headers=op)
        assert r.status_code == 200, r.text
        revoked = await _salt(live, member)
        assert revoked not in (published, alone)  # nothing vLLM cached under the published salt matches
        assert await _salt(live, outsider) == outsiders  # a revoke elsewhere flushes no one else's cache

        r = await http.post("/v1/admin/prefixes", json={"scope": scope, "model": "m", "token_ids": list(range(40))}, headers=op)
        assert r.status_code == 201, r.text
        again = await _salt(live, member)
        assert again not in (published, revoked)
        r = await http.delete(f"/v1/admin/scopes/{scope}/members/{member}", headers=op)
        assert r.status_code in (200, 204), r.text
        left = await _salt(live, member)
        assert left != again and left == alone  # out of every scope: its own salt, nothing shared
