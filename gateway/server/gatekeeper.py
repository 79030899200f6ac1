"""What a request must pass before any route sees it (docs/operations.md, "Request limits").

``bounded_h11`` (uvicorn's h11 protocol) bounds the request head before any of it reaches the
app: it must arrive within ``header_timeout_s`` (408), be at most ``max_header_bytes`` whole
(431), and not frame its body by both ``Transfer-Encoding`` and ``Content-Length`` (400;
``RequestHeads``). A refused head is answered with problem+json, then a lingering close; nothing
after it is parsed. It is counted by status (``HEAD_REFUSALS``), not logged: uvicorn's warning per
invalid request is dropped for a head. The protocol also offers ``rawchunks`` and ``rawbody``.

``Gatekeeper``, the outermost ASGI middleware, then checks before a byte of the body is read: at most
``max_header_count`` fields (431); under ``/v1`` and ``/metrics`` a verified bearer token
(``deps.authenticate``; 401/429); the body within its route's limit (``bodylimits``: 413, a chunked body
counted as it arrives) and each read within ``body_timeout_s`` (408); then the app routes it. A refusal
is sent at once; a body sent anyway is discarded as it arrives, the connection cut ``header_timeout_s`` later.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.config import Settings
from gateway.protocol.sockets import tune_unix_socket
from gateway.server.bodylimits import BodyLimits
from gateway.server.listen import peer_source
from gateway.server.rawbody import offer_raw_body
from gateway.server.rawchunks import offer_raw_chunks

__all__ = ["HEAD_REFUSALS", "Gatekeeper", "RequestHeads", "bounded_h11", "uvicorn_options"]

_AUTHENTICATED = ("/v1/", "/metrics")

HEAD_REFUSALS = "kvgate.head_refusals"
"""The key, in the app's lifespan state, of a ``Counter`` of refused request heads by status
(400, 408, 431, 501) that the server's protocol adds to; the app reports it as a metric."""


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
    """``limits``: each route's body limit (``bodylimits.BodyLimits``, from the app's routes)."""

    def __init__(self, app: Any, settings: Settings, limits: BodyLimits) -> None:
        self.app = app
        self.settings = settings
        self.limits = limits

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
        limit = self.limits.of(method, path)
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


# after a refused request head, what the client still sends is read and dropped, up to this
# many bytes (and ``header_timeout_s``), so it can finish sending and read the answer
_LINGER_BYTES = 4 << 20
_HEAD_REFUSALS = {
    400: "the request is not valid HTTP/1.1",
    431: "the request head is larger than the server takes",
    501: "unsupported Transfer-Encoding",
}


class _Refused(h11.RemoteProtocolError):
    """A request head this server refuses; ``str()`` is told to the client."""


class RequestHeads(h11.Connection):
    """h11's server side, refusing two request heads h11 itself accepts (``_Refused``, raised
    from ``next_event`` as h11 raises its own ``RemoteProtocolError``):

    - a head of more than ``max_head_bytes`` (request line, header fields, the blank line): h11
      bounds a head only while it is incomplete (``max_incomplete_event_size``), so one that
      arrives whole in one read, a 20 KB bearer token, was parsed and served (431);
    - a head with both ``Transfer-Encoding`` and ``Content-Length``: two framings of one body,
      which a proxy in front may read the other way than h11 does (RFC 9112 section 6.3 lets a
      server go by Transfer-Encoding; request-smuggling defences refuse it: 400).
    """

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        before = len(self._receive_buffer)
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):  # the head was just taken off the buffer, whole
                self._check(event, before - len(self._receive_buffer))
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise
        return event

    def _check(self, request: h11.Request, head_bytes: int) -> None:
        refusal = None
        if head_bytes > self.max_head_bytes:
            refusal = _Refused(f"the request head is larger than {self.max_head_bytes} bytes", 431)
        else:
            names = {name for name, _ in request.headers}
            if b"transfer-encoding" in names and b"content-length" in names:
                refusal = _Refused("Transfer-Encoding and Content-Length together", 400)
        if refusal is not None:
            self._process_error(self.their_role)  # as h11 marks a peer that broke the protocol
            raise refusal


