"""A remote worker's side of shared-memory loads (``gateway.server.shm`` says why and how).

``attach`` asks the server, on a connection of its own to the Unix socket, for a region of
``nbytes`` and receives its file descriptor with the answer (``recvmsg``, ``SCM_RIGHTS``). The
worker maps it read-only: it only ever reads envelopes there, exactly as it reads those that
arrive in the stream (each is authenticated when opened).

Where the server keeps its memory tier's envelopes in an arena per namespace, the answer may also
carry a descriptor of the worker's namespace's arena (only for a capability that may write the
namespace), mapped beside the region. An item lent in place (status ``IN_ARENA``) is a read-only
view of the arena at the offset the item names, read with no copy at all; the server keeps such an
envelope where it is (neither reused nor moved) until the region is lent to the next load, which
is only once every view of this one is gone. A store seals straight into extents the server
reserved there for it (``ShmRegion.arena_slot``) and commits them by their place.

``ShmRegion.lend`` hands the whole region to one load at a time as a ``Window``; ``Window.take``
gives the view of each envelope the server put there, in order. The region is lent again only
once the load has ended and every view of it is gone (an envelope is opened, then let go), so
the server never writes where the worker still reads. A load that did not end cleanly (cut off,
cancelled, a broken frame) taints the region: it is never lent again (the server may still be
copying into it), and the client asks for a new one.
"""

from __future__ import annotations

import array
import fcntl
import json
import mmap
import os
import socket
import threading
import weakref
from typing import Any

import h11
import numpy as np

from gateway.errors import BadFrame, GatewayError
from gateway.protocol.shmpages import POPULATE_READ, aligned, populate_behind
from gateway.remote.wire import RemoteUnavailable, TornResponse, WirePool

__all__ = ["RegionCache", "ShmRegion", "Window", "attach"]

_MAX_ANSWER = 64 << 10


