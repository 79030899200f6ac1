"""Request limits of a live server, run as a client would run them (httpx, raw sockets): deeply
nested JSON bodies (400, audited), request heads over ``max_header_bytes`` (431, then the
connection closes), ``Transfer-Encoding`` with ``Content-Length`` (400, nothing stored, nothing
after it parsed). Each refusal sits beside a positive control that is served.

The server is a live uvicorn server with the protocol and limits ``kvgate serve`` uses
(``gateway.server.gatekeeper.uvicorn_options``)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from gateway.server.jsonbody import MAX_DEPTH
from tests.support import chunks
from tests.support.server_fixture import LiveServer, assert_problem, fake_envelope, random_hash, running_server

HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running_server(tmp_path_factory.mktemp("request-limits"), header_timeout_s=HEADER_TIMEOUT) as server:
        yield server


def _connect(live: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(live.base_url.rsplit(":", 1)[1])), timeout=10)


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a timeout fails the test)."""
    data = b""
    while part := sock.recv(65536):
        data += part
    return data


def _head(method: str, path: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _tenant(live: LiveServer, http: httpx.AsyncClient) -> tuple[str, str, str]:
    a = await live.create_tenant(http)
    return a, live.worker_token(a), await live.capability(http, a, ops=("lookup", "get", "put", "pin"))


# -- JSON bodies: depth bounded on every route -----------------------------------------------------
DEEP_LIST = b"[" * 5000 + b"]" * 5000
DEEP_OBJECT = b'{"a":' * 3000 + b"1" + b"}" * 3000


async def _denials(live: LiveServer) -> list[dict]:
    await live.call(live.runtime.audit.flush, 10)

    async def rows() -> list[dict]:
        return [
            json.loads(rec.event.details) async for rec in live.runtime.audit.store.iter_records()
            if rec.event.action == "authz.denied" and '"JSON body too deep"' in rec.event.details
        ]

    return await live.call(rows)


async def test_deeply_nested_json_is_refused_and_audited_on_every_route(live: LiveServer):
    async with live.client() as http:
        a, tok, cap = await _tenant(live, http)
        worker = {**live.headers(tok, cap), "Content-Type": "application/json"}
        admin = {**live.headers(live.admin_token(a)), "Content-Type": "application/json"}
        operator = {**live.headers(live.operator_token()), "Content-Type": "application/json"}
        routes = [
            ("/v1/lookup", worker), ("/v1/chunks/fetch", worker), ("/v1/keys/envelopes", worker),
            ("/v1/pins", worker), ("/v1/shm/regions", worker), ("/v1/capabilities", worker),
            ("/v1/admin/clear", admin), ("/v1/admin/move", admin), ("/v1/admin/tenants", operator),
        ]
        before = len(await _denials(live))
        for path, headers in routes:
            r = await http.post(path, content=DEEP_LIST, headers=headers)
            assert f"deeper than {MAX_DEPTH}" in assert_problem(r, 400)["detail"], path
        r = await http.post("/v1/lookup", content=DEEP_OBJECT, headers=worker)  # the route that answered 500
        assert f"deeper than {MAX_DEPTH}" in assert_problem(r, 400)["detail"]
        denials = (await _denials(live))[before:]
        assert sorted(d["route"] for d in denials) == sorted([p for p, _ in routes] + ["/v1/lookup"])

        # positive controls: the same routes with their normal bodies
        h = random_hash()
        assert (await chunks.store(http, live.headers(tok, cap), [(h, fake_envelope())])).status_code == 204
        r = await http.post("/v1/lookup", json={"hashes": [h]}, headers=worker)
        assert r.status_code == 200 and r.json()["hit_chunks"] == 1
        assert (await chunks.post_fetch(http, worker, [h])).status_code == 200
        pin = {**live.headers(live.admin_token(a), cap), "Content-Type": "application/json"}
        assert (await http.post("/v1/pins", json={"hash": h}, headers=pin)).status_code == 204
        r = await http.post("/v1/capabilities", json={"namespace": "default", "ops": ["get"]}, headers=worker)
        assert r.status_code == 201
        assert (await http.post("/v1/admin/tenants", json={"tenant": f"{a}-2"}, headers=operator)).status_code == 201
        # the limit is where it is documented: at MAX_DEPTH the body is parsed (and refused by the
        # schema, 422), one level deeper it is not parsed at all (400)
        for depth, status in ((MAX_DEPTH, 422), (MAX_DEPTH + 1, 400)):
            inner = "[" * (depth - 1) + "]" * (depth - 1)
            r = await http.post("/v1/lookup", content=f'{{"hashes": {inner}}}'.encode(), headers=worker)
            assert_problem(r, status)
            r = await http.post("/v1/admin/tenants", content=f'{{"tenant": {inner}}}'.encode(), headers=operator)
            assert_problem(r, status)


# -- request heads: bounded as a whole, 431, then the connection closes ----------------------------
async def test_a_request_head_over_the_limit_is_refused_with_431(live: LiveServer):
    body = {"namespace": "default", "ops": ["get"]}
    async with live.client() as http:
        a, tok, _ = await _tenant(live, http)
        for size in (20_000, 267_000):  # one read's worth, and many reads' worth
            for path, json_body in (("/v1/capabilities", body), ("/v1/admin/tenants", {"tenant": "x"})):
                r = await http.post(path, json=json_body, headers={"Authorization": f"Bearer {'A' * size}"})
                assert_problem(r, 431)
                assert r.headers["connection"] == "close"
        # positive control: a real token with headers that bring the head near the limit
        r = await http.post("/v1/capabilities", json=body, headers={**live.headers(tok), "X-Pad": "a" * 15_000})
        assert r.status_code == 201, r.text


def _head_of(size: int) -> bytes:
    """A ``GET /healthz`` head of exactly ``size`` bytes."""
    bare = _head("GET", "/healthz", {"X-Pad": ""})
    return _head("GET", "/healthz", {"X-Pad": "a" * (size - len(bare))})


def test_the_head_limit_is_exact_and_nothing_after_a_refused_head_is_parsed(live: LiveServer):
    limit = live.settings.max_header_bytes
    with _connect(live) as s:  # positive control: a head of exactly the limit is served
        s.sendall(_head_of(limit))
        assert s.recv(65536).startswith(b"HTTP/1.1 200 ")
    with _connect(live) as s:  # one byte more, and a request pipelined behind it
        s.sendall(_head_of(limit + 1) + _head("GET", "/healthz", {}))
        answer = _until_closed(s)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert answer.count(b"HTTP/1.1 ") == 1  # the connection closed with the refusal
    assert b"connection: close" in answer.lower()


# -- Transfer-Encoding with Content-Length: refused, never stored, nothing after it parsed ---------
async def test_transfer_encoding_with_content_length_is_refused(live: LiveServer):
    async with live.client() as http:
        _, tok, cap = await _tenant(live, http)
        env = fake_envelope()

        def put(framing: dict[str, str]) -> bytes:
            return _head("PUT", "/v1/chunks", {
                "Authorization": f"Bearer {tok}", "X-KV-Capability": cap, "Content-Type": chunks.BATCH, **framing,
            })

        h = random_hash()
        body = chunks.frame([(h, env)])
        chunked = b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n"
        with _connect(live) as s:  # both framings, and a request smuggled behind the body
            s.sendall(put({"Transfer-Encoding": "chunked", "Content-Length": str(len(body))}) + chunked
                      + _head("GET", "/healthz", {}))
            answer = _until_closed(s)
        assert answer.startswith(b"HTTP/1.1 400 ") and answer.count(b"HTTP/1.1 ") == 1
        assert b"Transfer-Encoding and Content-Length" in answer
        assert await chunks.stored(http, live.headers(tok, cap), [h]) == [False]

        # positive control: the same request framed by Content-Length alone stores the chunk
        h = random_hash()
        body = chunks.frame([(h, env)])
        with _connect(live) as s:
            s.sendall(put({"Content-Length": str(len(body))}) + body)
            assert s.recv(65536).startswith(b"HTTP/1.1 204 ")
        assert await chunks.stored(http, live.headers(tok, cap), [h]) == [True]
