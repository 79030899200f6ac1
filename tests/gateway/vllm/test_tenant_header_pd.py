"""The tenant's path through the prefill/decode proxy (gateway/vllm/disagg.py), over real uvicorn
servers: two engines (the tenant middleware in front of an app that answers as an engine would,
the prefill one with a receipt in ``kv_transfer_params``) on Unix sockets that trust only their
socket, the proxy on a TCP port and a Unix socket of its own (the authenticating gateway's), and
a live kvgate server on Postgres that mints the capabilities.

The trusted gateway's tenant header reaches both legs and each engine mints for that tenant; the
decode leg gets the prefill's receipt and nothing else of the client's ``kv_transfer_params``. The
same header sent to the proxy by anyone else is refused there (the engines trust the proxy), audited,
and no engine sees the request; a bearer token is passed on to both legs unchanged."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from audit.writer import AuditWriter
from gateway.vllm.disagg import create_pd_proxy
from gateway.vllm.middleware import KvgateMiddleware
from gateway.vllm.peers import TrustedPeers
from gateway.vllm.relay import read_body
from tenancy.capabilities import read_unverified
from tests.gateway.vllm.test_tenant_header import _bearer, _env, _refused, serve
from tests.support.audit_events import live_rows
from tests.support.server_fixture import LiveServer, running_server, scratch_pg_database


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with scratch_pg_database() as url, running_server(tmp_path_factory.mktemp("tenant-header-pd"), url) as server:
        yield server


def _engine_app(role: str, seen: list[tuple[str, dict[str, Any]]]) -> Any:
    """What the middleware hands on, recorded; answers as a completion, the prefill with a receipt."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        doc = json.loads(await read_body(receive))
        seen.append((role, doc))
        answer = {"choices": [{"index": 0, "text": role}],
                  "kv_transfer_params": {"kvgate_receipt": {"store": "s-1"}} if role == "prefill" else None}
        out = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})

    return app


async def test_the_tenant_header_reaches_both_legs_only_from_the_proxys_trusted_gateway(live, tmp_path):
    victim, attacker = f"v-{secrets.token_hex(3)}", f"a-{secrets.token_hex(3)}"
    async with live.client() as http:
        for t in (victim, attacker):
            await live.create_tenant(http, t)
    seen: list[tuple[str, dict[str, Any]]] = []
    env = _env(live, tmp_path / "engines")
    with ExitStack() as stack:
        pre = stack.enter_context(serve(KvgateMiddleware(_engine_app("prefill", seen), env=env)))
        dec = stack.enter_context(serve(KvgateMiddleware(_engine_app("decode", seen), env=env)))
        writer = AuditWriter(live.settings.db_url, spool_dir=tmp_path / "proxy-spool")
        proxy = stack.enter_context(serve(create_pd_proxy(
            [f"unix:{pre.uds}"], [f"unix:{dec.uds}"], tenant_header="x-tenant-id",
            namespace_header="x-kvgate-namespace", trusted_peers=TrustedPeers.parse("unix"), audit=writer,
        ), lifespan="on"))
        request = {"prompt": "the victim's prompt", "max_tokens": 4,
                   "kv_transfer_params": {"kvgate_capability": "forged", "kvgate_receipt": {"store": "client"}}}

        # the attacker on the proxy's TCP port names the victim: refused at the proxy, no engine sees it
        async with proxy.client(over_socket=False) as c:
            r = await c.post("/v1/completions", json=request, headers={"x-tenant-id": victim, **_bearer(live.worker_token(attacker))})
            _refused(r)
            assert seen == []
            # its own token, without the header, is passed on to both legs: served as itself
            r = await c.post("/v1/completions", json=request, headers=_bearer(live.worker_token(attacker)))
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode", r.text
        assert [role for role, _ in seen] == ["prefill", "decode"]
        assert {read_unverified(doc["kv_transfer_params"]["kvgate_capability"]).tenant for _, doc in seen} == {attacker}
        seen.clear()

        # the authenticating gateway on the proxy's socket names the victim: both legs as the victim
        async with proxy.client(over_socket=True) as c:
            r = await c.post("/v1/completions", json=request, headers={"x-tenant-id": victim})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decode", r.text
        (_, first), (_, second) = seen
        assert first["max_tokens"] == 1 and first["stream"] is False
        assert second["max_tokens"] == 4
        for doc in (first, second):
            cap = read_unverified(doc["kv_transfer_params"]["kvgate_capability"])
            assert cap.tenant == victim  # minted by each engine for the header's tenant, not the client's "forged"
        assert "kvgate_receipt" not in first["kv_transfer_params"]  # the client's receipt went nowhere
        assert second["kv_transfer_params"]["kvgate_receipt"] == {"store": "s-1"}  # the prefill's did
        assert first["cache_salt"] == second["cache_salt"]
    rows = [row for row in await live_rows(live, "authz.denied") if row["details"].get("claimed_tenant") == victim]
    assert [(row["details"]["at"], row["details"]["reason"]) for row in rows] == [("pd-proxy", "tenant header from an untrusted peer")]


async def test_an_engine_refusal_on_the_prefill_leg_is_the_answer(live, tmp_path):
    seen: list[tuple[str, dict[str, Any]]] = []
    env = _env(live, tmp_path / "engines")
    with ExitStack() as stack:
        pre = stack.enter_context(serve(KvgateMiddleware(_engine_app("prefill", seen), env=env)))
        dec = stack.enter_context(serve(KvgateMiddleware(_engine_app("decode", seen), env=env)))
        proxy = stack.enter_context(serve(create_pd_proxy([f"unix:{pre.uds}"], [f"unix:{dec.uds}"])))
        async with proxy.client(over_socket=False) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})  # no token
            assert r.status_code == 401 and r.headers["content-type"] == "application/problem+json", r.text
            r = await c.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer not-a-token"})
            assert r.status_code == 401
    assert seen == []  # neither leg's app ran
