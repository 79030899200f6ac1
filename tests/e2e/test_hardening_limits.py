"""Issue 15, point 3: authentication before work, bounded everything -- run from raw sockets the
way an attacker runs it, each refusal beside a positive control.

The server is a live uvicorn server with the protocol and limits ``kvgate serve`` uses
(``gateway.server.gatekeeper.uvicorn_options``), with short timeouts so the test is quick."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from gateway.protocol import frames
from tests.support import chunks
from tests.support.server_fixture import (
    LiveServer,
    assert_problem,
    fake_envelope,
    random_hash,
    running_server,
)

HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(
        tmp_path_factory.mktemp("limits"), header_timeout_s=HEADER_TIMEOUT, body_timeout_s=BODY_TIMEOUT,
        max_chunk_bytes=64 << 20,
    ) as server:
        yield server


def _port(live: LiveServer) -> int:
    return int(live.base_url.rsplit(":", 1)[1])


def _connect(live: LiveServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(("127.0.0.1", _port(live)), timeout=timeout)


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status_within(sock: socket.socket, seconds: float) -> tuple[int | None, bytes]:
    """The status code of the first response on ``sock`` if it arrives within ``seconds``."""
    sock.settimeout(seconds)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
    except TimeoutError:
        return None, data
    except ConnectionResetError:
        pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, data
    return int(data[9:12]), data


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return False


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


async def _tenant(live: LiveServer) -> tuple[str, str, str]:
    async with live.client() as http:
        a = await live.create_tenant(http)
        cap = await live.capability(http, a)
    return a, live.worker_token(a), cap


# -- no body is read before the token is verified ------------------------------------------------
def test_unauthenticated_body_is_refused_before_it_is_sent(live: LiveServer):
    """16 MB of invalid JSON without a token: 401 on the headers alone (it used to wait for the
    body, parse it and answer 422)."""
    with _connect(live) as s:
        s.sendall(_head("POST", "/v1/admin/clear", {"Content-Type": "application/json", "Content-Length": str(16 << 20)}))
        status, _ = _status_within(s, 3.0)
        assert status == 401
    # positive control: the same route with a token and a body is served
    with _connect(live) as s:
        body = b"[[[["
        tok = live.admin_token("nobody")
        s.sendall(_head("POST", "/v1/admin/clear", {"Authorization": f"Bearer {tok}", "Content-Type": "application/json", "Content-Length": str(len(body))}) + body)
        status, _ = _status_within(s, 5.0)
        assert status == 422  # parsed (and refused) only once authenticated


def test_three_unauthenticated_57mb_bodies_leave_rss_bounded(live: LiveServer):
    """The issue's measurement, in process: three concurrent 57 MB bodies, no token."""
    size = 57 << 20
    block = b"[" * (1 << 20)
    statuses: list[int | None] = [None] * 3
    base = _rss_mib()
    peak = [base]

    def client(i: int) -> None:
        with _connect(live, timeout=30) as s:
            s.sendall(_head("POST", "/v1/capabilities", {"Content-Type": "application/json", "Content-Length": str(size)}))
            sent = 0
            try:
                while sent < size:
                    s.sendall(block)
                    sent += len(block)
            except OSError:
                pass
            statuses[i] = _status_within(s, 15.0)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        peak[0] = max(peak[0], _rss_mib())
        time.sleep(0.01)
    assert statuses == [401, 401, 401]
    assert peak[0] - base < 64, f"RSS grew by {peak[0] - base} MiB under 3 x 57 MB unauthenticated bodies"


async def test_json_bodies_have_a_small_limit_per_route(live: LiveServer):
    a, tok, cap = await _tenant(live)
    with _connect(live) as s:  # 1 MB for a route that takes a few hundred bytes: refused on the headers
        s.sendall(_head("POST", "/v1/capabilities", {"Authorization": f"Bearer {tok}", "Content-Type": "application/json", "Content-Length": str(1 << 20)}))
        status, _ = _status_within(s, 3.0)
        assert status == 413
    async with live.client() as http:  # a chunked body over the limit, counted as it arrives
        async def gen():
            yield b'{"namespace": "default", "ops": ["get"], "pad": "'
            for _ in range(64):
                yield b"x" * 1024
            yield b'"}'

        r = await http.post("/v1/capabilities", content=gen(), headers={**live.headers(tok), "Content-Type": "application/json"})
        assert_problem(r, 413)
        # positive control
        r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=live.headers(tok))
        assert r.status_code == 201


