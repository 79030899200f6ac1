"""The tenant and namespace headers of an authenticating gateway in front of the engine, over a
real uvicorn server listening on a TCP port and a Unix socket at once (the middleware in front of
an ASGI app that echoes the body it was given), a live kvgate server on Postgres that mints the
capabilities and its development issuer's tokens.

As the attacker would run it: a tenant header from an untrusted peer (with another tenant's valid
token, or with none) is a 403 problem that reaches nothing and leaves an ``authz.denied`` row in
the audit log naming the peer and the tenant it claimed, beside the trusted gateway's request on
the Unix socket (or from an allowlisted address) that is served as that tenant. A namespace header
is served only for a namespace the caller holds."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from gateway.vllm.config import MiddlewareSettings
from gateway.vllm.errors import ConnectorConfigError
from gateway.vllm.guard import GuardConfig
from gateway.vllm.middleware import KvgateMiddleware
from gateway.vllm.salt import cache_salt
from tenancy.capabilities import read_unverified
from tests.support.asgi import echo_body
from tests.support.audit_events import live_rows
from tests.support.server_fixture import LiveServer, running_server, scratch_pg_database

SECRET_HEX = bytes(range(32)).hex()
SECRET = bytes(range(32))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with scratch_pg_database() as url, running_server(tmp_path_factory.mktemp("tenant-header"), url) as server:
        yield server


@pytest.fixture
async def tenants(live: LiveServer) -> tuple[str, str]:
    victim, attacker = f"v-{secrets.token_hex(3)}", f"a-{secrets.token_hex(3)}"
    async with live.client() as http:
        for t in (victim, attacker):
            await live.create_tenant(http, t)
    return victim, attacker


def _env(live: LiveServer, spool: Path, **over: str) -> dict[str, str]:
    env = {
        "KVGATE_VLLM_ISSUER": live.base_url + "/dev-issuer", "KVGATE_VLLM_GATEWAY_URL": live.base_url,
        "KVGATE_VLLM_SALT_SECRET": SECRET_HEX, "KVGATE_VLLM_TENANT_HEADER": "X-Tenant-Id",
        "KVGATE_VLLM_NAMESPACE_HEADER": "x-kvgate-namespace", "KVGATE_VLLM_TRUSTED_PEERS": "unix",
        "KVGATE_VLLM_SERVICE_TOKEN": live.operator_token(),
        "KVGATE_VLLM_AUDIT_DATABASE_URL": live.settings.db_url, "KVGATE_VLLM_AUDIT_SPOOL_DIR": str(spool),
    }
    env.update(over)
    return env


class Engine:
    """The middleware served by uvicorn on 127.0.0.1:port and on a Unix socket, in a thread."""

    def __init__(self, tcp: str, uds: str) -> None:
        self.tcp, self.uds = tcp, uds

    @asynccontextmanager
    async def client(self, over_socket: bool) -> AsyncIterator[httpx.AsyncClient]:
        if over_socket:
            transport = httpx.AsyncHTTPTransport(uds=self.uds)
            async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=30) as c:
                yield c
        else:
            async with httpx.AsyncClient(base_url=self.tcp, timeout=30) as c:
                yield c


@contextmanager
def engine(env: dict[str, str]) -> Iterator[Engine]:
    with serve(KvgateMiddleware(echo_body, env=env)) as eng:
        yield eng


@contextmanager
def serve(app: Any, lifespan: str = "off") -> Iterator[Engine]:
    """``app`` on a TCP port of 127.0.0.1 and a Unix socket, by one uvicorn server in a thread."""
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    workdir = tempfile.mkdtemp(prefix="kvgate-th-")  # short: a socket path is at most 107 bytes
    uds_path = os.path.join(workdir, "engine.sock")
    uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    uds.bind(uds_path)
    for s in (tcp, uds):
        s.listen(64)
        s.set_inheritable(True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    loop = asyncio.new_event_loop()

    async def serve() -> None:
        try:
            await server.serve(sockets=[tcp, uds])
        finally:
            guard = getattr(app, "_guard", None)
            if guard is not None:  # the guard's audit writer and HTTP client live on this loop
                await guard.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the engine's server did not start"
        time.sleep(0.02)
    try:
        yield Engine(f"http://127.0.0.1:{tcp.getsockname()[1]}", uds_path)
    finally:
        server.should_exit = True
        thread.join(30)
        loop.close()
        for s in (tcp, uds):
            s.close()
        os.unlink(uds_path)
        os.rmdir(workdir)


async def _post(c: httpx.AsyncClient, headers: dict[str, str]) -> httpx.Response:
    return await c.post("/v1/completions", json={"prompt": "the victim's prompt", "max_tokens": 1}, headers=headers)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _served_as(r: httpx.Response, tenant: str, namespace: str = "default") -> None:
    """``r`` reached the app as ``tenant``: its capability and cache_salt are that tenant's."""
    assert r.status_code == 200, r.text
    body = json.loads(r.content)
    cap = read_unverified(body["kv_transfer_params"]["kvgate_capability"])
    assert (cap.tenant, cap.namespace) == (tenant, namespace)
    assert body["cache_salt"] == cache_salt(SECRET, tenant, namespace, 0)


