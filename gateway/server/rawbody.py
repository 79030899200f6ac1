"""An upload's envelopes read from the socket straight into the tier's buffers.

``RawBody.readinto(view)`` fills ``view`` with the next body bytes without ASGI's copies: what
uvicorn and h11 already hold is copied out once, and the rest is received by the kernel straight
into ``view`` (the transport is switched to an ``asyncio.BufferedProtocol`` whose buffer is the
view, ``recv_into``, then switched back).

It keeps h11's books right: bytes read here are taken off its ``ContentLengthReader``, and the
buffer handed to the kernel is never larger than what is left of the body, so the request still
ends at its ``Content-Length`` and a pipelined request after it stays in the socket; once the body
is read, uvicorn is told (a body that ended unread is read from what uvicorn holds). A client gone
mid-body is a ``ClientGone``; a body that stops arriving for ``timeout_s`` a 408. The server's
protocol (``gatekeeper.bounded_h11``) offers it (scope extension ``kvgate.raw_body``) for a
``Content-Length`` body on a plain (not TLS) socket; ``PUT /v1/chunks`` takes it, any other route
reads through ASGI. It reads h11's private state: docs/server.md ("Raw paths") says why.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.errors import BadFrame

__all__ = ["EXTENSION", "ClientGone", "RawBody", "offer_raw_body"]

EXTENSION = "kvgate.raw_body"


class ClientGone(ClientDisconnect):
    """The client closed the connection before the body was all sent (Starlette's own
    ``ClientDisconnect``, as a body read through ASGI raises it)."""


class _Sink(asyncio.BufferedProtocol):
    """The transport's protocol while a view is filled: the kernel writes into the view."""

    def __init__(self, owner: Any, transport: Any, view: memoryview, done: asyncio.Event) -> None:
        self.owner, self.transport, self.view, self.done = owner, transport, view, done
        self.filled = 0
        self.lost: BaseException | None = None
        self.eof = False

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == self.view.nbytes:  # nothing more is ours: no read until the owner is back
            self.transport.pause_reading()
        self.done.set()

    def eof_received(self) -> None:
        self.eof = True  # a client that stops sending inside the body is gone: the transport closes
        self.done.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or ConnectionResetError("the connection was closed")
        self.done.set()
        self.owner.connection_lost(exc)


class RawBody:
    """The rest of the current request's body, read into caller buffers (see the module)."""

    def __init__(self, protocol: Any, timeout_s: float) -> None:
        self._p = protocol
        self.timeout_s = timeout_s

    def _reader(self) -> Any:
        reader = getattr(self._p.conn, "_reader", None)
        return reader if isinstance(reader, h11._readers.ContentLengthReader) else None

    def _readable(self) -> bool:
        """Whether the body can still be read here: h11 is reading it, or it has read all of it
        (uvicorn saw its end) and what is left of it waits in the cycle."""
        cycle = self._p.cycle
        if cycle is None or cycle.disconnected:
            return False
        return self._reader() is not None or not cycle.more_body

    def left(self) -> int:
        """Body bytes not yet read (through ASGI or here); 0 where this cannot read them."""
        if not self._readable():
            return 0
        reader = self._reader()
        return (int(reader._remaining) if reader is not None else 0) + len(self._p.cycle.body)

    async def readinto(self, view: memoryview) -> None:
        """Fill all of ``view`` with the next body bytes: ``ClientGone`` where the client went
        away, a 408 where the bytes stop coming, ``BadFrame`` for more than the body holds."""
        view = view.cast("B")
        n = view.nbytes
        p, cycle, reader = self._p, self._p.cycle, self._reader()
        if not self._readable():
            raise ClientGone("the client went away inside the body")
        if n > self.left():
            raise BadFrame("the body ends inside the frame")
        if cycle.waiting_for_100_continue and not p.transport.is_closing():
            # as uvicorn's ``receive`` does: a client that sent ``Expect: 100-continue`` waits for it
            p.transport.write(p.conn.send(h11.InformationalResponse(status_code=100, headers=[], reason="Continue")))
            cycle.waiting_for_100_continue = False
        filled = 0
        # 1. what uvicorn took out of h11 already, and no ``receive`` has handed on yet
        k = min(n, len(cycle.body))
        if k:
            view[:k] = cycle.body[:k]
            del cycle.body[:k]
            filled = k
        if reader is None:  # the body ended while nobody read it: all of the rest was in the cycle
            return
        # 2. what h11 holds of the body
        buf = p.conn._receive_buffer
        k = min(n - filled, len(buf._data), reader._remaining)
        if k:
            view[filled : filled + k] = buf._data[:k]
            del buf._data[:k]
            buf._next_line_search = buf._multiple_lines_search = 0
            reader._remaining -= k
            filled += k
        # 3. the rest straight from the socket
        if filled < n:
            await self._from_socket(view[filled:])
            reader._remaining -= n - filled
        if reader._remaining == 0 and not cycle.body:
            p.handle_events()  # h11 sees the body's end: uvicorn's next ``receive`` says so

    async def _from_socket(self, view: memoryview) -> None:
        p = self._p
        transport = p.transport
        done = asyncio.Event()
        sink = _Sink(p, transport, view, done)
        transport.set_protocol(sink)
        p.flow.resume_reading()
        if not transport.is_reading():
            transport.resume_reading()
        try:
            while sink.filled < view.nbytes:
                if sink.lost is not None or sink.eof:
                    raise ClientGone("the client went away inside the body")
                done.clear()
                try:
                    async with asyncio.timeout(self.timeout_s):
                        await done.wait()
                except TimeoutError:
                    raise HTTPException(408, "the request body did not arrive in time",
                                        headers={"Connection": "close"}) from None
        finally:
            if sink.lost is None and not transport.is_closing():
                transport.set_protocol(p)
                if not transport.is_reading():
                    transport.resume_reading()  # the owner's flow control decides from here
        if sink.filled < view.nbytes:
            raise ClientGone("the client went away inside the body")


def offer_raw_body(protocol: Any, timeout_s: float) -> None:
    """Put a ``RawBody`` in the scope's extensions of ``protocol``'s current cycle where its
    request has a ``Content-Length`` body over a plain socket. Called by the server's protocol
    (``gatekeeper.bounded_h11``) before the app reads the body; the route decides to use it."""
    cycle: Any = getattr(protocol, "cycle", None)
    scope = getattr(cycle, "scope", None)
    if cycle is None or not isinstance(protocol, H11Protocol) or not isinstance(scope, dict):
        return
    if EXTENSION in scope.get("extensions", ()):  # offered already (this is called per data_received)
        return
    if cycle.response_started:
        return
    transport = getattr(protocol, "transport", None)
    if transport is None or transport.get_extra_info("sslcontext") is not None:
        return
    if not all(hasattr(transport, a) for a in ("set_protocol", "is_reading", "resume_reading")):
        return
    conn = getattr(protocol, "conn", None)
    if not isinstance(conn, h11.Connection) or not hasattr(conn, "_receive_buffer"):
        return
    if not isinstance(getattr(conn, "_reader", None), h11._readers.ContentLengthReader):
        return
    if not isinstance(getattr(cycle, "body", None), bytearray):
        return
    if not all(hasattr(cycle, a) for a in ("more_body", "waiting_for_100_continue")):
        return
    extensions = scope.setdefault("extensions", {})
    if isinstance(extensions, dict):
        extensions.setdefault(EXTENSION, RawBody(protocol, timeout_s))
