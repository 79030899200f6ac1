"""The remote data plane's own HTTP/1.1 client: ``PUT /v1/chunks`` and ``POST /v1/chunks/fetch``
at wire speed, for ``gateway.remote.client``; everything else a worker says to a server goes through httpx.
A response body is received with ``socket.recv_into`` straight into the buffer that keeps each
envelope (one copy, by the kernel), an upload is ``socket.sendall`` of the sealer's own buffers.

What it does, and nothing more: HTTP/1.1 over TCP, or TLS for ``https://`` (a verifying default
context unless one is given); ``Content-Length`` request bodies; ``Content-Length`` or chunked
responses (an error body may be read to the end of the connection); keep-alive with a bounded pool
(``connections``, ``idle_s``; a reused connection closed before any answer is retried once); a
timeout on each connect, send and receive (``timeout_s``); ``RemoteUnavailable`` for a connection
refused, reset or timed out, and its subclass ``TornResponse`` for a response that breaks HTTP/1.1
(its connection is never reused). Every call blocks; ``gateway.remote.client`` runs it in a worker thread
so receiving overlaps opening (``recv_into``/``sendall`` release the GIL). ``Exchange.abort`` may
be called from any thread: it shuts the socket down, so a blocked call ends at once.
Design notes: docs/architecture.md, section 5."""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

import numpy as np

from gateway.errors import GatewayError, InvalidRequest
from gateway.protocol.sockets import tune_unix_socket
from gateway.threadname import name_thread

__all__ = [
    "Exchange", "ReceiveBuffers", "RemoteUnavailable", "TornResponse", "WirePool", "receive_buffers",
]

_SMALL = 256 << 10  # the connection's own receive buffer: heads, chunk-size lines, small reads
_DIRECT = 64 << 10  # a read of at least this much (with the buffer empty) goes straight into the caller's buffer
_MAX_LINE = 8 << 10  # a status line, header line or chunk-size line longer than this is a torn response
_MAX_HEADERS = 100
_ERROR_BODY = 64 << 10  # the most of an error response's body kept (for the message)
_SEND_SLICE = 8 << 20  # sendall's timeout bounds a whole call: a body goes out in slices of this size
T = TypeVar("T")


class RemoteUnavailable(GatewayError):
    """The kvgate server could not be reached or failed (5xx, 429, transport error)."""


class TornResponse(RemoteUnavailable):
    """A response that is not well-formed HTTP/1.1 or ends before its body does."""


def _safe(value: str) -> str:
    if "\r" in value or "\n" in value or "\0" in value:
        raise InvalidRequest("a header value holds a line break")
    return value