def _refused(r: httpx.Response, status: int = 403) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert "prompt" not in r.text  # nothing reached the app


async def _denials(live: LiveServer, tenant: str) -> list[dict[str, object]]:
    return [row for row in await live_rows(live, "authz.denied") if row["details"].get("claimed_tenant") == tenant]


async def test_spoofed_tenant_header_over_tcp_is_refused_and_audited_beside_the_trusted_socket(live, tenants, tmp_path):
    victim, attacker = tenants
    with engine(_env(live, tmp_path)) as eng:
        async with eng.client(over_socket=False) as c:
            # the attacker, with its own valid token, names the victim's tenant
            r = await _post(c, {"X-Tenant-Id": victim, **_bearer(live.worker_token(attacker))})
            _refused(r)
            # and with no token at all
            _refused(await _post(c, {"x-tenant-id": victim}))
            # without the header the same token is served, as its own tenant only
            _served_as(await _post(c, _bearer(live.worker_token(attacker))), attacker)
        async with eng.client(over_socket=True) as c:
            # the trusted gateway on the Unix socket names the tenant it authenticated
            _served_as(await _post(c, {"x-tenant-id": victim}), victim)
            # a token beside the header must be the same tenant's
            _refused(await _post(c, {"x-tenant-id": victim, **_bearer(live.worker_token(attacker))}))
            _served_as(await _post(c, {"x-tenant-id": victim, **_bearer(live.worker_token(victim))}), victim)
    rows = await _denials(live, victim)
    reasons = sorted(str(row["details"]["reason"]) for row in rows)
    assert reasons == ["tenant header and token name different tenants",
                       "tenant header from an untrusted peer", "tenant header from an untrusted peer"]
    assert all(row["outcome"] == "denied" and row["tenant"] == victim for row in rows)


async def test_spoof_rows_name_the_peer_and_the_caller(live, tenants, tmp_path):
    victim, attacker = tenants
    with engine(_env(live, tmp_path)) as eng:
        async with eng.client(over_socket=False) as c:
            _refused(await _post(c, {"x-tenant-id": victim, **_bearer(live.worker_token(attacker))}))
    from audit.db import create_audit_engine
    from audit.store import AuditStore

    db = create_audit_engine(live.settings.db_url)
    try:
        events = [rec.event async for rec in AuditStore(db).iter_records()
                  if rec.event.action == "authz.denied" and rec.event.target.tenant == victim]
    finally:
        await db.dispose()
    assert len(events) == 1
    assert events[0].actor.source == "tcp:127.0.0.1" and events[0].actor.tenant == attacker


async def test_an_address_allowlist_trusts_only_its_networks(live, tenants, tmp_path):
    victim, _ = tenants
    with engine(_env(live, tmp_path, KVGATE_VLLM_TRUSTED_PEERS="127.0.0.1/32")) as eng:
        async with eng.client(over_socket=False) as c:
            _served_as(await _post(c, {"x-tenant-id": victim}), victim)
        async with eng.client(over_socket=True) as c:  # the socket is not on the list
            _refused(await _post(c, {"x-tenant-id": victim}))
    with engine(_env(live, tmp_path, KVGATE_VLLM_TRUSTED_PEERS="10.0.0.0/8, ::1/128")) as eng:
        async with eng.client(over_socket=False) as c:
            _refused(await _post(c, {"x-tenant-id": victim}))
    assert len(await _denials(live, victim)) == 2


