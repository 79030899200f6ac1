"""What a request must pass before any route sees it, and the HTTP protocol's own bounds.

``Gatekeeper`` is the outermost ASGI middleware. In this order, before a byte of the body is read:

1. at most ``max_header_count`` header fields (431);
2. a route under ``/v1`` (and ``/metrics``) needs a verified bearer token: the token is verified
   here (``deps.authenticate``: failure rate limit, audit) and the principal kept in the request
   state for the routes; 401/429 otherwise;
3. the body fits the route's limit (``body_limit``): a declared ``Content-Length`` over it is
   refused at once (413), a chunked body is counted as it arrives;
4. the body arrives in time: each read waits at most ``body_timeout_s`` (408), so a
   ``Content-Length`` larger than the body sent fails within that timeout;
5. ``POST /v1/lookup`` is then answered here (``gateway.server.rawlookup``: the route's own
   checks and answers, without FastAPI's per-request cost); every other request goes on to the app.

A refusal before the body is read is sent at once (a client that sent ``Expect: 100-continue``
never sends the body); whatever body a client sends anyway is discarded as it arrives, never
buffered, and the connection is cut ``header_timeout_s`` after the response if it has not
finished by then (a bounded lingering close, so the client can still read the refusal).

``bounded_h11(header_timeout_s)`` is uvicorn's h11 protocol with a deadline on the request head:
from the connection's first byte (and after each response) the whole header block must arrive
within ``header_timeout_s``, however slowly it trickles (uvicorn's keep-alive timer restarts on
every byte, so it cannot cut a slow-header client). The header block size is bounded by h11's
``max_incomplete_event_size`` (``max_header_bytes``, 431 beyond). It also offers the fetch route
its raw chunk writer (``gateway.server.rawchunks``) and the batched upload its raw body reader
(``gateway.server.rawbody``) in the request's scope, before the app runs.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway import frames
from gateway.config import Settings
from gateway.server import rawlookup
from gateway.server.listen import peer_source
from gateway.server.rawbody import offer_raw_body
from gateway.server.rawchunks import offer_raw_chunks
from gateway.wire import tune_unix_socket

__all__ = ["Gatekeeper", "body_limit", "bounded_h11", "uvicorn_options"]

_BULK_BYTES = 8 << 20  # a clear or move of up to 100,000 hashes
_LOOKUP_BYTES = 512 << 10  # 4,096 hashes
_KEYS_BYTES = 1 << 20  # 4,096 envelopes (hash, key version, salt)
_AUTHENTICATED = ("/v1/", "/metrics")


def body_limit(method: str, path: str, settings: Settings) -> int:
    """The most body bytes a route takes (0: it takes none)."""
    if method == "PUT" and path.startswith("/v1/chunks/"):
        return settings.max_chunk_bytes
    if method == "PUT" and path == "/v1/chunks":  # a batch frame (gateway.frames): at least one whole chunk
        return max(settings.max_batch_bytes, settings.max_chunk_bytes + frames.HEAD + frames.INDEX_ITEM)
    if method != "POST" or path.endswith("/keys/rotate"):
        return 0  # GET, HEAD, DELETE, and a rotation (its tenant is in the path) take no body
    if path in ("/v1/admin/clear", "/v1/admin/move"):
        return _BULK_BYTES
    if path in ("/v1/lookup", "/v1/chunks/fetch"):
        return _LOOKUP_BYTES
    if path == "/v1/keys/envelopes":
        return _KEYS_BYTES
    return settings.max_json_body_bytes


async def _refuse(send: Any, status: int, title: str, detail: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"type": "about:blank", "title": title, "status": status, "detail": detail}).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [
            (b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode()),
            *(headers or []),
        ],
    })
    await send({"type": "http.response.body", "body": body})


class Gatekeeper:
    def __init__(self, app: Any, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from gateway.errors import RateLimited
        from gateway.server.deps import authenticate

        s = self.settings
        headers = scope["headers"]
        if len(headers) > s.max_header_count:
            await _refuse(send, 431, "Request Header Fields Too Large", "too many header fields")
            return
        path, method = scope["path"], scope["method"]
        state = getattr(scope["app"].state, "kvgate", None) if "app" in scope else None
        if state is not None and path.startswith(_AUTHENTICATED):
            authorization = None
            for k, v in headers:
                if k == b"authorization":
                    authorization = v.decode("latin-1")
                    break
            client = scope["client"][0] if scope.get("client") else "-"
            try:
                principal = await authenticate(state, authorization, client)
            except RateLimited:
                await _refuse(send, 429, "Too Many Requests", "too many failed authentications", [(b"retry-after", b"10")])
                return
            except Exception:  # Unauthenticated
                await _refuse(
                    send, 401, "Unauthorized", "a valid bearer token is required",
                    [(b"www-authenticate", b'Bearer realm="kvgate"')],
                )
                return
            scope.setdefault("state", {})["kvgate_principal"] = principal
        limit = body_limit(method, path, s)
        declared: int | None = None
        chunked = False
        for k, v in headers:
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
            elif k == b"transfer-encoding":
                chunked = True
        if declared is not None and (declared < 0 or declared > limit):
            if declared < 0:
                await _refuse(send, 400, "Bad Request", "bad Content-Length")
            else:
                await _refuse(send, 413, "Content Too Large", f"this route takes at most {limit} body bytes")
            return
        if chunked or declared:
            receive = _Body(receive, limit, s.body_timeout_s).receive
        if state is not None and method == "POST" and path == rawlookup.PATH:
            await rawlookup.serve(state, scope["state"]["kvgate_principal"], scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Body:
    """The request body as the app reads it: bounded in size and in time."""

    def __init__(self, receive: Any, limit: int, timeout: float) -> None:
        self._receive: Callable[[], Awaitable[dict[str, Any]]] = receive
        self.limit, self.timeout = limit, timeout
        self.seen, self.done = 0, False

    async def receive(self) -> dict[str, Any]:
        if self.done:  # the body is in; what follows is a wait for the client to disconnect
            return await self._receive()
        try:
            async with asyncio.timeout(self.timeout):  # no task per message, as wait_for would make
                message = await self._receive()
        except TimeoutError:
            raise HTTPException(408, "the request body did not arrive in time", headers={"Connection": "close"}) from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                raise HTTPException(413, "Content Too Large")  # the rest is discarded as it comes
            self.done = not message.get("more_body", False)
        else:
            self.done = True
        return message


def bounded_h11(header_timeout_s: float, body_timeout_s: float = 30.0) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline on each request head (see the module docstring)."""

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _active(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self._active():
                return
            if self.conn.trailing_data[0]:  # part of a request head: say why, then cut
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 26\r\n"
                    b"connection: close\r\n\r\nthe request head was late\n"
                )
            self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # asyncio types it BaseTransport; a server connection is a Transport
            sock = transport.get_extra_info("socket")
            tune_unix_socket(sock)  # the Unix socket's buffers (listen.py)
            super().connection_made(transport)
            if self.client is None:  # a Unix socket has no address: its peer's uid and pid (listen.py)
                source = peer_source(sock)
                if source is not None:
                    self.client = (source, 0)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._active():
                self._disarm()  # a request is being served: its body has its own timeout
                offer_raw_chunks(self.cycle)
                offer_raw_body(self, body_timeout_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._active():
                self._arm()  # the next request's head (or the rest of a body nobody reads)
            elif self._active():
                offer_raw_chunks(self.cycle)  # a pipelined request, its cycle made just now
                offer_raw_body(self, body_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedH11Protocol


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn settings every kvgate server runs with (``kvgate serve`` and the tests)."""
    return {
        "http": bounded_h11(settings.header_timeout_s, settings.body_timeout_s),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_keep_alive": 5,
        "proxy_headers": False,
        "server_header": False,
        "access_log": settings.access_log,
    }