async def test_chunk_put_checks_its_capability_before_the_body(live: LiveServer):
    a, tok, cap = await _tenant(live)
    forged = cap[:-4] + ("AAAA" if not cap.endswith("AAAA") else "BBBB")
    for capability in (forged, "kvc1.k.e30.AAAA"):
        with _connect(live) as s:
            s.sendall(_head("PUT", "/v1/chunks", {
                "Authorization": f"Bearer {tok}", "X-KV-Capability": capability,
                "Content-Type": chunks.BATCH, "Content-Length": str(60 << 20),
            }))
            status, _ = _status_within(s, 3.0)  # not one body byte sent
            assert status == 403
    # positive control: the real capability, a real envelope
    async with live.client() as http:
        r = await chunks.store(http, live.headers(tok, cap), [(random_hash(), fake_envelope())])
        assert r.status_code == 204


async def test_content_length_larger_than_the_body_times_out(live: LiveServer):
    a, tok, cap = await _tenant(live)
    env = fake_envelope(1000)
    # an upload frame whose index and Content-Length both count 500 envelope bytes never sent
    upload = frames.encode_index([(bytes.fromhex(random_hash()), len(env) + 500)]) + env
    for path, ctype, body, headers in (
        ("/v1/chunks", chunks.BATCH, upload, {"X-KV-Capability": cap}),
        ("/v1/capabilities", "application/json", b'{"namespace": "default", "ops": ["get"]}', {}),
    ):
        with _connect(live) as s:
            t0 = time.monotonic()
            s.sendall(_head("POST" if path.startswith("/v1/cap") else "PUT", path, {
                "Authorization": f"Bearer {tok}", "Content-Type": ctype, "Content-Length": str(len(body) + 500), **headers,
            }) + body)
            status, _ = _status_within(s, BODY_TIMEOUT + 4)
            assert status == 408, path
            assert time.monotonic() - t0 < BODY_TIMEOUT + 3
            assert _closed_within(s, 2.0)
    # positive control: the honest Content-Length
    async with live.client() as http:
        r = await chunks.store(http, live.headers(tok, cap), [(random_hash(), env)])
        assert r.status_code == 204