async def test_an_x_forwarded_for_naming_a_trusted_address_is_refused_and_audited(live, tenants, tmp_path):
    """uvicorn's proxy headers (on by default for loopback peers, as in vLLM's server) put
    X-Forwarded-For's address into the request's client: a local attacker naming the trusted
    gateway's address there is refused, beside the gateway itself, which is served."""
    victim, attacker = tenants
    with engine(_env(live, tmp_path, KVGATE_VLLM_TRUSTED_PEERS="unix, 10.9.9.9/32, 127.0.0.1/32")) as eng:
        async with eng.client(over_socket=False) as c:
            for spoof in ("10.9.9.9", "127.0.0.1"):  # with no token (the service token would mint) and with its own
                for token in ({}, _bearer(live.worker_token(attacker))):
                    r = await _post(c, {"x-tenant-id": victim, "X-Forwarded-For": spoof, **token})
                    _refused(r)
                    assert "X-Forwarded-For" in r.text
            _served_as(await _post(c, {"x-tenant-id": victim}), victim)  # the loopback peer, with no such header
        async with eng.client(over_socket=True) as c:  # the gateway on the Unix socket, with its header
            _served_as(await _post(c, {"x-tenant-id": victim, "X-Forwarded-For": "203.0.113.9"}), victim)
    rows = await _denials(live, victim)
    assert [row["details"]["reason"] for row in rows] == ["tenant header beside X-Forwarded-For on TCP"] * 4
    assert all(row["outcome"] == "denied" for row in rows)


async def test_a_socket_path_allowlist_names_one_socket(live, tenants, tmp_path):
    victim, _ = tenants
    with engine(_env(live, tmp_path, KVGATE_VLLM_TRUSTED_PEERS="unix:/run/elsewhere.sock")) as eng:
        async with eng.client(over_socket=True) as c:
            _refused(await _post(c, {"x-tenant-id": victim}))
    env = _env(live, tmp_path)
    with engine(env) as eng:
        env["KVGATE_VLLM_TRUSTED_PEERS"] = f"unix:{eng.uds}"  # read at the first request
        async with eng.client(over_socket=True) as c:
            _served_as(await _post(c, {"x-tenant-id": victim}), victim)


async def test_the_namespace_header_serves_only_namespaces_the_caller_holds(live, tenants, tmp_path):
    victim, attacker = tenants
    granted = live.token(attacker, ("kv.worker", "kv.namespace:chat"))
    with engine(_env(live, tmp_path, KVGATE_VLLM_TRUSTED_NAMESPACES="chat")) as eng:
        async with eng.client(over_socket=False) as c:
            _served_as(await _post(c, {"x-kvgate-namespace": "chat", **_bearer(granted)}), attacker, "chat")
            _refused(await _post(c, {"x-kvgate-namespace": "billing", **_bearer(granted)}))
            _refused(await _post(c, {"x-kvgate-namespace": "chat", **_bearer(live.worker_token(attacker))}))
            # the configured namespace is always held
            _served_as(await _post(c, {"x-kvgate-namespace": "default", **_bearer(live.worker_token(attacker))}), attacker)
            _refused(await _post(c, {"x-kvgate-namespace": "Bad Name", **_bearer(granted)}))
        async with eng.client(over_socket=True) as c:
            _served_as(await _post(c, {"x-tenant-id": victim, "x-kvgate-namespace": "chat"}), victim, "chat")
            _refused(await _post(c, {"x-tenant-id": victim, "x-kvgate-namespace": "billing"}))
    rows = [row for row in await live_rows(live, "authz.denied") if row["details"].get("reason") == "namespace not granted"]
    # billing, chat and the bad name for the attacker's tokens, billing for the header's tenant
    assert sorted(str(row["tenant"]) for row in rows if row["tenant"] in (victim, attacker)) == sorted([attacker] * 3 + [victim])
    assert len([row for row in rows if row["details"]["claimed_namespace"] == "Bad Name"]) == 1


