"""Shared-memory loads for workers on the server's Unix socket (``Settings.shm_max_bytes``).

The server copies each envelope once into memory the worker maps; the stream carries the item's
head. ``POST /v1/shm/regions`` (``get`` capability, Unix socket only) creates a bounded memfd,
sealed against shrinking and growing, maps it and passes the descriptor (``SCM_RIGHTS``); a random
128-bit id names it, never a path. ``POST /v1/chunks/fetch`` with ``"keys": true`` and ``"shm":
{"region", "offset", "length"}`` lends that window: envelopes that fit are copied in (64-byte
aligned, status ``IN_REGION``), others come in the stream. A window outside the region is a 422;
an unknown region or another tenant's or uid's is used for nothing (``x-kv-shm: gone``).

With ``shm_arenas``, the answer also hands a descriptor of the caller's namespace's arena of the
memory tier (only to a capability that may write the namespace) and a fetch that says ``"arena":
true`` lends the envelopes held there in place (status ``IN_ARENA``, their offsets): no copy.
Their extents stay leased (``Region.leases``) until the region is lent again or dropped, or a
store's reservation says that load has ended (``returned``: the worker's number for it). A store
seals into extents reserved there with its keys (``Region.uploads``, ``add_upload``) and commits
them by their place; a region with a live reservation is not dropped to make room.

Invariants: the worker lends a window only while nothing of it is in use, and drops a region a cut
load tainted. The region holds only the caller's tenant's ciphertext, checked by the worker as a
received envelope is; the server never reads it. Memory is bounded (``shm_max_bytes``, off by
default; a quarter per tenant; ``max_regions``; creations per minute per tenant and uid) and a
dropped region's pages are punched out. Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np

from gateway.errors import ChunkMissing, GatewayError, InvalidRequest
from gateway.protocol.shmpages import ALIGN, POPULATE_WRITE, aligned, populate_behind

__all__ = [
    "ALIGN", "MAX_UPLOADS", "UPLOAD_TTL_S", "CopyAhead", "Hold", "Region", "Regions", "ReservationMissing", "ShmUnavailable",
    "Upload", "add_upload", "aligned", "copy_into", "make_region", "returned", "send_with_fd",
]

log = logging.getLogger("kvgate.shm")

_CREATES_PER_MINUTE = 8
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_SEAL_SHRINK") else 0


class ShmUnavailable(GatewayError):
    """Shared memory cannot be had here (not Linux, not a Unix socket, or over the limits)."""


class ReservationMissing(ChunkMissing):
    """A commit names no reservation of the caller's (expired, given back, its region dropped, or
    reserved for another namespace): the envelopes sealed there are not stored."""


@dataclass(eq=False)
class Region:
    id: str
    tenant: str
    owner: str  # the peer's uid as the kernel reported it (``unix:uid=U``)
    size: int
    mm: mmap.mmap = field(repr=False)
    view: np.ndarray = field(repr=False)
    busy: int = 0  # fetches writing into it now (or about to)
    last_used: float = 0.0
    closed: bool = False
    populated: int = -1  # bytes faulted in ahead of the copies once that ended (gateway.protocol.shmpages); -1 before
    # the group (namespace label) whose memory-tier arena was handed over with the region, if any
    arena_group: str | None = None
    # the memory tier's views of the envelopes the last fetch lent in place from that arena: those
    # extents are neither reused nor moved until the next fetch lends this region (the worker lends
    # it only once every view of the load before is gone) or it is dropped
    leases: list[memoryview] = field(default_factory=list, repr=False)
    lent: int | None = None  # the worker's number for that fetch's load (``ShmWindow.lend``), if it said
    # stores the worker seals straight into that arena: extents reserved for them, by upload id,
    # each given back unless committed before it expires
    uploads: dict[str, Upload] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        """Free its pages (whoever still maps them: the worker's descriptor keeps holes) and unmap."""
        self.closed = True
        self.leases = []
        for up in self.uploads.values():
            up.batch.abort()
        self.uploads = {}
        self.view = np.empty(0, dtype=np.uint8)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            self.mm.madvise(mmap.MADV_REMOVE)
        with contextlib.suppress(BufferError):  # a copy still holds a view: unmapped when it goes
            self.mm.close()


class Aborts(Protocol):
    def abort(self) -> None: ...


@dataclass(eq=False)
class Upload:
    """Extents of the arena reserved for one store the worker seals in place (an upload batch,
    ``gateway.chunks.batches``), until ``expires`` (``time.monotonic``)."""

    batch: Aborts
    expires: float
    capability: str = field(default="", repr=False)  # the one the extents were reserved under


UPLOAD_TTL_S = 120.0  # an upload not committed by then is given back (the worker is gone or stuck)
MAX_UPLOADS = 64  # per region at once: a worker stores one prefix at a time per session


def add_upload(region: Region, batch: Aborts, now: float, capability: str = "") -> str | None:
    """Keep ``batch`` on ``region`` under a fresh random id (None, and the batch given back, where
    the region already keeps ``MAX_UPLOADS``); uploads past their time are given back first."""
    for uid in [u for u, up in region.uploads.items() if up.expires <= now]:
        region.uploads.pop(uid).batch.abort()
    if region.closed or len(region.uploads) >= MAX_UPLOADS:
        batch.abort()
        return None
    uid = secrets.token_hex(16)
    region.uploads[uid] = Upload(batch, now + UPLOAD_TTL_S, capability)
    return uid


def returned(region: Region, lend: int | None) -> None:
    """The worker says its load ``lend`` of ``region`` has ended with none of its views alive:
    where that is the load the leases keep (no later fetch lent the region), they go now, and the
    extents it read in place may be reused (a store after a hit seals where the hit read). An
    older number changes nothing; a worker that lies loses only its own reads' authentication."""
    if lend is not None and region.lent == lend:
        region.leases, region.lent = [], None


def _owner(client: str) -> str | None:
    """``unix:uid=U`` of a Unix-socket peer's source (``listen.peer_source``), else None."""
    if not client.startswith("unix:uid="):
        return None
    return client.split(":pid=", 1)[0]


class Hold:
    """A fetch's use of a region: the region stays ``busy`` (never dropped) until ``release``,
    which counts once whoever calls it first (the stream's end, an error before the stream
    starts, or ``tie``: the stream collected without ever starting)."""

    __slots__ = ("__weakref__", "_held", "region")

    def __init__(self, region: Region) -> None:
        self.region = region
        self._held = True
        region.busy += 1

    def release(self) -> None:
        if self._held:
            self._held = False
            self.region.busy = max(0, self.region.busy - 1)

    def tie(self, owner: object) -> None:
        """Release when ``owner`` is collected (if nothing released it before)."""
        weakref.finalize(owner, self.release)


def copy_into(dst: np.ndarray, src: memoryview) -> None:
    np.copyto(dst, np.frombuffer(src, dtype=np.uint8))  # numpy lets go of the GIL for the copy


T = TypeVar("T")


class CopyAhead(Generic[T]):
    """A fetch's copies into its window, each run in a thread one ahead of the item that
    announces it: ``push`` starts an envelope's copy as soon as the tier has handed it over and
    only then waits for the copy before it, so the copies follow one another (two at most at
    once) while the event loop reads the tier and writes the items. An item is handed back only
    once its own copy has ended: the worker reads an envelope only after its item."""

    def __init__(self, copy: Callable[[np.ndarray, memoryview], None] = copy_into) -> None:
        self._copy = copy
        self._inflight: tuple[asyncio.Future[None], T] | None = None

    async def push(self, dst: np.ndarray, src: memoryview, item: T) -> T | None:
        """Start copying ``src`` into ``dst``, to be announced by ``item``; the item of the copy
        before it, once that one has ended (None if there was none). Raises what that copy raised."""
        task = asyncio.ensure_future(asyncio.to_thread(self._copy, dst, src))
        before, self._inflight = self._inflight, (task, item)
        return await _ended(before)

    async def drain(self) -> T | None:
        """The item of the copy in flight, once it has ended (None if there is none)."""
        before, self._inflight = self._inflight, None
        return await _ended(before)

    async def settle(self) -> None:
        """Wait, without raising, until no copy writes any more (a fetch cut short lets its region
        go only then)."""
        before, self._inflight = self._inflight, None
        if before is not None:
            await asyncio.wait([before[0]])
            if not before[0].cancelled():
                before[0].exception()  # retrieved: the fetch it belonged to has ended anyway


async def _ended(copy: tuple[asyncio.Future[None], T] | None) -> T | None:
    """The item of ``copy`` once the copy has ended (raising what it raised); None for no copy."""
    if copy is None:
        return None
    await copy[0]
    return copy[1]


class Regions:
    """The server's regions: created, looked up for a fetch, dropped (LRU past the limits)."""

    def __init__(self, max_bytes: int, max_regions: int = 64, max_region_bytes: int = 4 << 30, *, populate: bool = True) -> None:
        self.max_bytes = max_bytes
        self.populate = populate
        self.max_regions = max_regions
        self.max_region_bytes = max_region_bytes
        self._regions: OrderedDict[str, Region] = OrderedDict()
        self.bytes = 0
        self._pending = 0  # bytes of regions being made (in a thread) now
        self._pending_n = 0
        self._creates: dict[tuple[str, str], list[float]] = {}

    @property
    def tenant_max_bytes(self) -> int:
        return max(self.max_bytes // 4, min(self.max_region_bytes, self.max_bytes))
    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0 and hasattr(os, "memfd_create") and bool(_SEALS)

    def create(self, tenant: str, client: str, size: int) -> tuple[Region, int]:
        """A new region for ``tenant``'s worker at ``client`` (its source); ``(region, fd)``: the
        caller sends ``fd`` to the worker and closes it. ``InvalidRequest`` for a size out of
        range or a peer that is not on the Unix socket; ``ShmUnavailable`` where none can be had."""
        size, owner = self.admit(tenant, client, size)
        return self.register(tenant, owner, size, *make_region(size))

    async def acreate(self, tenant: str, client: str, size: int) -> tuple[Region, int]:
        """``create``, with the memory made in a thread, off the loop."""
        size, owner = self.admit(tenant, client, size)
        self._pending += size
        self._pending_n += 1
        making = asyncio.ensure_future(asyncio.to_thread(make_region, size))
        try:
            made = await asyncio.shield(making)
        except asyncio.CancelledError:  # the request went away: what the thread makes is let go
            making.add_done_callback(_discard)
            raise
        finally:
            self._pending -= size
            self._pending_n -= 1
        return self.register(tenant, owner, size, *made)

    def admit(self, tenant: str, client: str, size: int) -> tuple[int, str]:
        """The size (aligned) and owner of a region that may be made now (room is made for it)."""
        owner = _owner(client)
        if owner is None:  # the caller's mistake (422) before the server's state (503)
            raise InvalidRequest("shared memory is for workers on the server's Unix socket")
        if not self.enabled:
            raise ShmUnavailable("shared memory is off on this server (shm_max_bytes = 0, or not Linux)")
        if not ALIGN <= size <= min(self.max_region_bytes, self.max_bytes):
            raise InvalidRequest(f"a region is {ALIGN} to {min(self.max_region_bytes, self.max_bytes)} bytes, not {size}")
        size = aligned(size)
        now = time.monotonic()
        recent = [t for t in self._creates.get((tenant, owner), []) if now - t < 60.0]
        if len(recent) >= _CREATES_PER_MINUTE:
            raise ShmUnavailable("too many regions asked for in the last minute")
        self._make_room(size, tenant)
        recent.append(now)
        self._creates[(tenant, owner)] = recent
        if len(self._creates) > 4096:  # old entries of peers gone
            self._creates = {k: v for k, v in self._creates.items() if now - v[-1] < 60.0}
        return size, owner

    def register(self, tenant: str, owner: str, size: int, mm: mmap.mmap, fd: int) -> tuple[Region, int]:
        region = Region(secrets.token_hex(16), tenant, owner, size, mm, np.frombuffer(mm, dtype=np.uint8), last_used=time.monotonic())
        self._regions[region.id] = region
        self.bytes += size
        if self.populate:
            populate_behind(region.view, POPULATE_WRITE, lambda: region.closed, lambda n: _populated(region, n))
        log.info("shared-memory region %s… of %d bytes for tenant %s (%s)", region.id[:8], size, tenant, owner)
        return region, fd

    def _make_room(self, size: int, tenant: str) -> None:
        """Room for a region of ``size`` for ``tenant``, or ``ShmUnavailable`` with nothing
        dropped: idle regions go least recently used first, the tenant's own before anyone
        else's, and another tenant's only for the server's limits, never for this tenant's."""
        regions = self._regions
        own = [rid for rid in regions if regions[rid].tenant == tenant]
        own_bytes = sum(regions[rid].size for rid in own)
        drop: list[str] = []
        for rid in own:  # the tenant's quota: only its own regions can make room in it
            if own_bytes + size <= self.tenant_max_bytes:
                break
            if not _in_use(regions[rid]):
                drop.append(rid)
                own_bytes -= regions[rid].size
        if own_bytes + size > self.tenant_max_bytes:
            raise ShmUnavailable("this tenant's shared memory is all in use")
        total = self.bytes + self._pending - sum(regions[rid].size for rid in drop)
        count = len(regions) + self._pending_n - len(drop)
        for rid in [*own, *(r for r in regions if regions[r].tenant != tenant)]:
            if total + size <= self.max_bytes and count < self.max_regions:
                break
            if rid not in drop and not _in_use(regions[rid]):
                drop.append(rid)
                total -= regions[rid].size
                count -= 1
        if total + size > self.max_bytes or count >= self.max_regions:
            raise ShmUnavailable("the server's shared memory is all in use")
        for rid in drop:
            self.drop(rid)

    def get(self, rid: str, tenant: str, client: str) -> Region | None:
        """The region ``rid`` where it is this tenant's and this peer's, else None (never says
        which: an id of someone else's region is answered as an unknown one)."""
        region = self._regions.get(rid)
        if region is None or region.tenant != tenant or region.owner != _owner(client):
            return None
        region.last_used = time.monotonic()
        self._regions.move_to_end(rid)
        return region

    def hold(self, rid: str, tenant: str, client: str, lend: int | None = None) -> Hold | None:
        """``get``, for a fetch that copies into it: held (``busy``) until the ``Hold`` is
        released, so it is not dropped under the copies. The worker lends a region to one load
        at a time, so the envelopes the fetch before lent in place are read: their leases go, and
        this fetch's are of the worker's load ``lend``."""
        region = self.get(rid, tenant, client)
        if region is None:
            return None
        region.leases, region.lent = [], lend
        return Hold(region)

    def drop(self, rid: str) -> None:
        region = self._regions.pop(rid, None)
        if region is not None:
            self.bytes -= region.size
            region.close()

    def close(self) -> None:
        for rid in list(self._regions):
            self.drop(rid)


def _in_use(region: Region) -> bool:
    """A fetch copies into it, or a store's extents reserved in its arena are not committed yet
    (dropping it would give them back under the worker's seals)."""
    now = time.monotonic()
    return bool(region.busy) or any(up.expires > now for up in region.uploads.values())


def _populated(region: Region, n: int) -> None:
    """The end of a region's populating thread (which still holds a view: the mapping is there)."""
    region.populated = n
    if region.closed:  # dropped while it ran: punch out what its last step faulted in again
        with contextlib.suppress(OSError, ValueError):
            region.mm.madvise(mmap.MADV_REMOVE)


def _discard(fut: asyncio.Future[tuple[mmap.mmap, int]]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        mm, fd = fut.result()
        os.close(fd)
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_REMOVE)
        mm.close()


def make_region(size: int) -> tuple[mmap.mmap, int]:
    """A sealed memfd of ``size`` bytes and its read-write mapping: ``(mapping, fd)``.
    ``ShmUnavailable`` where the system refuses one (no descriptors or memory left).

    Not populated here (``gateway.protocol.shmpages`` says why): populating a whole region when a
    tenant's worker first stores would hold that store back."""
    try:
        fd = os.memfd_create("kvgate-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except OSError as exc:
        raise ShmUnavailable(f"no shared memory from the system: {exc.strerror}") from None
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), fd
    except OSError as exc:
        os.close(fd)
        raise ShmUnavailable(f"no shared memory from the system: {exc.strerror}") from None
    except BaseException:
        os.close(fd)
        raise


def send_with_fd(sock_fd: int, data: bytes, fds: Sequence[int]) -> None:
    """``data`` with ``fds`` attached (``SCM_RIGHTS``) on the connected Unix socket ``sock_fd``,
    whole (it is small, and the socket's buffer is empty: ``ShmUnavailable`` otherwise)."""
    with socket.socket(fileno=os.dup(sock_fd)) as sock:
        if sock.family != socket.AF_UNIX:
            raise ShmUnavailable("a descriptor can only be passed on a Unix socket")
        try:
            sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))], socket.MSG_DONTWAIT)
        except OSError as exc:
            raise ShmUnavailable(f"passing the region: {type(exc).__name__}") from None
        if sent != len(data):
            raise ShmUnavailable("passing the region: the socket took part of it")