class _ProtocolLog(logging.LoggerAdapter[logging.Logger]):
    """uvicorn's protocol logger, less its warning per invalid request where ``quiet()`` says the
    invalid request is a refused head (counted instead)."""

    def __init__(self, logger: logging.Logger, quiet: Callable[[], bool]) -> None:
        super().__init__(logger, {})
        self._quiet = quiet

    @property
    def level(self) -> int:  # uvicorn reads it to decide on its trace lines
        return self.logger.level

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if level == logging.WARNING and msg == _UVICORN_INVALID and self._quiet():
            return
        super().log(level, msg, *args, **kwargs)


_UVICORN_INVALID = "Invalid HTTP request received."  # uvicorn's warning before ``send_400_response``


def _refusal(status: int, detail: str) -> bytes:
    """A whole problem+json response that closes the connection, as bytes."""
    body = json.dumps({"type": "about:blank", "title": HTTPStatus(status).phrase, "status": status, "detail": detail}).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/problem+json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


def bounded_h11(
    header_timeout_s: float, body_timeout_s: float = 30.0, max_head_bytes: int = 16 << 10, raw: bool = True,
) -> type[H11Protocol]:
    """uvicorn's h11 protocol, with a deadline on each request head and its size bounded (see
    the module docstring); ``raw``: it offers each request the raw body and chunk paths
    (``rawbody``, ``rawchunks``; docs/server.md says when they pay)."""

    class BoundedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None
        _linger_timer: asyncio.TimerHandle | None = None
        _lingered: int | None = None  # bytes dropped since a refused head (None: none refused)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.conn = RequestHeads(max_head_bytes)
            self.logger = _ProtocolLog(self.logger, lambda: not self._active())  # type: ignore[assignment]

        def _count_refusal(self, status: int) -> None:
            counts = self.app_state.get(HEAD_REFUSALS)
            if isinstance(counts, Counter):
                counts[status] += 1

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
                self._count_refusal(408)
                self.transport.write(
                    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 26\r\n"
                    b"connection: close\r\n\r\nthe request head was late\n"
                )
            self.transport.close()

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 refuses (always 400, then an abrupt close, so a
            client still sending its head met a reset): here the refusal's own status (431 for
            a head over the limit) as problem+json, then a lingering close."""
            if self._active():  # a request is being served (a broken chunked body): uvicorn's way
                super().send_400_response(msg)
                return
            refusal = self.conn.refusal if isinstance(self.conn, RequestHeads) else None
            status = refusal.error_status_hint if refusal is not None else 400
            if status not in _HEAD_REFUSALS:
                status = 400
            detail = str(refusal) if isinstance(refusal, _Refused) else _HEAD_REFUSALS[status]
            self._count_refusal(status)
            self._disarm()
            self._unset_keepalive_if_required()
            self.transport.write(_refusal(status, detail))
            # the answer, then our end closed; what the client still sends is read and dropped
            # (``data_received``) until it closes its end, or for ``header_timeout_s``, or past
            # ``_LINGER_BYTES``: closing with its bytes unread would reset the connection, and a
            # reset can cost the client the answer
            self._lingered = 0
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.flow.resume_reading()
            self._linger_timer = self.loop.call_later(header_timeout_s, self.transport.close)

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
            if self._lingered is not None:  # after a refused head: dropped, never parsed
                self._lingered += len(data)
                if self._lingered > _LINGER_BYTES:
                    self.transport.close()
                return
            super().data_received(data)
            if self._active():
                self._disarm()  # a request is being served: its body has its own timeout
                self._offer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self._active():
                self._arm()  # the next request's head (or the rest of a body nobody reads)
            elif self._active():
                self._offer()  # a pipelined request, its cycle made just now

        def _offer(self) -> None:
            if raw:
                offer_raw_chunks(self.cycle)
                offer_raw_body(self, body_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            super().connection_lost(exc)

    return BoundedH11Protocol


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn settings every kvgate server runs with (``kvgate serve`` and the tests)."""
    return {
        "http": bounded_h11(settings.header_timeout_s, settings.body_timeout_s, settings.max_header_bytes, settings.raw_paths),
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "timeout_keep_alive": 5,
        "proxy_headers": False,
        "server_header": False,
        "access_log": settings.access_log,
    }
