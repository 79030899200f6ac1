"""The tenant middleware (gateway/vllm/middleware.py) in front of a plain ASGI app, against a
live kvgate server and its development issuer over HTTP: an unreachable or failing gateway is a
503 with Retry-After (an outage, never a 403), beside the positive control that passes; and the
connector refuses secrets in --kv-transfer-config (vLLM prints it)."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.errors import AccessDenied
from gateway.vllm.backend import refuse_secrets
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.guard import GuardConfig, TenantGuard
from gateway.vllm.middleware import KvgateMiddleware
from tenancy.oidc import IssuerConfig
from tests.support.asgi import echo_body
from tests.support.server_fixture import running_server
from tests.support.services import free_port

SECRET = bytes(range(32))


_inner = echo_body  # answers with the body the middleware passed on


def _guard(live, gateway_url: str | None, mint=None) -> TenantGuard:
    issuer = IssuerConfig(issuer=live.base_url + "/dev-issuer", audience="kvgate", allow_http=True)
    return TenantGuard(GuardConfig(issuers=[issuer], salt_secret=SECRET, gateway_url=gateway_url), mint=mint)


async def _post(app, token: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as c:
        return await c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": f"Bearer {token}"})


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("guard")) as server:
        async def setup():
            async with server.client() as http:
                await server.create_tenant(http, "acme")

        import asyncio

        asyncio.run(setup())
        yield server


async def test_reachable_gateway_passes_the_request_with_a_capability(live):
    r = await _post(KvgateMiddleware(_inner, _guard(live, live.base_url)), live.worker_token("acme"))
    assert r.status_code == 200, r.text
    body = json.loads(r.content)
    assert body["kv_transfer_params"]["kvgate_capability"] and body["cache_salt"]


async def test_a_clients_own_load_policy_and_capability_never_reach_the_engine(live):
    """A tenant cannot pick its load policy (nor bring a capability): the middleware builds
    kv_transfer_params anew. The control: the request passes, with a minted capability."""
    body = {"prompt": "hi", "kv_transfer_params": {"kvgate_load_policy": "always", "kvgate_capability": "forged"}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=KvgateMiddleware(_inner, _guard(live, live.base_url))),
                                 base_url="http://engine") as c:
        r = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {live.worker_token('acme')}"})
    assert r.status_code == 200, r.text
    params = json.loads(r.content)["kv_transfer_params"]
    assert "kvgate_load_policy" not in params
    assert params["kvgate_capability"] and params["kvgate_capability"] != "forged"


async def test_unreachable_gateway_is_503_with_retry_after(live):
    r = await _post(KvgateMiddleware(_inner, _guard(live, f"http://127.0.0.1:{free_port()}")), live.worker_token("acme"))
    assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
    assert r.headers["content-type"] == "application/problem+json" and r.json()["status"] == 503


async def test_embedded_mint_outage_is_503_but_a_refusal_stays_403(live):
    async def down(principal, namespace):
        raise ConnectionRefusedError("the registry is down")

    async def refused(principal, namespace):
        raise AccessDenied("tenant unavailable")

    r = await _post(KvgateMiddleware(_inner, _guard(live, None, mint=down)), live.worker_token("acme"))
    assert r.status_code == 503 and "retry-after" in r.headers
    r = await _post(KvgateMiddleware(_inner, _guard(live, None, mint=refused)), live.worker_token("acme"))
    assert r.status_code == 403 and "retry-after" not in r.headers


@pytest.mark.parametrize("extra, named", [
    ({"kvgate_settings": {"database_url": "postgresql+asyncpg://kv:hunter2@db/kv"}}, "KVGATE_DATABASE_URL"),
    ({"kvgate_settings": {"redis_url": "redis://:hunter2@cache:6379/0"}}, "KVGATE_REDIS_URL"),
    ({"kvgate_settings": {"pkcs11_pin": "1234"}}, "KVGATE_PKCS11_PIN"),
    ({"mode": "remote", "remote_url": "http://k", "remote_token": "eyJ..."}, "KVGATE_REMOTE_TOKEN"),
])
def test_connector_refuses_secrets_in_its_config(extra, named):
    with pytest.raises(ConnectorConfigError, match=named) as err:
        refuse_secrets(extra)
    assert "hunter2" not in str(err.value) and "1234" not in str(err.value)


def test_connector_config_without_secrets_is_accepted():
    refuse_secrets({"kvgate_settings": {"database_url": "postgresql+asyncpg://kv@db/kv", "redis_url": "redis://cache:6379/0"},
                    "remote_token_file": "/run/secrets/t"})
