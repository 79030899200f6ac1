"""Issue 15, point 6, without an engine: the tenant middleware's cache_salt follows the namespace
epoch a secure clear bumps, so a clear orphans every block vLLM cached for the tenant before it.
(The same on a real CPU engine with vLLM's prefix cache on: tests/engine/test_http.py.)"""

from __future__ import annotations

import json
import secrets

import pytest

from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.guard import GuardConfig, TenantGuard
from tests.support import server_fixture
from tests.support.server_fixture import LiveServer

live_server = server_fixture.live_server  # a fixture, registered in this module


async def _salt(guard: TenantGuard, token: str) -> str:
    _, body = await guard.admit(f"Bearer {token}", json.dumps({"prompt": "x", "cache_salt": "mine"}).encode())
    return json.loads(body)["cache_salt"]


async def test_a_clear_changes_the_cache_salt(live_server: LiveServer):
    live = live_server
    env = {
        "KVGATE_VLLM_ISSUER": live.base_url + "/dev-issuer", "KVGATE_VLLM_GATEWAY_URL": live.base_url,
        "KVGATE_VLLM_SALT_SECRET": secrets.token_hex(32),
    }
    guard = TenantGuard(GuardConfig.from_env(env))
    try:
        async with live.client() as http:
            a = await live.create_tenant(http)
            worker, admin = live.worker_token(a), live.admin_token(a)
            first = await _salt(guard, worker)
            assert await _salt(guard, worker) == first  # positive control: stable while nothing is cleared
            salts = [first]
            for body in (
                {"scope": "namespace", "tenant": a, "namespace": "default"},
                {"scope": "tenant", "tenant": a},
                {"scope": "namespace", "tenant": a, "namespace": "default"},
            ):
                r = await http.post("/v1/admin/clear", json=body, headers=live.headers(admin))
                assert r.status_code == 200, r.text
                salt = await _salt(guard, worker)
                assert salt not in salts, f"the cache_salt did not change after a {body['scope']} clear"
                assert await _salt(guard, worker) == salt
                salts.append(salt)
            # another namespace's clear leaves this namespace's salt (and vLLM's blocks) alone
            r = await http.post(
                "/v1/admin/clear", json={"scope": "namespace", "tenant": a, "namespace": "other"}, headers=live.headers(admin)
            )
            assert r.status_code == 200
            assert await _salt(guard, worker) == salts[-1]
    finally:
        await guard.aclose()


def test_a_configured_salt_epoch_is_refused():
    env = {"KVGATE_VLLM_ISSUER": "http://127.0.0.1:1/i", "KVGATE_VLLM_SALT_SECRET": "ab" * 32}
    GuardConfig.from_env(env)  # positive control
    with pytest.raises(ConnectorConfigError, match="SALT_EPOCH"):
        GuardConfig.from_env({**env, "KVGATE_VLLM_SALT_EPOCH": "3"})


async def test_middleware_reads_no_body_before_the_token(live_server: LiveServer):
    """Issue 15, point 3 in vLLM's own server: the tenant middleware answers 401 to a caller
    without a valid token before it reads a byte of the body (it used to read up to 16 MB first)."""
    from gateway.vllm.middleware import KvgateMiddleware

    live = live_server
    env = {
        "KVGATE_VLLM_ISSUER": live.base_url + "/dev-issuer", "KVGATE_VLLM_GATEWAY_URL": live.base_url,
        "KVGATE_VLLM_SALT_SECRET": secrets.token_hex(32),
    }
    guard = TenantGuard(GuardConfig.from_env(env))
    reads: list[int] = []
    forwarded: list[bytes] = []

    async def receive() -> dict:
        reads.append(1)
        return {"type": "http.request", "body": json.dumps({"prompt": "hi"}).encode(), "more_body": False}

    async def vllm(scope, receive, send) -> None:
        forwarded.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    mw = KvgateMiddleware(vllm, guard=guard)
    try:
        async with live.client() as http:
            a = await live.create_tenant(http)
        for auth in (None, b"Bearer garbage", b"Bearer " + live.token("nobody", ("kv.worker",)).encode()[:-4] + b"AAAA"):
            sent: list[dict] = []

            async def send(m: dict) -> None:
                sent.append(m)

            headers = [(b"content-type", b"application/json"), (b"content-length", str(16 << 20).encode())]
            if auth is not None:
                headers.append((b"authorization", auth))
            await mw({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send)
            assert sent[0]["status"] == 401
        assert reads == [] and forwarded == []
        # positive control: a valid token, and the body is read, salted and forwarded
        sent = []

        async def send(m: dict) -> None:
            sent.append(m)

        headers = [(b"content-type", b"application/json"), (b"authorization", f"Bearer {live.worker_token(a)}".encode())]
        await mw({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive, send)
        assert sent[0]["status"] == 200 and reads == [1]
        assert "cache_salt" in json.loads(forwarded[0])
    finally:
        await guard.aclose()
