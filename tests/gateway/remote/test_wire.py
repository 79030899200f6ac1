"""The data plane's own HTTP/1.1 client (gateway.remote.wire) against scripted servers: Content-Length and
chunked bodies received into the caller's buffers, keep-alive within a bounded pool, TLS with
certificate and host checks, timeouts, and every torn or malformed response a typed error on a
connection that is never reused."""

from __future__ import annotations

import asyncio
import datetime
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from gateway.errors import InvalidRequest
from gateway.remote.wire import Exchange, RemoteUnavailable, TornResponse, WirePool

Handler = Callable[[socket.socket, int], None]  # (connection, its number), one thread per connection


class Scripted:
    """A TCP (or TLS) server on 127.0.0.1 that runs ``handler`` on every connection."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler, self.tls = handler, tls
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.requests: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._run, args=(conn, self.accepted), daemon=True).start()

    def _run(self, conn: socket.socket, n: int) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            self.handler(conn, n)
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()

    def read_request(self, conn: socket.socket) -> bytes:
        """One request (head and Content-Length body); b"" at the end of the connection."""
        data = b""
        while b"\r\n\r\n" not in data:
            got = conn.recv(65536)
            if not got:
                return b""
            data += got
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            got = conn.recv(65536)
            if not got:
                return b""
            body += got
        self.requests.append(head + b"\r\n\r\n" + body)
        return head


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\nx-trailer: 1\r\n\r\n"


def serve_each(server_ref: list[Scripted], answer: Callable[[int], bytes], close_after: bool = False) -> Handler:
    """A handler answering every request of a connection with ``answer(request number)``."""
    count = [0]

    def handler(conn: socket.socket, _n: int) -> None:
        while server_ref[0].read_request(conn):
            count[0] += 1
            conn.sendall(answer(count[0]))
            if close_after:
                return

    return handler


def scripted(answer: Callable[[int], bytes], **kw) -> Scripted:
    ref: list[Scripted] = []
    srv = Scripted(serve_each(ref, answer, **kw))
    ref.append(srv)
    return srv


def get(pool: WirePool, path: str = "/x", body: bytes = b"", into: int | None = None) -> tuple[int, bytes, Exchange]:
    ex = pool.exchange()
    try:
        ex.start("POST", path, [("Content-Type", "application/json")], [body] if body else [])
        if into is None:
            data = ex.read_rest()
        else:
            buf = memoryview(bytearray(into))
            ex.readinto(buf)
            data = bytes(buf)
            ex.at_end()
        return ex.status, data, ex
    finally:
        ex.close()


PAYLOAD = bytes(range(256)) * 1024  # 256 KiB: past the client's small buffer, so read straight into the caller's


def test_content_length_and_chunked_bodies_arrive_whole_over_one_kept_connection():
    srv = scripted(lambda n: (
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(PAYLOAD), PAYLOAD) if n % 2
        else b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(PAYLOAD[:1000], PAYLOAD[1000:200_000], PAYLOAD[200_000:])
    ))
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=2)
    try:
        for _ in range(4):  # Content-Length, chunked, Content-Length, chunked
            status, data, _ex = get(pool, body=b'{"a": 1}', into=len(PAYLOAD))
            assert (status, data) == (200, PAYLOAD)
        assert srv.accepted == 1  # kept alive: one connection for all four
        assert srv.requests[0].startswith(b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:") and srv.requests[0].endswith(b'\r\n\r\n{"a": 1}')
    finally:
        pool.close()
        srv.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 300000\r\n\r\n" + PAYLOAD[:1000],  # shorter than it says
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40000\r\n" + PAYLOAD[:5000],  # cut inside a chunk
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a chunk size that is not hex
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nabcdefgh\r\n0\r\n\r\n",  # a chunk longer than its size
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",  # a framing this client does not speak
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",  # two lengths
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"SSH-2.0-OpenSSH\r\n\r\n",  # not HTTP at all
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n",  # the head never ends
    b"",  # closed without a word
], ids=["short", "cut-in-chunk", "bad-size", "long-chunk", "gzip", "two-lengths", "negative", "not-http", "head-cut", "closed"])
def test_a_torn_or_malformed_response_is_a_typed_error_and_its_connection_is_dropped(answer: bytes):
    srv = scripted(lambda n: answer if n == 1 else b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close_after=True)
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=1)
    try:
        with pytest.raises(TornResponse):
            get(pool, into=300_000)
        # positive control: the next request gets a fresh connection and its whole answer
        assert get(pool)[:2] == (200, b"ok")
        assert srv.accepted == 2
    finally:
        pool.close()
        srv.close()


def test_a_kept_connection_the_server_closed_meanwhile_is_retried_once_on_a_fresh_one():
    srv = scripted(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", close_after=True)  # never keeps one
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=1)
    try:
        assert get(pool)[:2] == (200, b"ok")
        time.sleep(0.1)  # the server has closed it by now; the client still holds it as idle
        assert get(pool, body=b"again")[:2] == (200, b"ok")
        assert srv.accepted == 2 and srv.requests[-1].endswith(b"again")
    finally:
        pool.close()
        srv.close()


def test_a_silent_server_times_out_and_a_closed_port_is_unavailable():
    def silent(conn: socket.socket, _n: int) -> None:
        time.sleep(3)

    srv = Scripted(silent)
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="timed out"):
        get(pool)
    assert time.monotonic() - t0 < 2.5
    pool.close()
    srv.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteUnavailable) as err:
        get(WirePool(f"http://127.0.0.1:{port}", timeout_s=2))
    assert not isinstance(err.value, TornResponse)


def test_the_pool_bounds_connections_and_a_header_cannot_inject_lines():
    gate = threading.Event()
    ref: list[Scripted] = []

    def slow(conn: socket.socket, _n: int) -> None:
        while ref[0].read_request(conn):
            gate.wait(5)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    srv = Scripted(slow)
    ref.append(srv)
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=1)
    try:
        results: list[int] = []
        threads = [threading.Thread(target=lambda: results.append(get(pool)[0])) for _ in range(3)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        assert srv.accepted == 1  # one connection; the other two requests wait for it
        gate.set()
        for t in threads:
            t.join(10)
        assert results == [200, 200, 200] and srv.accepted == 1
        ex = pool.exchange()
        with pytest.raises(InvalidRequest):
            ex.start("GET", "/x", [("X-KV-Capability", "abc\r\nX-Evil: 1")])
        ex.close()
        assert len(srv.requests) == 3  # nothing was sent
    finally:
        pool.close()
        srv.close()


def test_abort_from_another_thread_ends_a_blocked_read_at_once():
    srv = scripted(lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + PAYLOAD[:10])  # then nothing
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=30, connections=1)

    async def main() -> None:
        def reader(ex: Exchange) -> bytes:
            try:
                ex.start("GET", "/x")
                return bytes(ex.read(1_000_000))
            finally:
                ex.close()

        task = asyncio.ensure_future(pool.run(reader))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # the slot came back: a new exchange gets the (only) connection slot quickly
        ex = pool.exchange()
        assert await asyncio.to_thread(pool._slots.acquire, True, 5)
        pool._slots.release()
        ex.close()
        assert time.monotonic() - t0 < 3

    try:
        asyncio.run(main())
    finally:
        pool.close()
        srv.close()


# -- TLS ---------------------------------------------------------------------------------------------
def _certificate(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path


def test_https_round_trip_with_the_certificate_checked(tmp_path: Path):
    cert, key = _certificate(tmp_path)
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    ref: list[Scripted] = []
    srv = Scripted(serve_each(ref, lambda n: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(PAYLOAD, PAYLOAD)), tls=server_ctx)
    ref.append(srv)
    trusted = ssl.create_default_context(cafile=str(cert))
    pool = WirePool(f"https://localhost:{srv.port}", timeout_s=5, ssl_context=trusted)
    try:
        for _ in range(2):
            assert get(pool, body=b"{}", into=2 * len(PAYLOAD))[:2] == (200, PAYLOAD * 2)
        assert srv.accepted == 1  # kept alive over TLS too
        # a server whose certificate this client does not trust: refused before a byte of the request
        sent = len(srv.requests)
        with pytest.raises(RemoteUnavailable, match="TLS"):
            get(WirePool(f"https://localhost:{srv.port}", timeout_s=5))
        # a trusted certificate for another name: refused too
        with pytest.raises(RemoteUnavailable, match="TLS"):
            get(WirePool(f"https://127.0.0.1:{srv.port}", timeout_s=5, ssl_context=trusted))  # the certificate names localhost
        assert len(srv.requests) == sent
    finally:
        pool.close()
        srv.close()


def test_bad_urls_are_refused():
    for url in ("ftp://h/", "http://", "localhost:80"):
        with pytest.raises(InvalidRequest):
            WirePool(url)


def test_a_receive_buffer_is_used_again_only_once_nothing_holds_it():
    import gc

    import numpy as np
    import torch

    from gateway.remote.wire import ReceiveBuffers

    bufs = ReceiveBuffers(max_bytes=1 << 20)
    first = bufs.take(4096)
    first[:] = b"A" * 4096
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    tensor = torch.frombuffer(first, dtype=torch.uint8)  # something made from the view keeps it too
    del first
    gc.collect()
    second = bufs.take(4096)  # the first is still held (by the tensor): a new buffer
    address2 = np.frombuffer(second, dtype=np.uint8).ctypes.data
    assert address2 != address and bufs.reused == 0
    assert bytes(tensor[:4].numpy()) == b"AAAA"  # untouched by anyone else
    del tensor, second
    gc.collect()
    third = bufs.take(4096)  # now one comes back
    assert bufs.reused == 1
    assert np.frombuffer(third, dtype=np.uint8).ctypes.data in (address, address2)
    # at most max_bytes of free buffers are kept
    big = [bufs.take(600 << 10) for _ in range(2)]
    del big
    gc.collect()
    assert bufs._free_bytes <= 1 << 20


def test_a_request_whose_kept_connection_dies_unanswered_is_sent_again_on_a_fresh_one():
    """The keep-alive race: the server closes a kept connection just as a request arrives on it
    (no byte of an answer). The request goes again, once, on a new connection; a connection that
    died the same way twice in a row (both fresh) is an error, not a loop."""
    ref: list[Scripted] = []

    def flaky(conn: socket.socket, n: int) -> None:
        if n == 1:
            ref[0].read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            ref[0].read_request(conn)  # the second request on this connection: dropped unanswered
            return
        if n == 2:
            while ref[0].read_request(conn):
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh")
            return
        ref[0].read_request(conn)  # 3 and on: never answer

    srv = Scripted(flaky)
    ref.append(srv)
    pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=1)
    try:
        assert get(pool)[:2] == (200, b"ok")
        assert get(pool, body=b"second")[:2] == (200, b"fresh")
        assert srv.accepted == 2 and [r.endswith(b"second") for r in srv.requests[1:]] == [True, True]
        pool.close()
        pool = WirePool(f"http://127.0.0.1:{srv.port}", timeout_s=5, connections=1)  # fresh connections only
        with pytest.raises(TornResponse):
            get(pool)
        assert srv.accepted == 3
    finally:
        pool.close()
        srv.close()
