"""The fetch stream's envelopes written to the connection as they are.

``RawChunks`` writes each item (head and envelope) as one HTTP/1.1 chunk straight to the
transport, from the tier's own buffer, without h11's join of chunk header, data and CRLF into a
fresh ``bytes``. It keeps uvicorn's flow control (it waits while the transport is paused, so a slow
reader still holds the server to about one envelope); the response head and last chunk still go
through h11, which does not count a chunked body's bytes, so its state stays right and the
connection is kept alive. ``gatekeeper.bounded_h11`` (uvicorn's h11 protocol) offers it in every
request's scope extensions (``kvgate.raw_chunks``); a route that wants it (``POST
/v1/chunks/fetch``, ``POST /v1/shm/regions``) uses it once h11 chose chunked framing, and streams
through ASGI otherwise. It reads h11's private writer: docs/server.md ("Raw paths") says why.

``send_fd`` writes one chunk with file descriptors attached (``SCM_RIGHTS``): how a
shared-memory region reaches a worker on the Unix socket (``gateway.server.shm``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import h11

from gateway.server.shm import ShmUnavailable, send_with_fd

__all__ = ["EXTENSION", "RawChunks", "offer_raw_chunks"]

EXTENSION = "kvgate.raw_chunks"
_CYCLE_MODULE = "uvicorn.protocols.http.h11_impl"


class RawChunks:
    """Chunks of a chunked response written straight to uvicorn's transport (see the module)."""

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def usable(self) -> bool:
        """Whether the response head was sent with chunked framing (then ``write`` may be used)."""
        c = self._cycle
        writer = getattr(c.conn, "_writer", None)
        return bool(c.response_started and not c.response_complete and isinstance(writer, h11._writers.ChunkedWriter))

    async def write(self, parts: Sequence[bytes | memoryview]) -> bool:
        """``parts`` as one chunk; False where the client is gone (nothing written)."""
        c = self._cycle
        if c.flow.write_paused and not c.disconnected:
            await c.flow.drain()
        if c.disconnected:
            return False
        n = sum(memoryview(p).nbytes for p in parts)
        if n == 0:
            return True
        transport = c.transport
        transport.write(b"%x\r\n" % n)
        for p in parts:
            transport.write(p)
        transport.write(b"\r\n")
        return True

    async def send_fd(self, data: bytes, fds: Sequence[int]) -> None:
        """``data`` as one chunk, ``fds`` passed with it: on the connection's own socket, once
        everything written before has left (the descriptors must travel with these bytes).
        ``ShmUnavailable`` where it cannot be sent; the connection is then closed (its
        response is cut, and the client sees it so)."""
        c = self._cycle
        if c.flow.write_paused and not c.disconnected:
            await c.flow.drain()
        transport = c.transport
        sock = transport.get_extra_info("socket")
        try:
            if c.disconnected or sock is None or transport.get_write_buffer_size():
                raise ShmUnavailable("the connection is not ready for a descriptor")
            send_with_fd(sock.fileno(), b"%x\r\n" % len(data) + data + b"\r\n", fds)
        except ShmUnavailable:
            transport.close()
            raise


def offer_raw_chunks(cycle: Any) -> None:
    """Put a ``RawChunks`` in the scope's extensions of ``cycle`` (uvicorn's h11
    ``RequestResponseCycle``, just made: its app has not started). Called by the server's
    protocol (``gatekeeper.bounded_h11``); the route decides to use it."""
    scope = getattr(cycle, "scope", None)
    if type(cycle).__module__ != _CYCLE_MODULE or not isinstance(scope, dict):
        return
    if EXTENSION in scope.get("extensions", ()) or cycle.response_started:
        return
    if not all(hasattr(cycle, a) for a in ("conn", "transport", "flow", "disconnected", "response_complete")):
        return
    if not isinstance(cycle.conn, h11.Connection):
        return
    extensions = scope.setdefault("extensions", {})
    if isinstance(extensions, dict):
        extensions.setdefault(EXTENSION, RawChunks(cycle))