async def test_an_unknown_tenant_from_the_trusted_gateway_gets_no_capability(live, tmp_path):
    with engine(_env(live, tmp_path)) as eng:
        async with eng.client(over_socket=True) as c:
            _refused(await _post(c, {"x-tenant-id": f"nobody-{secrets.token_hex(3)}"}))
            _refused(await _post(c, {"x-tenant-id": "Not A Name"}), 400)


def test_header_settings_are_refused_without_their_peers_audit_or_service_token(tmp_path):
    base = {"KVGATE_VLLM_ISSUER": "http://127.0.0.1:1/i", "KVGATE_VLLM_SALT_SECRET": SECRET_HEX,
            "KVGATE_VLLM_GATEWAY_URL": "http://127.0.0.1:1"}
    audit = {"KVGATE_VLLM_AUDIT_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/a.db"}
    with pytest.raises(ConnectorConfigError, match="KVGATE_VLLM_TRUSTED_PEERS"):
        MiddlewareSettings.from_env({**base, **audit, "KVGATE_VLLM_TENANT_HEADER": "x-tenant-id"})
    with pytest.raises(ConnectorConfigError, match="KVGATE_VLLM_AUDIT_DATABASE_URL"):
        MiddlewareSettings.from_env({**base, "KVGATE_VLLM_TENANT_HEADER": "x-tenant-id", "KVGATE_VLLM_TRUSTED_PEERS": "unix"})
    with pytest.raises(ConnectorConfigError, match="CIDR"):
        GuardConfig.from_env({**base, **audit, "KVGATE_VLLM_TENANT_HEADER": "x-tenant-id", "KVGATE_VLLM_TRUSTED_PEERS": "10.0.0.1/8"})
    with pytest.raises(ConnectorConfigError, match="KVGATE_VLLM_TENANT_HEADER"):
        MiddlewareSettings.from_env({**base, **audit, "KVGATE_VLLM_TENANT_HEADER": "x tenant"})
    cfg = GuardConfig.from_env({**base, **audit, "KVGATE_VLLM_TENANT_HEADER": "X-Tenant-Id", "KVGATE_VLLM_TRUSTED_PEERS": "unix"})
    assert cfg.tenant_header == "x-tenant-id" and "audit_database_url" not in repr(cfg)
    from gateway.vllm.guard import TenantGuard

    with pytest.raises(ConnectorConfigError, match="KVGATE_VLLM_SERVICE_TOKEN"):
        TenantGuard(cfg)


def test_trusted_peers_read_the_connection_only():
    from gateway.vllm.peers import Peer, TrustedPeers, peer_of

    trusted = TrustedPeers.parse("10.0.0.0/8, unix:/run/gw.sock, fd00::/8")
    assert trusted.trusts(Peer("tcp", "10.1.2.3")) and trusted.trusts(Peer("tcp", "::ffff:10.1.2.3"))
    assert trusted.trusts(Peer("tcp", "fd00::1")) and trusted.trusts(Peer("unix", "/run/gw.sock"))
    assert not trusted.trusts(Peer("tcp", "11.0.0.1")) and not trusted.trusts(Peer("unix", "/run/other.sock"))
    assert not trusted.trusts(Peer("unknown", "")) and not trusted.trusts(Peer("tcp", "not-an-address"))
    # a forwarding header is the client's word: the peer is the connection's
    scope = {"client": ("203.0.113.9", 5555), "headers": [(b"forwarded", b"for=10.1.2.3")]}
    assert peer_of(scope) == Peer("tcp", "203.0.113.9") and not trusted.trusts(peer_of(scope))
    # uvicorn may already have put X-Forwarded-For's word into "client": never trusted then
    scope = {"client": ("10.1.2.3", 5555), "headers": [(b"X-Forwarded-For", b"10.1.2.3")]}
    assert peer_of(scope) == Peer("forwarded", "10.1.2.3") and not trusted.trusts(peer_of(scope))
    assert peer_of({"client": None, "server": ("/run/gw.sock", None)}) == Peer("unix", "/run/gw.sock")
    assert not TrustedPeers.parse("") and not TrustedPeers.parse(None)