async def test_a_batched_upload_that_stops_inside_an_envelope_times_out_and_stores_nothing(live: LiveServer):
    """``PUT /v1/chunks`` reads its envelopes from the socket straight into the tier's buffers
    (``gateway.server.rawbody``), outside the ASGI body path and its per-read timeout: a client
    that sends the index and part of an envelope, then nothing, still gets a 408 within the body
    timeout, its connection is closed, and no chunk and no reservation is left. Control: the same
    frame sent whole is stored."""
    a, tok, cap = await _tenant(live)
    h, env = random_hash(), fake_envelope(300_000)
    body = frames.encode_index([(bytes.fromhex(h), len(env))]) + env
    head = _head("PUT", "/v1/chunks", {
        "Authorization": f"Bearer {tok}", "X-KV-Capability": cap, "Content-Type": "application/octet-stream",
        "Content-Length": str(len(body)),
    })
    memory = live.runtime.tiers.tiers[0]
    with _connect(live) as s:
        t0 = time.monotonic()
        s.sendall(head + body[: len(body) // 2])
        status, _ = _status_within(s, BODY_TIMEOUT + 4)
        assert status == 408
        assert time.monotonic() - t0 < BODY_TIMEOUT + 3
        assert _closed_within(s, 2.0)
    async with live.client() as http:
        hdr = live.headers(tok, cap)
        assert await chunks.stored(http, hdr, [h]) == [False]
        assert memory.stats().reservations == 0
        with _connect(live) as s:  # control: the whole frame
            s.sendall(head + body)
            status, _ = _status_within(s, 10)
            assert status == 204
        assert await chunks.stored(http, hdr, [h]) == [True]


# -- headers ---------------------------------------------------------------------------------------
def test_header_block_size_is_bounded(live: LiveServer):
    with _connect(live) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            for _ in range(64):  # up to 64 MB of one header line
                s.sendall(b"a" * (1 << 20))
                sent += 1
        except OSError:
            pass
        assert sent < 64, "a 64 MB header line was read to the end"
        status, _ = _status_within(s, 3.0)
        assert status in (None, 400, 431)
    with _connect(live) as s:  # positive control: an 8 KB header is fine
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 8192 + b"\r\n\r\n")
        assert _status_within(s, 3.0)[0] == 200


def test_header_count_is_bounded(live: LiveServer):
    many = {f"X-H{i}": "1" for i in range(200)}
    with _connect(live) as s:
        s.sendall(_head("GET", "/healthz", many))
        assert _status_within(s, 3.0)[0] == 431
    with _connect(live) as s:  # positive control
        s.sendall(_head("GET", "/healthz", {f"X-H{i}": "1" for i in range(20)}))
        assert _status_within(s, 3.0)[0] == 200


def test_slow_header_clients_are_cut(live: LiveServer):
    """100 clients that send half a request head and then one header byte every 0.2 s (so an
    idle timer restarted by each byte never fires): all are cut within the head deadline."""
    socks = [_connect(live) for _ in range(100)]
    try:
        for s in socks:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        open_ = set(range(len(socks)))
        while open_ and time.monotonic() - t0 < HEADER_TIMEOUT + 5:
            for i in list(open_):
                try:
                    socks[i].sendall(b"X")
                except OSError:
                    open_.discard(i)
                    continue
                socks[i].setblocking(False)
                try:
                    if socks[i].recv(4096) == b"":
                        open_.discard(i)
                except BlockingIOError:
                    pass
                except OSError:
                    open_.discard(i)
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        assert not open_, f"{len(open_)} slow-header connections still open after {elapsed:.1f} s"
        assert elapsed < HEADER_TIMEOUT + 3
    finally:
        for s in socks:
            s.close()
    # positive control: a keep-alive client that sends whole requests is served, twice on one connection
    with _connect(live) as s:
        for _ in range(2):
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            status, data = _status_within(s, 3.0)
            assert status == 200
            if b'"ok"' not in data:
                s.recv(4096)


# -- the failure rate limiter cannot be turned against others --------------------------------------
def _unsigned(tenant: str) -> str:
    enc = lambda d: base64.urlsafe_b64encode(json.dumps(d).encode()).rstrip(b"=").decode()
    return f"{enc({'alg': 'RS256', 'typ': 'at+jwt', 'kid': 'x'})}.{enc({'tenant': tenant, 'sub': 'mallory', 'iss': 'x'})}.c2ln"


async def test_forged_tokens_cannot_lock_out_valid_users(live: LiveServer):
    live.set_auth_failure_limit(20)
    try:
        async with live.client() as http:
            a, b = await live.create_tenant(http), await live.create_tenant(http)
            body = {"namespace": "default", "ops": ["get"]}
            # 40 unsigned tokens claiming tenant A, and 40 with made-up tenants, from the same
            # address as the valid users (a NAT, a proxy, this test)
            codes = [
                (await http.post("/v1/capabilities", json=body, headers=live.headers(_unsigned(t)))).status_code
                for t in [a] * 40 + [f"made-up-{i}" for i in range(40)]
            ]
            assert set(codes[:20]) == {401} and set(codes[20:]) == {429}  # the attacker is limited
            for tenant in (a, b):  # ... and A's and B's valid users are not
                r = await http.post("/v1/capabilities", json=body, headers=live.headers(live.worker_token(tenant)))
                assert r.status_code == 201, (tenant, r.status_code, r.text)
    finally:
        live.set_auth_failure_limit(10_000)


# -- capabilities: size and the verify cache are bounded -------------------------------------------
def test_capability_size_and_verify_cache_are_bounded():
    from tenancy.capabilities import CapabilityAuthority, attenuate
    from tenancy.errors import CapabilityDenied

    auth = CapabilityAuthority({"k1": os.urandom(32)}, "k1")
    root = auth.mint("acme", "default", ["get", "lookup"], 600)
    # a holder makes distinct valid capabilities as large as it can
    big = None
    for n in (700, 400, 200, 100, 80, 60, 40):
        try:
            big = attenuate(root, chunks=[os.urandom(32).hex() for _ in range(n)])
            break
        except CapabilityDenied:
            continue
    assert big is not None
    assert len(big) <= 8 * 1024, f"a {len(big)}-character capability was made"
    held = 0
    for i in range(3000):
        chunks = [f"{i:08x}" + os.urandom(28).hex() for _ in range(n)]
        token = attenuate(root, chunks=chunks)
        auth.verify(token, tenant="acme", namespace="default", op="get", chunks=chunks[:1])
    held = sum(len(t) for t in auth._cache)
    assert held <= 8 << 20, f"the verify cache holds {held >> 20} MiB of tokens"
    # positive control: the root capability verifies, and what was cached last still does
    assert auth.verify(root, tenant="acme", namespace="default", op="get").tenant == "acme"
    assert auth.verify(token, tenant="acme", namespace="default", op="get", chunks=chunks[:1]).tenant == "acme"