class _Conn:
    """One connection and its small receive buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_SMALL)
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0
        self.idle_since = 0.0
        self.reused = False

    def _fill(self) -> int:
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.hi == len(self.buf):  # compact: move what is left to the front
            n = self.hi - self.lo
            self.buf[:n] = self.buf[self.lo : self.hi]
            self.lo, self.hi = 0, n
        got = self.sock.recv_into(self.view[self.hi :])
        self.hi += got
        return got

    def readline(self) -> bytes:
        """One line without its CRLF (TornResponse past ``_MAX_LINE`` or at the end of the stream)."""
        while True:
            at = self.buf.find(b"\n", self.lo, self.hi)
            if at >= 0:
                line = bytes(self.buf[self.lo : at])
                self.lo = at + 1
                return line[:-1] if line.endswith(b"\r") else line
            if self.hi - self.lo >= _MAX_LINE:
                raise TornResponse("a line of the response is too long")
            if not self._fill():
                raise TornResponse("the connection closed inside the response head")

    def readinto(self, view: memoryview) -> int:
        """Some bytes into ``view`` (0 at the end of the stream)."""
        if self.lo < self.hi:
            n = min(view.nbytes, self.hi - self.lo)
            view[:n] = self.view[self.lo : self.lo + n]
            self.lo += n
            return n
        if view.nbytes >= _DIRECT:
            return self.sock.recv_into(view)  # straight from the kernel into the caller's buffer
        if not self._fill():
            return 0
        return self.readinto(view)

    def readable(self) -> bool:
        """Whether an idle connection has anything to read (then it was closed, or sent junk)."""
        if self.lo < self.hi:
            return True
        try:
            r, _w, _x = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(r)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class WirePool:
    """Keep-alive connections to one server (``base_url``: ``http://`` or ``https://``), at most
    ``connections`` at a time. Thread-safe; every method blocks.

    ``uds``: connect to the server's Unix socket at that path instead of the URL's host and port
    (a server on the same host, ``kvgate serve --uds``; ``gateway.server.listen`` says why); the
    URL still names the server (its ``Host`` header, and the name TLS checks where it is https)."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 30.0, connections: int = 8, idle_s: float = 4.0,
        ssl_context: ssl.SSLContext | None = None, uds: str | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(f"not an http:// or https:// URL: {base_url!r}")
        if connections < 1 or timeout_s <= 0:
            raise InvalidRequest("connections and timeout_s must be positive")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.prefix = parts.path.rstrip("/")
        default_port = self.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = host if default_port else f"{host}:{self.port}"
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self.uds = uds
        self._ssl = (ssl_context or ssl.create_default_context()) if self.tls else None
        self._slots = threading.BoundedSemaphore(connections)
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()
        self._closed = False
        # one thread per connection: a call holds its connection for the whole exchange, in one
        # thread, so a call waiting for a connection never waits on the event loop (no deadlock)
        self._threads = ThreadPoolExecutor(max_workers=connections, thread_name_prefix="kvgate-wire", initializer=name_thread)
        self.requests: list[str] = []  # "METHOD path" of every request sent, for tests (bounded below)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(exchange, *args)`` in one of the pool's threads, on a new exchange. Cancelling the
        caller aborts the exchange (its socket is shut down: a body being sent or received is cut
        there, and the server stores nothing of an upload it did not get whole)."""
        ex = Exchange(self)
        fut = asyncio.get_running_loop().run_in_executor(self._threads, fn, ex, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            ex.abort()
            fut.add_done_callback(_consume)
            raise

    def _connect(self) -> _Conn:
        try:
            sock = self._unix_socket() if self.uds is not None else socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            where = self.authority if self.uds is None else f"{self.authority} at {self.uds}"
            raise RemoteUnavailable(f"connecting to {where}: {type(exc).__name__}") from None
        try:
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._ssl is not None:
                sock = self._ssl.wrap_socket(sock, server_hostname=self.host)
        except (OSError, ssl.SSLError) as exc:
            sock.close()
            raise RemoteUnavailable(f"TLS with {self.authority}: {type(exc).__name__}: {exc}") from None
        return _Conn(sock)

    def _unix_socket(self) -> socket.socket:
        assert self.uds is not None  # only called where there is one
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            tune_unix_socket(sock)
            sock.settimeout(self.timeout_s)
            sock.connect(self.uds)
        except OSError:
            sock.close()
            raise
        return sock

    def _take(self) -> _Conn:
        """A live idle connection, else a new one (the caller holds a slot)."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if now - conn.idle_since < self.idle_s and not conn.readable():
                    conn.reused = True
                    return conn
                conn.close()
        return self._connect()

    def _give_back(self, conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        conn.reused = False
        conn.lo = conn.hi = 0  # empty (checked by the caller): a reused connection starts with no answer
        with self._lock:
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        """Close the idle connections; those in use close when their exchange ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
        self._threads.shutdown(wait=False)

    def exchange(self) -> Exchange:
        """A request not yet sent (nothing blocks until ``Exchange.start``)."""
        return Exchange(self)


class ReceiveBuffers:
    """Buffers to receive envelopes into, used again once nothing holds them any more.

    A fresh buffer of an envelope's size is fresh memory: every page of it faults in as the kernel
    writes the received bytes, so reusing buffers speeds receiving up (docs/architecture.md,
    section 5). ``take`` hands out a view of a kept
    buffer of exactly that size where one is free, else of a new one; the buffer comes back here
    when the last view of it (and anything made from one: a tensor over it) is gone, never
    before, and at most ``max_bytes`` of free buffers are kept. The caller fills every byte of
    what it takes before handing it on (``Exchange.readinto`` fills all of it, or raises)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[int, list[np.ndarray[Any, Any]]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.reused = 0

    def take(self, n: int) -> memoryview:
        with self._lock:
            kept = self._free.get(n)
            raw = kept.pop() if kept else None
            if raw is not None:
                self._free_bytes -= n
                self.reused += 1
        if raw is None:
            raw = np.empty(n, dtype=np.uint8)
        holder = raw[:]  # a view object of its own: it lives exactly as long as what is handed out
        weakref.finalize(holder, self._give_back, raw)
        return holder.data.cast("B")

    def _give_back(self, raw: np.ndarray[Any, Any]) -> None:
        with self._lock:
            if self._free_bytes + raw.nbytes <= self.max_bytes:
                self._free.setdefault(raw.nbytes, []).append(raw)
                self._free_bytes += raw.nbytes


receive_buffers = ReceiveBuffers()  # one per process: every client of every server shares it


def _consume(fut: asyncio.Future[Any] | Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved: an aborted exchange's error is expected, not logged


class Exchange:
    """One request and its response on a pooled connection.

    ``start`` sends the request and reads the response head (status, headers); the body is then
    read with ``readinto`` / ``read`` / ``read_rest``, and ``close`` gives the connection back to the
    pool when the body was read to its end (else it is closed). ``abort`` (any thread) cuts it."""

    def __init__(self, pool: WirePool) -> None:
        self.pool = pool
        self.status = 0
        self.headers: dict[str, str] = {}
        self._conn: _Conn | None = None
        self._slot = False
        self._aborted = False
        self._done = False
        self._keep = True
        self._chunked = False
        self._left = 0  # body bytes left (Content-Length), or left in the current chunk
        self._to_eof = False
        self._ended = False  # the body was read to its end
        self._lock = threading.RLock()

    # -- the request -------------------------------------------------------------------------
    def start(
        self, method: str, path: str, headers: Sequence[tuple[str, str]] = (),
        body: Sequence[bytes | memoryview] = (),
    ) -> None:
        """Send the request (``body``: buffers sent as they are, their total as ``Content-Length``)
        and read the response head. A reused connection found closed before any answer is
        retried once on a fresh one (``body`` is sent again)."""
        pool = self.pool
        while not pool._slots.acquire(timeout=0.05):
            if self._aborted:
                raise RemoteUnavailable(f"{method} {path}: cancelled")
        self._slot = True
        length = sum(memoryview(b).nbytes for b in body)
        lines = [f"{method} {pool.prefix}{path} HTTP/1.1", f"Host: {pool.authority}", f"Content-Length: {length}"]
        lines += [f"{_safe(k)}: {_safe(v)}" for k, v in headers]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if len(pool.requests) < 10_000:
            pool.requests.append(f"{method} {path}")
        for attempt in (0, 1):
            with self._lock:
                if self._aborted:
                    self._release()
                    raise RemoteUnavailable(f"{method} {path}: cancelled")
            try:
                conn = pool._take()
            except BaseException:
                self._release()
                raise
            with self._lock:
                self._conn = conn
                if self._aborted:  # cut between taking the connection and now
                    self._release()
                    raise RemoteUnavailable(f"{method} {path}: cancelled")
            conn.sock.settimeout(pool.timeout_s)
            try:
                self._send(conn, head, body)
                self._read_head(conn)
                return
            except (TornResponse, OSError) as exc:
                answered = conn.lo > 0 or conn.hi > 0
                fresh_retry = attempt == 0 and conn.reused and not answered and not self._aborted
                self._keep = False
                self._drop_conn()
                if fresh_retry and isinstance(exc, (TornResponse, ConnectionError)):
                    continue  # the server closed the idle connection as we reused it
                self._release()
                if isinstance(exc, TornResponse):
                    raise
                if isinstance(exc, TimeoutError | socket.timeout):
                    raise RemoteUnavailable(f"{method} {path}: timed out") from None
                raise RemoteUnavailable(f"{method} {path}: {type(exc).__name__}") from None
            except BaseException:
                self._keep = False
                self._drop_conn()
                self._release()
                raise

    @staticmethod
    def _send(conn: _Conn, head: bytes, body: Sequence[bytes | memoryview]) -> None:
        try:
            conn.sock.sendall(head)
            for part in body:
                view = memoryview(part).cast("B")
                for off in range(0, view.nbytes, _SEND_SLICE):  # each slice gets the whole timeout
                    conn.sock.sendall(view[off : off + _SEND_SLICE])
        except (BrokenPipeError, ConnectionResetError):
            # the server answered (a refusal) and closed before taking the whole body: read its answer
            if not conn.readable():
                raise
            conn.sock.settimeout(min(conn.sock.gettimeout() or 1.0, 1.0))

    def _read_head(self, conn: _Conn) -> None:
        while True:
            status_line = conn.readline()
            parts = status_line.split(b" ", 2)
            if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].isdigit() or len(parts[1]) != 3:
                raise TornResponse(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
            status = int(parts[1])
            headers: dict[str, str] = {}
            for _ in range(_MAX_HEADERS + 1):
                line = conn.readline()
                if not line:
                    break
                name, sep, value = line.partition(b":")
                if not sep or not name or name != name.strip():
                    raise TornResponse("a malformed header line")
                key = name.decode("latin-1").lower()
                val = value.strip().decode("latin-1")
                if key == "content-length" and key in headers and headers[key] != val:
                    raise TornResponse("two different Content-Length headers")
                headers[key] = f"{headers[key]}, {val}" if key in headers and key != "content-length" else val
            else:
                raise TornResponse("too many header lines")
            if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
                continue
            break
        self.status, self.headers = status, headers
        connection = headers.get("connection", "").lower()
        self._keep = parts[0] == b"HTTP/1.1" and "close" not in connection
        te = headers.get("transfer-encoding", "").lower()
        if te:
            if te != "chunked":
                raise TornResponse(f"an unsupported Transfer-Encoding: {te!r}")
            self._chunked, self._left = True, 0
        elif "content-length" in headers:
            cl = headers["content-length"]
            if not cl.isdigit():
                raise TornResponse("a malformed Content-Length")
            self._left = int(cl)
            self._ended = self._left == 0
        elif status in (204, 304):
            self._ended = True
        else:
            self._to_eof, self._keep = True, False

    # -- the response body -------------------------------------------------------------------
    def _next_chunk(self, conn: _Conn) -> None:
        """Read the next chunk's size line (after the previous chunk's CRLF); at the last chunk,
        the trailers, and mark the body ended."""
        line = conn.readline()
        size = line.split(b";", 1)[0].strip()
        if not size or len(size) > 16 or any(c not in b"0123456789abcdefABCDEF" for c in size):
            raise TornResponse("a malformed chunk size")
        self._left = int(size, 16)
        if self._left == 0:
            for _ in range(_MAX_HEADERS + 1):
                if not conn.readline():
                    self._ended = True
                    return
            raise TornResponse("too many trailer lines")

    def _chunk_crlf(self, conn: _Conn) -> None:
        if conn.readline() != b"":
            raise TornResponse("a chunk is longer than its size")

    def _some(self, view: memoryview) -> int:
        """Some body bytes into ``view`` (0: the body ended)."""
        conn = self._conn
        if conn is None:
            raise RemoteUnavailable("the exchange is closed")
        if self._ended:
            return 0
        if self._chunked and self._left == 0:
            self._next_chunk(conn)
            if self._ended:
                return 0
        want = view.nbytes if self._to_eof else min(view.nbytes, self._left)
        got = conn.readinto(view[:want])
        if got == 0:
            if self._to_eof:
                self._ended = True
                return 0
            raise TornResponse("the connection closed inside the response body")
        if not self._to_eof:
            self._left -= got
            if self._left == 0:
                if self._chunked:
                    self._chunk_crlf(conn)
                else:
                    self._ended = True
        return got

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` (a writable byte buffer) from the body: TornResponse where the body ends first."""
        filled = 0
        try:
            while filled < view.nbytes:
                got = self._some(view[filled:])
                if got == 0:
                    raise TornResponse("the response body ends inside the frame")
                filled += got
        except OSError as exc:
            self._keep = False
            if isinstance(exc, TimeoutError | socket.timeout):
                raise RemoteUnavailable("reading the response: timed out") from None
            raise RemoteUnavailable(f"reading the response: {type(exc).__name__}") from None

    def read(self, n: int) -> memoryview:
        out = memoryview(bytearray(n))
        self.readinto(out)
        return out

    def read_rest(self, limit: int = _ERROR_BODY) -> bytes:
        """The rest of the body, up to ``limit`` bytes kept (the rest read and dropped)."""
        kept = bytearray()
        scratch = memoryview(bytearray(64 << 10))
        try:
            while True:
                got = self._some(scratch)
                if got == 0:
                    return bytes(kept)
                if len(kept) < limit:
                    kept += scratch[: min(got, limit - len(kept))]
        except OSError:
            self._keep = False
            return bytes(kept)

    def at_end(self) -> bool:
        """Whether the body ended here (reading the next chunk's size if need be)."""
        if not self._ended and self._chunked and self._left == 0 and self._conn is not None:
            try:
                self._next_chunk(self._conn)
            except OSError:
                self._keep = False
                return False
        return self._ended

    # -- the end -----------------------------------------------------------------------------
    def abort(self) -> None:
        """Cut the exchange (any thread): a call blocked on its socket ends at once."""
        with self._lock:
            self._aborted = True
            self._keep = False
            conn = self._conn
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        """End the exchange: the connection goes back to the pool if its body was read to the
        end and the server keeps it alive; otherwise it is closed. Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
            conn, self._conn = self._conn, None
            reuse = conn is not None and self._keep and self._ended and not self._aborted and conn.lo == conn.hi
        if conn is not None:
            if reuse:
                self.pool._give_back(conn)
            else:
                conn.close()
        self._release()

    def _drop_conn(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _release(self) -> None:
        with self._lock:
            slot, self._slot = self._slot, False
        if slot:
            self.pool._slots.release()