def attach(pool: WirePool, headers: list[tuple[str, str]], nbytes: int) -> tuple[int, Any]:
    """``POST /v1/shm/regions`` on a fresh connection to ``pool``'s Unix socket: ``(200,
    ShmRegion)``, or ``(status, the error body)``. Blocks (run it in a thread)."""
    if pool.uds is None:
        raise RemoteUnavailable("shared memory needs the server's Unix socket")
    body = json.dumps({"bytes": nbytes}).encode()
    if len(pool.requests) < 10_000:
        pool.requests.append("POST /v1/shm/regions")
    try:
        sock = pool._unix_socket()
    except OSError as exc:
        raise RemoteUnavailable(f"connecting to {pool.uds}: {type(exc).__name__}") from None
    fds: list[int] = []
    try:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(
            method="POST", target=f"{pool.prefix}/v1/shm/regions",
            headers=[("Host", pool.authority), ("Content-Length", str(len(body))), ("Connection", "close"), *headers],
        )
        sock.sendall(conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, answer = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data, ancdata, _flags, _addr = sock.recvmsg(65536, socket.CMSG_SPACE(4 * 4))
                for level, kind, cdata in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds += array.array("i", cdata[: len(cdata) - len(cdata) % 4])
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += event.data
                if len(answer) > _MAX_ANSWER:
                    raise TornResponse("the region's answer is too long")
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        if status != 200:
            return status, answer.decode("utf-8", "replace")
        got = json.loads(answer)
        arena = got.get("arena")
        if len(fds) != (1 if arena is None else 2):
            raise TornResponse(f"the region's answer came with {len(fds)} descriptors, not {1 if arena is None else 2}")
        arena_fd = fds.pop() if arena is not None else -1
        region_fd = fds.pop()
        region = ShmRegion(str(got["region"]), region_fd, int(got["bytes"]), arena_fd, int(arena or 0))
        if got.get("populate") is True:  # the server faults its side in: map ours ahead of the loads too
            region.populate_behind()
        return 200, region
    except h11.RemoteProtocolError as exc:
        raise TornResponse(f"the region's answer: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RemoteUnavailable(f"attaching a shared-memory region: {type(exc).__name__}: {exc}") from None
    finally:
        for fd in fds:
            os.close(fd)
        sock.close()


class ShmRegion:
    """A region the server writes envelopes into and this worker reads them from (read-only)."""

    def __init__(self, rid: str, fd: int, size: int, arena_fd: int = -1, arena_size: int = 0) -> None:
        """Maps ``fd`` (and closes it), and the arena ``arena_fd`` where one came (closed too);
        ``ValueError`` where either is not a sealed memfd of its size."""
        try:
            # not populated here: that would hold the first store back (``populate_behind``)
            self._mm = _map_sealed(fd, size)
            self._arena_mm = _map_sealed(arena_fd, arena_size, writable=True) if arena_fd >= 0 else None
        finally:
            os.close(fd)
            if arena_fd >= 0:
                os.close(arena_fd)
        self.arena = np.frombuffer(self._arena_mm, dtype=np.uint8) if self._arena_mm is not None else None
        self.id = rid
        self.size = size
        self._array = np.frombuffer(self._mm, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free = threading.Event()
        self._free.set()
        self.tainted = False
        self.populated = -1  # bytes mapped ahead of the loads once populating ended; -1 before
        self.lends = 0  # loads lent the region so far: the number of the last one
        # the number of the last load that ended with none of its views alive (None before one):
        # the server may reuse what that load read in place in the arena (a store's ``returned``)
        self.returned: int | None = None

    def populate_behind(self) -> None:
        """Map the region's pages on a nice-19 thread (``gateway.protocol.shmpages``), stopping if it is
        tainted (dropped)."""

        def done(n: int) -> None:
            self.populated = n

        populate_behind(self._array, POPULATE_READ, lambda: self.tainted, done)

    def lend(self, wait_s: float = 0.0) -> Window | None:
        """The whole region for one load, or None while another load (or its views) still has
        it after ``wait_s`` (the last views of a load that just ended go within moments)."""
        while True:
            with self._lock:
                if self.tainted:
                    return None
                if self._free.is_set():
                    self._free.clear()
                    self.lends += 1
                    return Window(self, self.lends)
            if wait_s <= 0 or not self._free.wait(wait_s):
                return None
            wait_s = 0.0

    def _returned(self, lend: int) -> None:
        with self._lock:
            self.returned = lend
        self._free.set()

    def view(self, offset: int, n: int, arena: bool = False) -> tuple[np.ndarray[Any, Any], memoryview]:
        """``n`` bytes at ``offset`` of the region (or of the arena), read-only, and the array
        that holds them."""
        source = self.arena if arena else self._array
        assert source is not None
        holder = source[offset : offset + n]
        return holder, holder.data.cast("B").toreadonly()

    def arena_slot(self, offset: int, n: int) -> memoryview:
        """The ``n`` bytes at ``offset`` of the arena, writable: an extent the server reserved for
        a store to seal into. ValueError past the arena (or where none is mapped)."""
        if self.arena is None or offset < 0 or n <= 0 or offset + n > self.arena.nbytes:
            raise ValueError("a reserved extent lies past the arena (or no arena is mapped)")
        return self.arena[offset : offset + n].data.cast("B")


def _map_sealed(fd: int, size: int, *, writable: bool = False) -> mmap.mmap:
    """A mapping of ``size`` bytes of the memfd ``fd`` (read-only unless ``writable``); ValueError
    where it is not a memfd of that size sealed against shrinking (the server writes into it
    while it is mapped)."""
    st = os.fstat(fd)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if st.st_size < size or size <= 0 or not seals & fcntl.F_SEAL_SHRINK:
        raise ValueError(f"not a sealed region of {size} bytes")
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))


class RegionCache:
    """The regions of one worker process, one per tenant, shared by its clients (a connector makes
    a client per capability; they all lend the same region). ``get`` attaches where there is
    none (through ``attach_fn``), and after a refusal waits ``retry_s`` before asking again."""

    def __init__(self, nbytes: int, retry_s: float = 30.0) -> None:
        self.nbytes = nbytes
        self.retry_s = retry_s
        self._regions: dict[str, ShmRegion] = {}
        self._retry_at: dict[str, float] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def _lock(self, tenant: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(tenant, threading.Lock())

    def get(self, tenant: str, attach_fn: Any, now: float) -> tuple[ShmRegion | None, str | None]:
        """(Blocking, in a thread.) ``(region, None)``; ``(None, why)`` where the server refused
        one just now; ``(None, None)`` while a refusal is recent (nothing asked). ``attach_fn()``
        returns ``(status, region or error body)``."""
        with self._lock(tenant):
            region = self._regions.get(tenant)
            if region is not None and not region.tainted:
                return region, None
            self._regions.pop(tenant, None)
            if now < self._retry_at.get(tenant, 0.0):
                return None, None
            try:
                status, got = attach_fn()
            except GatewayError as exc:
                status, got = 0, str(exc)
            if status != 200:
                self._retry_at[tenant] = now + self.retry_s
                return None, f"{status} {str(got)[:200]}"
            self._regions[tenant] = got
            return got, None

    def in_place(self) -> bool:
        """Whether a region of this process came with its namespace's arena (loads read there)."""
        return any(r.arena is not None and not r.tainted for r in list(self._regions.values()))

    def cached(self, tenant: str) -> ShmRegion | None:
        region = self._regions.get(tenant)
        return region if region is not None and not region.tainted else None


class Window:
    """One load's use of a region: the views of the envelopes in it, in the server's order."""

    def __init__(self, region: ShmRegion, lend: int = 0) -> None:
        self.region = region
        self.lend = lend  # the region's number for this load (``ShmRegion.lends``)
        self.offset, self.length = 0, region.size
        self._cursor = 0
        self._out = 0  # views handed out and still alive
        self._ended = False
        self.settled = False  # the server has answered every item: it writes nothing more here
        self._lock = threading.Lock()

    def request(self) -> dict[str, Any]:
        lend = {"region": self.region.id, "offset": self.offset, "length": self.length}
        return {**lend, "arena": True, "lend": self.lend} if self.region.arena is not None else lend

    def take(self, n: int, arena_offset: int | None = None) -> memoryview:
        """The next envelope's bytes (``n`` of them) in the window, or those at ``arena_offset``
        of the arena (an item lent in place); BadFrame past the window or the arena."""
        if arena_offset is not None:
            arena = self.region.arena
            if arena is None or n <= 0 or arena_offset + n > arena.nbytes:
                raise BadFrame("an item's envelope lies past the arena (or no arena was mapped)")
            holder, view = self.region.view(arena_offset, n, arena=True)
        else:
            at = self._cursor
            if n <= 0 or at + n > self.length:
                raise BadFrame("an item's envelope lies past the shared-memory window")
            self._cursor = aligned(at + n)
            holder, view = self.region.view(self.offset + at, n)
        with self._lock:
            self._out += 1
        weakref.finalize(holder, self._released)
        return view

    def _released(self) -> None:
        with self._lock:
            self._out -= 1
            back = self._ended and self._out == 0
        if back:
            self.region._returned(self.lend)

    def end(self, clean: bool) -> None:
        """The load is over: the region is lent again once its views are gone, unless the load
        ended neither ``clean`` nor ``settled`` (then it is tainted: the server may still be
        writing into it)."""
        if not (clean or self.settled):
            self.region.tainted = True
        with self._lock:
            self._ended = True
            back = self._out == 0
        if back:
            self.region._returned(self.lend)
