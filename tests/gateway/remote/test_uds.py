"""Remote mode through the server's Unix socket (``kvgate serve --uds``, ``RemoteGateway(uds=)``).

The server is the real CLI in its own process. The workers' base URL names a host nothing
listens on, so every call of theirs that works went through the socket. Tenant isolation and
authentication are checked there as an attacker on the same host would try them, each beside
its positive control."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from gateway.errors import InvalidRequest
from gateway.protocol.sockets import SOCKET_BUFFER_BYTES, tune_unix_socket
from gateway.remote.client import RemoteGateway
from gateway.server.listen import unix_listener
from tests.support import uds_server
from tests.support.gw import gathered, model_for, random_cache, small_geometry, zero_cache
from tests.support.uds_server import BLOCKS, NOWHERE, NUM_BLOCKS, N, Served, create_tenant, serve, stop, wait_up

served = uds_server.served  # a fixture, registered in this module


def _worker(s: Served, tenant: str) -> RemoteGateway:
    return RemoteGateway(NOWHERE, s.issuer.mint(tenant, ["kv.worker"]), chunk_tokens=16, uds=str(s.path))


async def test_remote_mode_through_the_socket_keeps_tenants_apart(served: Served) -> None:
    with served.http() as http:
        a, b = create_tenant(served, http, "acme"), create_tenant(served, http, "globex")
    g = small_geometry()
    model = model_for(g)
    src = random_cache(g, NUM_BLOCKS, seed=1)
    tokens = list(range(500, 500 + N))
    async with _worker(served, a) as wa, _worker(served, b) as wb:
        stored = await wa.store(model, tokens, src, block_ids=BLOCKS)
        assert (stored.chunks, stored.stored) == (4, 4)
        # the positive control: the same tenant hits and loads every byte back
        assert (await wa.lookup(model, tokens)).hit_tokens == N
        dst = zero_cache(g, NUM_BLOCKS)
        got = await wa.retrieve(model, tokens, dst, block_ids=BLOCKS)
        assert got.loaded_tokens == N and got.integrity_failures == 0
        assert torch.equal(gathered(src, g, BLOCKS, N), gathered(dst, g, BLOCKS, N))
        # the other tenant, on the same socket, with the same tokens: nothing
        assert (await wb.lookup(model, tokens)).hit_tokens == 0
        dst_b = zero_cache(g, NUM_BLOCKS)
        assert (await wb.retrieve(model, tokens, dst_b, block_ids=BLOCKS)).loaded_tokens == 0
        assert all(not t.any() for t in dst_b)
        # the data plane (gateway.remote.wire) went through the socket too, not only the control calls
        assert any(r.startswith("PUT /v1/chunks") for r in wa._wire.requests)
        assert any(r.startswith("POST /v1/chunks/fetch") for r in wa._wire.requests)


def test_the_socket_asks_for_tokens_as_the_port_does(served: Served) -> None:
    lookup = {"hashes": ["ab" * 32], "chunk_tokens": 16}
    with served.http() as http:
        tenant = create_tenant(served, http, "acme")
        user = served.bearer(tenant, ["kv.worker", "kv.admin"])
        assert http.post("/v1/lookup", json=lookup).status_code == 401  # no token
        forged = {"Authorization": user["Authorization"][:-3] + "AAA"}
        assert http.post("/v1/lookup", json=lookup, headers=forged).status_code == 401
        assert http.post("/v1/lookup", json=lookup, headers=user).status_code == 403  # no capability
        assert http.post("/v1/admin/tenants", json={"tenant": "x"}, headers=user).status_code == 403
        r = http.post("/v1/capabilities", json={"namespace": "default", "ops": ["lookup"]}, headers=user)
        assert r.status_code == 201, r.text
        ok = http.post("/v1/lookup", json=lookup, headers={**user, "X-KV-Capability": r.json()["capability"]})
        assert ok.status_code == 200 and ok.json()["hit_chunks"] == 0  # the control: the same call, let in


def _audit_rows(s: Served, http: httpx.Client, action: str, want: int) -> list[dict]:
    """The audit rows of ``action`` (the operator's export: nothing pseudonymized), once at least
    ``want`` of them are there."""
    headers = s.bearer("platform", ["kv.operator"])
    deadline = time.monotonic() + 20
    while True:
        r = http.get("/v1/admin/audit/export", params={"until": "2999-01-01T00:00:00+00:00"}, headers=headers)
        assert r.status_code == 200, r.text
        rows = [row for row in map(json.loads, r.text.splitlines()) if row.get("action") == action]
        if len(rows) >= want or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


_CHILD = """
import httpx, os, sys
print(os.getpid())
with httpx.Client(base_url="http://kvgate.invalid", transport=httpx.HTTPTransport(uds=sys.argv[1])) as h:
    print(h.post("/v1/lookup", json={"hashes": [], "chunk_tokens": 16}, headers={"Authorization": sys.argv[2]}).status_code)
"""


def child_pid(done: subprocess.CompletedProcess[str]) -> int:
    return int(done.stdout.split()[0])


def child_status(done: subprocess.CompletedProcess[str]) -> str:
    return done.stdout.split()[-1]


def test_audit_rows_name_the_socket_peer_and_failures_count_per_user(served: Served) -> None:
    me = f"unix:uid={os.getuid()}:pid={os.getpid()}"
    with served.http() as http, httpx.Client(base_url=served.url, timeout=10.0) as tcp:
        tenant = create_tenant(served, http, "acme")
        admin = served.bearer(tenant, ["kv.admin"])
        assert http.post(f"/v1/admin/tenants/{tenant}/keys/rotate", headers=admin).status_code == 200
        assert tcp.post(f"/v1/admin/tenants/{tenant}/keys/rotate", headers=admin).status_code == 200  # the control
        sources = [row["actor"]["source"] for row in _audit_rows(served, http, "key.rotate", 2)]
        # the socket's row names this process by the kernel's record of the peer; TCP's, the address
        assert sorted(sources) == sorted([me, "127.0.0.1"])
        # another process of the same user: its own pid in the row of its failed attempt
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(served.path), "Bearer forged"], capture_output=True, text=True, timeout=60
        )
        assert child_status(child) == "401", child.stderr
        failed = [row["actor"]["source"] for row in _audit_rows(served, http, "authn.failed", 1)]
        assert failed == [f"unix:uid={os.getuid()}:pid={child_pid(child)}"]
        # failures count per uid on the socket: a fresh process gets no fresh bucket
        for _ in range(40):
            if http.post("/v1/lookup", json={"hashes": []}, headers={"Authorization": "Bearer forged"}).status_code == 429:
                break
        else:
            raise AssertionError("the socket's failures were never limited")
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(served.path), "Bearer forged"], capture_output=True, text=True, timeout=60
        )
        assert child_status(child) == "429", child.stderr
        # the control: another address's bucket is its own, and a valid token is served on the socket
        assert tcp.post("/v1/lookup", json={"hashes": []}, headers={"Authorization": "Bearer forged"}).status_code == 401
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(served.path), admin["Authorization"]], capture_output=True, text=True, timeout=60
        )
        assert child_status(child) in ("403", "200"), child.stdout + child.stderr  # authenticated: past the limit


def test_socket_file_mode_and_removal_on_exit(served: Served) -> None:
    st = served.path.lstat()
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
    with httpx.Client(timeout=5.0) as tcp:  # the TCP port serves as before, beside the socket
        assert tcp.get(served.url + "/healthz").status_code == 200
    assert stop(served.proc) == 0
    assert not served.path.exists()


def test_a_second_server_on_a_live_socket_is_refused(served: Served, tmp_path: Path) -> None:
    proc, _url, log = serve(tmp_path, served.path, name="second")
    assert proc.wait(60) != 0
    assert "another server listens on" in log.read_text()
    wait_up(served.path, served.proc, served.log)  # the first one still answers there


def test_listener_replaces_only_a_stale_socket(tmp_path: Path) -> None:
    path = tmp_path / "s.sock"
    # a regular file is not replaced
    path.write_text("keep me")
    with pytest.raises(InvalidRequest, match="not a socket"):
        unix_listener(path)
    assert path.read_text() == "keep me"
    path.unlink()
    # a socket nobody accepts on any more (a server that died) is replaced
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(path))
    dead.close()
    live = unix_listener(path, 0o600)
    try:
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
        # one that is accepting is refused, and left to its server
        with pytest.raises(InvalidRequest, match="another server"):
            unix_listener(path)
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))
    finally:
        live.close()
    assert not path.exists()
    # a server shutting down (no longer accepting) replaced by a new one: its close leaves the
    # new server's socket in place
    old = unix_listener(path)
    old.sock.close()  # stops accepting, as a server draining its last requests does
    time.sleep(0.05)  # a server is replaced long after it started: the new file's change time differs
    new = unix_listener(path)
    try:
        old.close()
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(path))  # the new one still answers there
    finally:
        new.close()
    assert not path.exists()
    with pytest.raises(InvalidRequest, match="longer than"):
        unix_listener(tmp_path / ("x" * 120))
    with pytest.raises(InvalidRequest, match="does not exist"):
        unix_listener(tmp_path / "no" / "s.sock")


def test_unix_sockets_get_large_buffers_and_tcp_is_untouched() -> None:
    cap = min(int(Path(f"/proc/sys/net/core/{k}_max").read_text()) for k in ("wmem", "rmem"))
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        untuned = {opt: b.getsockopt(socket.SOL_SOCKET, opt) for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF)}
        if cap * 2 <= max(untuned.values()):
            pytest.skip(f"the kernel caps socket buffers at {cap} bytes: no larger size can be asked for")
        before = tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        tune_unix_socket(a)
        tune_unix_socket(tcp)
        tune_unix_socket(None)
        for opt, size in untuned.items():
            # Linux reports twice what was set (its bookkeeping), capped by *mem_max
            got = a.getsockopt(socket.SOL_SOCKET, opt)
            assert got > size and got >= 2 * min(SOCKET_BUFFER_BYTES, cap)
        assert tcp.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == before
    finally:
        a.close()
        b.close()
        tcp.close()


def test_the_socket_settings_are_validated(monkeypatch, tmp_path) -> None:
    from pydantic import ValidationError

    from gateway.config import Settings
    from gateway.vllm.config import ConnectorConfig
    from gateway.vllm.errors import ConnectorConfigError

    for text in ("660", "0660", "0o660"):  # octal, as chmod takes it
        monkeypatch.setenv("KVGATE_UDS_MODE", text)
        assert Settings(state_dir=tmp_path).uds_mode == 0o660
    monkeypatch.setenv("KVGATE_UDS_MODE", "600")
    assert Settings(state_dir=tmp_path).uds_mode == 0o600
    for bad, why in (("9", "octal"), ("440", "read and write"), ("666", "o\\+w"), ("1777", "between")):
        monkeypatch.setenv("KVGATE_UDS_MODE", bad)
        with pytest.raises(ValidationError, match=why):
            Settings(state_dir=tmp_path)
    monkeypatch.delenv("KVGATE_UDS_MODE")
    assert Settings(state_dir=tmp_path).uds_mode == 0o660
    with pytest.raises(ConnectorConfigError, match="remote_uds"):
        ConnectorConfig.from_extra({"mode": "remote", "remote_uds": ""})
    with pytest.raises(InvalidRequest, match="uds"):
        RemoteGateway(NOWHERE, "token", uds="")
    # shared memory is for a server on this host: only with the socket
    from gateway.vllm.backend import RemoteBackend

    with pytest.raises(InvalidRequest, match="needs uds"):
        RemoteGateway(NOWHERE, "token", shm_bytes=1 << 20)
    with pytest.raises(ConnectorConfigError, match="remote_uds"):
        RemoteBackend(NOWHERE, "token", 16, shm_bytes=1 << 20)
    assert ConnectorConfig.from_extra({"mode": "remote", "remote_uds": "/run/k.sock", "remote_shm_mb": 512}).remote_shm_mb == 512
    with pytest.raises(ConnectorConfigError, match="remote_shm_mb"):
        ConnectorConfig.from_extra({"mode": "remote", "remote_shm_mb": -1})

