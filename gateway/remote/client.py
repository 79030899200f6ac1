"""Remote mode: a worker that holds no tier credentials talks to a kvgate server.

``RemoteGateway(base_url, bearer_token)`` mirrors ``gateway.services.core.Gateway``'s data operations
(``store`` / ``lookup`` / ``retrieve``; it mints and renews its own capability) and does on the
worker everything that touches plaintext, with the core's own data path: this module is only
the ``ChunkStore`` that speaks HTTP. A store asks once for its envelopes' keys
(``POST /v1/keys/envelopes``) and sends them in framed batches (``PUT /v1/chunks``, in the
background while the next chunks are sealed); a load is one streamed ``POST /v1/chunks/fetch``
whose envelopes each arrive after the key that opens them, or, through the Unix socket with
``shm_bytes``, in a shared-memory region. The worker never holds the tenant's data key. A chunk
that fails authentication ends the loaded prefix (a miss, never handed to the engine) and is
reported to the server, which audits it and drops that copy. A 403 drops the cached capability
and retries once with a fresh one; an upload refused because a clear ended the epoch it was sealed
for (409 ``namespace-changed``) is a store that did not happen.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Self

import httpx
import torch

from crypto.envelope import ChunkCipher, EnvelopeContext, EnvelopeKeys, IssuedKey
from gateway.chunking import Chunk
from gateway.datapath.path import DataPath
from gateway.datapath.plane import DataPlane
from gateway.datapath.stores import Fetched, FetchFailed, KeyRef, Presence, Reserved
from gateway.errors import AccessDenied, BadFrame, GatewayError, InvalidRequest
from gateway.metrics import Metrics, TierReason
from gateway.protocol import frames
from gateway.remote.shm import RegionCache, ShmRegion, Window, attach
from gateway.remote.status import check, error_for
from gateway.remote.wire import Exchange, RemoteUnavailable, WirePool, receive_buffers
from gateway.types import KVModel, LookupResult, RetrieveResult, StoreResult
from tenancy.capabilities import read_unverified

__all__ = ["Connections", "RemoteGateway", "RemoteUnavailable", "http_client"]

_MARGIN_S = 15.0  # renew a capability this long before it expires
_SHM_RETRY_S = 30.0  # after a region was refused, ask again this much later
_SHM_WAIT_S = 0.05  # how long a load waits for the region to come back from the one before
_SHM_ASK_WAIT_S = 1.0  # how long a store waits for the region being asked for (a local call: milliseconds)
log = logging.getLogger("kvgate.remote")
_KEYS_PER_CALL = 4096  # the server's bound per key request
_CONNECTIONS = 8  # the connection pool's bound (keep-alive connections included)
_BATCH_BYTES = 64 << 20  # an upload batch is sent once this many envelope bytes are buffered
_BATCH_ITEMS = 1024  # ... or this many envelopes (the server takes up to max_batch_items)
_FETCH_ITEMS = 4096  # hashes per streamed fetch (the server's bound)
_MAX_ENVELOPE = 1 << 32  # a response item larger than this is a broken frame, not an allocation
_BATCH_MEDIA = "application/octet-stream"


@dataclass(slots=True)
class _Cap:
    token: str
    expires_at: float


def http_client(timeout_s: float, *, ssl_context: ssl.SSLContext | None = None, uds: str | None = None) -> httpx.AsyncClient:
    """The httpx client of a worker's control calls (capabilities, keys, admin); ``uds``: through
    the server's Unix socket at that path."""
    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
    limits = httpx.Limits(max_connections=_CONNECTIONS, max_keepalive_connections=_CONNECTIONS)
    transport = httpx.AsyncHTTPTransport(uds=uds, verify=verify, limits=limits) if uds else None
    return httpx.AsyncClient(timeout=timeout_s, limits=limits, verify=verify, transport=transport)


class Connections:
    """A worker's connections to one kvgate server: the httpx client of its control calls
    (``http``) and the data plane's connection pool (``wire``, ``gateway.remote.wire``). Whoever
    makes it closes it (``aclose``); the ``RemoteGateway``s it is handed to share it and leave it
    open (the vLLM backend shares one between the clients of many capabilities). ``http``: an
    httpx client of the caller's (closed with this object) instead of ``http_client``'s."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 30.0, ssl_context: ssl.SSLContext | None = None,
        uds: str | None = None, http: httpx.AsyncClient | None = None,
    ) -> None:
        if uds is not None and not uds:
            raise InvalidRequest("uds must be the path of the server's Unix socket (or None)")
        self.base_url = base_url.rstrip("/")
        self.uds = uds
        self.http = http or http_client(timeout_s, ssl_context=ssl_context, uds=uds)
        self.wire = WirePool(self.base_url, timeout_s=timeout_s, connections=_CONNECTIONS, ssl_context=ssl_context, uds=uds)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.wire.close()
        await self.http.aclose()


class RemoteGateway:
    """A worker's client of a kvgate server. ``connections`` may be shared (then it is not closed here)."""

    def __init__(
        self,
        base_url: str,
        bearer_token: str,
        *,
        connections: Connections | None = None,
        namespace: str = "default",
        chunk_tokens: int = 256,
        ops: Sequence[str] = ("lookup", "get", "put"),
        capability_ttl: int = 300,
        segment_bytes: int = 2 << 20,
        threads: int = 2,
        device_cipher: str = "auto",
        device_aes: str = "auto",
        ssl_context: ssl.SSLContext | None = None,
        uds: str | None = None,
        store_nice: int = 0,
        store_prefault: bool = True,
        shm_bytes: int = 0,
        shm_cache: RegionCache | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """``uds``: reach the server through its Unix socket at that path (a server on this host,
        ``kvgate serve --uds``), every call: the control calls over httpx and the data plane
        alike; ``base_url`` still names it. Shared ``connections`` must already go there
        (``RemoteBackend`` builds them so); without them the client makes and closes its own.
        ``store_nice``: the nice value of the threads
        that seal stores (``gateway.datapath.path``); ``store_prefault``: whether a store faults
        its reserved slots in behind its seals (the same). ``shm_bytes`` (with ``uds``): the size of
        the shared-memory region loads borrow (0: none; the module docstring says how); clients of
        one process share their regions (one per tenant) through ``shm_cache``."""
        if chunk_tokens <= 0:
            raise InvalidRequest("chunk_tokens must be positive")
        if uds is not None and not uds:
            raise InvalidRequest("uds must be the path of the server's Unix socket (or None)")
        if shm_bytes < 0 or (shm_bytes and uds is None):
            raise InvalidRequest("shm_bytes is a size (>= 0), and needs uds: shared memory is for a server on this host")
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.ops = sorted(set(ops))
        self.capability_ttl = capability_ttl
        self._bearer = bearer_token
        self._own_connections = connections is None
        self._connections = connections or Connections(self.base_url, ssl_context=ssl_context, uds=uds)
        self._http = self._connections.http
        self._wire = self._connections.wire
        self._plane = DataPlane(
            DataPath(
                ChunkCipher(segment_bytes=segment_bytes), threads, device_cipher=device_cipher, device_aes=device_aes,
                store_nice=store_nice, store_prefault=store_prefault,
            ),
            chunk_tokens, metrics or Metrics(),
        )
        self._cap: _Cap | None = None
        self.metrics: Metrics = self._plane.metrics
        self._shm = (shm_cache or RegionCache(shm_bytes, _SHM_RETRY_S)) if shm_bytes else None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self._forget()
        self._plane.datapath.close()
        if self._own_connections:
            await self._connections.aclose()

    # -- HTTP --------------------------------------------------------------------------------
    async def _send(self, method: str, path: str, *, cap: bool = True, **kw: Any) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self._bearer}", **kw.pop("headers", {})}
        if cap:
            headers["X-KV-Capability"] = await self.capability()
        try:
            r = await self._http.request(method, self.base_url + path, headers=headers, **kw)
        except httpx.HTTPError as exc:
            raise RemoteUnavailable(f"{method} {path}: {type(exc).__name__}") from None
        check(r.status_code, f"{method} {path}", r.text)
        return r

    async def _retrying(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One retry with a fresh capability after a 403 (revoked by a clear, or its key budget spent)."""
        try:
            return await self._send(method, path, **kw)
        except AccessDenied:
            self._forget()
            return await self._send(method, path, **kw)

    def _data_headers(self, capability: str, content_type: str) -> list[tuple[str, str]]:
        # X-KV-Shared-Reads: this worker opens each fetched chunk in the context the server names
        # (a published prefix's scope, X-KV-Shared), so lookups and fetches may read one
        return [
            ("Authorization", f"Bearer {self._bearer}"), ("X-KV-Capability", capability), ("Content-Type", content_type),
            ("X-KV-Shared-Reads", "1"),
        ]

    async def _wire_call(
        self, method: str, path: str, fn: Callable[..., tuple[int, Any]], *args: Any, retry: bool = True,
    ) -> Any:
        """``fn(exchange, headers, *args)`` on the data plane's own client (``gateway.remote.wire``), in one
        of its threads: ``fn`` starts the request and reads the answer, returning ``(status,
        result)``. A 2xx is ``result``; otherwise the error of ``gateway.remote.status``'s table,
        after one retry with a fresh capability on an ``AccessDenied`` (revoked by a clear, or its
        key budget spent) where ``retry`` (never for an upload: its envelopes were sealed for the
        revoked scope)."""
        for attempt in (0, 1) if retry else (1,):
            headers = self._data_headers(await self.capability(), _BATCH_MEDIA if method == "PUT" else "application/json")
            status, result = await self._wire.run(fn, headers, *args)
            error = error_for(status, f"{method} {path}", str(result))
            if error is None:
                return result
            if isinstance(error, AccessDenied) and attempt == 0:
                self._forget()
                continue
            raise error
        raise AssertionError("unreachable")

    def _forget(self) -> None:
        """Drop the capability (after a revocation); keys are held only by a request's session."""
        self._cap = None

    async def _region(self) -> ShmRegion | None:
        """This tenant's shared-memory region (asked for where there is none), or None."""
        if self._shm is None:
            return None
        cap = await self.capability()
        tenant = read_unverified(cap).tenant
        region = self._shm.cached(tenant)
        if region is not None:
            return region
        headers = self._data_headers(cap, "application/json")
        shm = self._shm
        region, why = await asyncio.to_thread(shm.get, tenant, lambda: attach(self._wire, headers, shm.nbytes), time.monotonic())
        if region is None and why is not None:
            self.metrics.shm_unavailable += 1
            log.info("kvgate: no shared-memory region from the server (%s): loads go through the socket", why)
        return region

    def prepare_region(self) -> None:
        """Ask for the region in the background (a store comes before the loads of its prefix),
        so that the first load finds it mapped."""
        if self._shm is None or self._tasks:
            return
        task = asyncio.ensure_future(self._region())
        self._tasks.add(task)
        task.add_done_callback(self._region_asked)

    def _region_asked(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("kvgate: asking for a shared-memory region: %s", task.exception())

    async def _arena_region(self) -> ShmRegion | None:
        """This tenant's region where it is mapped and came with its namespace's arena (a store
        seals there), else None. A store never asks for one itself, but waits a moment for the one
        this client is asking for now (its first store would otherwise send every envelope)."""
        if self._shm is None:
            return None
        tenant = read_unverified(await self.capability()).tenant
        region = self._shm.cached(tenant)
        if region is None and self._tasks:
            await asyncio.wait(set(self._tasks), timeout=_SHM_ASK_WAIT_S)
            region = self._shm.cached(tenant)
        return region if region is not None and region.arena is not None else None

    async def _window(self) -> Window | None:
        """A window of this tenant's shared-memory region for one load, or None (no region
        configured, none to be had now, or another load holds it: the load uses the stream)."""
        region = await self._region()
        if region is None:
            return None
        window = region.lend()
        if window is None:  # the last load's last views may be going right now: wait for them a moment
            window = await asyncio.to_thread(region.lend, _SHM_WAIT_S)
            if window is None:
                self.metrics.shm_region_busy += 1  # another load has it: this one uses the stream
        return window


    async def capability(self) -> str:
        """The current capability token for this worker's namespace (minted when needed)."""
        cap = self._cap
        if cap is not None and cap.expires_at - _MARGIN_S > time.time():
            return cap.token
        body = {"namespace": self.namespace, "ops": self.ops, "ttl": self.capability_ttl}
        r = await self._send("POST", "/v1/capabilities", cap=False, json=body)
        if r.status_code != 201:
            raise RemoteUnavailable(f"minting a capability: {r.status_code}")
        got = r.json()
        self._cap = _Cap(got["capability"], float(got["expires_at"]))
        return self._cap.token

    async def envelope_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/keys/envelopes``: the keys of a batch of envelopes (see the module docstring)."""
        r = await self._retrying("POST", "/v1/keys/envelopes", json=body)
        if r.status_code != 200:
            raise RemoteUnavailable(f"envelope keys: {r.status_code}")
        got: dict[str, Any] = r.json()
        if got.get("chunk_tokens", self.chunk_tokens) != self.chunk_tokens:
            raise InvalidRequest(f"the server chunks {got['chunk_tokens']} tokens, this worker {self.chunk_tokens}")
        return got

    # -- planning ----------------------------------------------------------------------------
    def _chunks(self, model: KVModel, tokens: Sequence[int] | torch.Tensor) -> list[Chunk]:
        return self._plane.chunks(model, tokens)

    # -- ChunkStore: the data plane's way to the server ---------------------------------------
    async def session(self, token: str, op: str, chunks: Sequence[Chunk]) -> _HttpSession:
        """A session for one request (``token`` is unused: this worker mints its own capability,
        and the server checks it on every call)."""
        return _HttpSession(self, chunks)

    # -- data operations ---------------------------------------------------------------------
    async def lookup(self, model: KVModel, tokens: Sequence[int] | torch.Tensor) -> LookupResult:
        """How many leading tokens the server holds for this namespace (prefix walk)."""
        return await self._plane.lookup(self, "", model, tokens)

    async def store(
        self,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        skip_existing: bool = True,
        first_chunk: int = 0,
    ) -> StoreResult:
        """Seal every chunk of ``tokens`` on this worker (its device, as embedded mode does) and
        PUT the envelopes in batches; from chunk ``first_chunk`` on (``DataPlane.store``)."""
        self.prepare_region()
        return await self._plane.store(
            self, "", model, tokens, kv_layers, block_ids=block_ids, slot_mapping=slot_mapping,
            skip_existing=skip_existing, first_chunk=first_chunk,
        )

    async def retrieve(
        self,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        first_chunk: int = 0,
        write_upto: int | None = None,
        on_layers: Callable[[int], None] | None = None,
    ) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers`` (one streamed fetch, each envelope with its key; open, scatter);
        from chunk ``first_chunk`` on; ``on_layers``: layer by layer (``DataPlane.retrieve``)."""
        return await self._plane.retrieve(
            self, "", model, tokens, kv_layers, block_ids=block_ids, slot_mapping=slot_mapping, first_chunk=first_chunk,
            write_upto=write_upto, on_layers=on_layers,
        )


    async def _report_integrity_failure(self, chunk: Chunk, envelope_sha256: bytes) -> None:
        """Tell the server an envelope failed authentication here (op ``get``, as it was loaded):
        it audits ``integrity.failure`` and drops that copy. Best effort: a load goes on as a miss."""
        body = {"hash": chunk.chained_hash.hex(), "envelope_sha256": envelope_sha256.hex()}
        try:
            await self._send("POST", "/v1/chunks/integrity-failures", json=body)
        except GatewayError:
            pass

    async def report_refused_receipt(self, request: str, reason: str) -> None:
        """Tell the server a P/D receipt was refused for a request holding this client's
        capability (``POST /v1/handoff/refusals``): it verifies the capability and audits
        ``authz.denied`` (op ``handoff``). Raises what the call raises (GatewayError)."""
        await self._send("POST", "/v1/handoff/refusals", json={"request": request[:128], "reason": reason})


class _HttpSession:
    """One request against the server, and the only holder of its envelopes' keys. Sealing keys
    are asked for in one ``POST /v1/keys/envelopes {seal}`` call before sealing; opening keys
    arrive with the envelopes, in the fetch stream, so a load is one request and each envelope
    can be opened as soon as it is in while the next ones are still coming."""

    def __init__(self, client: RemoteGateway, chunks: Sequence[Chunk]) -> None:
        self.client = client
        self.chunks = chunks
        self._scope: tuple[str, str] | None = None  # tenant, namespace (from the key answer)
        self._shared: dict[int, tuple[str, str]] = {}  # chunk -> the published prefix's scope it opens in
        self._storage_keys: dict[int, str] = {}
        self._fetches: dict[int, asyncio.Future[Fetched | FetchFailed | None]] = {}
        self._opening: dict[int, IssuedKey] = {}  # the keys that came with the fetched envelopes
        self._readers: list[asyncio.Task[None]] = []
        self._pending: list[tuple[int, memoryview]] = []  # envelopes handed to put, not sent yet
        self._pending_bytes = 0
        self._sending: asyncio.Task[None] | None = None  # the batch on the wire
        self._error: BaseException | None = None  # what a batch met, raised to the plane
        self._closed = False
        # stores sealed in place in the namespace's arena (``gateway.server.shm``): the region that
        # came with it, each chunk's reserved extent (upload, its place, offset, size), and the
        # places sealed and not yet committed, by upload
        self._arena: ShmRegion | None = None
        self._slots: dict[int, tuple[str, int, int, int]] = {}
        self._commits: dict[str, list[int]] = {}
        self._commit_bytes = 0
        self._committing: asyncio.Task[None] | None = None  # the last commit sent (each waits for the one before)

    def context(self, i: int, model: KVModel, version: int) -> EnvelopeContext:
        storage_key = self._storage_keys.get(i)
        if self._scope is None or storage_key is None:  # no key asked for (an unparsable header):
            return EnvelopeContext(tenant="-", namespace="-", storage_key="0" * 64,  # cannot authenticate
                                   model_fingerprint=model.fingerprint_digest, key_version=version)
        tenant, namespace = self._shared.get(i, self._scope)
        return EnvelopeContext(
            tenant=tenant,
            namespace=namespace,
            storage_key=storage_key,
            model_fingerprint=model.fingerprint_digest,
            key_version=version,
        )

    async def _keys(self, indices: Sequence[int], body: dict[str, Any]) -> list[dict[str, Any]]:
        """Ask for the keys of ``indices`` (``body`` without its list) and record their storage keys
        (and the extents reserved for them, where ``body`` asked for some)."""
        got = await self.client.envelope_keys(body)
        items: list[dict[str, Any]] = got["keys"]
        if len(items) != len(indices) or any(
            item["hash"] != self.chunks[i].chained_hash.hex() for i, item in zip(indices, items, strict=True)
        ):
            raise RemoteUnavailable("envelope keys: the answer does not match the request")
        self._scope = (got["tenant"], got["namespace"])
        for i, item in zip(indices, items, strict=True):
            self._storage_keys[i] = _storage_key(item)
        upload, reserve = got.get("upload"), body.get("reserve")
        if isinstance(upload, str) and reserve is not None:
            self._commits[upload] = []  # committed (or given back) at the store's flush at the latest
            offsets = [off for item in items if isinstance(off := item.get("arena_offset"), int)]
            if len(offsets) == len(items):
                for place, (i, off, n) in enumerate(zip(indices, offsets, reserve["sizes"], strict=True)):
                    self._slots[i] = (upload, place, off, int(n))
        elif reserve is not None:  # no room in the arena (or no reservation to be had): they go up the socket
            self.client.metrics.arena_unreserved += len(indices)
        return items

    async def sealing_keys(self, indices: Sequence[int], sizes: Sequence[int] | None = None) -> list[tuple[int, EnvelopeKeys]]:
        """The keys to seal ``indices`` with; with their ``sizes``, through a region that came with
        the namespace's arena, extents reserved there too (``reserve`` hands them to the plane)."""
        self._arena = await self.client._arena_region() if sizes is not None else None
        out: list[tuple[int, EnvelopeKeys]] = []
        for at in range(0, len(indices), _KEYS_PER_CALL):
            part = indices[at : at + _KEYS_PER_CALL]
            body: dict[str, Any] = {"purpose": "seal", "hashes": [self.chunks[i].chained_hash.hex() for i in part]}
            if self._arena is not None and sizes is not None:
                body["reserve"] = {"region": self._arena.id, "sizes": list(sizes[at : at + len(part)])}
                if self._arena.returned is not None:  # what that load read in place may be reused now
                    body["reserve"]["returned"] = self._arena.returned
            for item in await self._keys(part, body):
                out.append((int(item["key_version"]), _issued(item)))
        return out

    async def opening_keys(self, refs: Sequence[tuple[int, KeyRef]]) -> list[EnvelopeKeys | None]:
        """The keys the fetch stream delivered with each envelope (no request). An envelope
        answered without a key was never handed over, so None here is only for a chunk the plane
        did not fetch through this session (a miss)."""
        return [self._opening.get(i) for i, _ref in refs]

    async def presence(self) -> Presence:
        """One ``POST /v1/lookup`` on the data plane's own client, not httpx: a worker's every
        load asks it first (docs/server.md, "Raw paths")."""
        body = json.dumps({"hashes": [c.chained_hash.hex() for c in self.chunks]}).encode()
        got = await self.client._wire_call("POST", "/v1/lookup", _post_json, "/v1/lookup", body)
        try:
            hits = min(int(got["hit_chunks"]), len(self.chunks))
            locations = [list(map(str, where)) for where in got.get("locations", [])[:hits]]
            said = got.get("degraded", "")  # a server that does not say: ""
        except (TypeError, ValueError, KeyError, AttributeError):
            raise RemoteUnavailable("lookup: a malformed answer") from None
        reported: Literal["tier_timeout", "tier_unavailable", ""] = (
            said if said in ("tier_timeout", "tier_unavailable") else ""
        )
        return Presence([i < hits for i in range(len(self.chunks))], locations=locations, reported=reported)

    def prefetch(self, indices: Sequence[int]) -> None:
        """One streamed fetch of these chunks (per ``_FETCH_ITEMS``): the server sends the stored
        prefix of them, and each chunk's ``fetch`` returns as soon as its envelope is in."""
        todo = [i for i in indices if i not in self._fetches]
        if not todo:
            return
        loop = asyncio.get_running_loop()
        for i in todo:
            self._fetches[i] = loop.create_future()
        self._readers.append(asyncio.ensure_future(self._read(todo)))

    async def _read(self, todo: list[int]) -> None:
        try:
            for start in range(0, len(todo), _FETCH_ITEMS):
                if not await self._read_group(todo[start : start + _FETCH_ITEMS]):
                    break
        except GatewayError:  # unreachable, refused, or a frame cut short: a miss
            self.client.metrics.unavailable += 1
        finally:
            for i in todo:  # past the end of the prefix (or of what arrived); one handed over is gone
                f = self._fetches.get(i)
                if f is not None and not f.done():
                    f.set_result(None)

    async def _read_group(self, group: list[int]) -> bool:
        """Whether every chunk of ``group`` arrived (the prefix goes on). Each envelope comes with
        its opening key and storage key (frame ``KVK1``), kept for ``opening_keys`` and ``context``;
        the stream is received in a thread of the data plane's client, straight into each
        envelope's own buffer, and each chunk is handed over (``fetch`` returns) as soon as it is in."""
        request: dict[str, Any] = {"hashes": [self.chunks[i].chained_hash.hex() for i in group], "keys": True}
        window = await self.client._window()
        if window is not None:
            request["shm"] = window.request()
        body = json.dumps(request).encode()
        loop = asyncio.get_running_loop()
        clean = False
        try:
            complete: bool = await self.client._wire_call("POST", "/v1/chunks/fetch", self._receive, body, group, loop, window)
            clean = True
        finally:
            if window is not None:
                window.end(clean)
        return complete

    def _receive(
        self, ex: Exchange, headers: list[tuple[str, str]], body: bytes, group: list[int], loop: asyncio.AbstractEventLoop,
        window: Window | None = None,
    ) -> tuple[int, Any]:
        """(In a thread of the data plane's client.) The fetch of ``group``: ``(status, whether
        every chunk arrived)``, or ``(status, the error body)``. What arrives is handed to the
        event loop (``_arrived``, ``_ended``) as it comes; an item in the shared-memory
        ``window`` is a view of it."""

        def post(fn: Callable[..., None], *args: Any) -> None:
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop is closed: nobody waits for these chunks any more
                pass

        try:
            ex.start("POST", "/v1/chunks/fetch", headers, [body])
            if ex.status != 200:
                return ex.status, ex.read_rest().decode("utf-8", "replace")
            if window is not None and ex.headers.get("x-kv-shm") == "gone":
                window.region.tainted = True  # the server forgot it (evicted, restarted): a new one next time
                window = None  # nothing of this load is in it
            chunk_tokens, t_len, n_len = frames.parse_keyed_head(ex.read(frames.KEYED_HEAD))
            scope = frames.decode_name(ex.read(t_len)), frames.decode_name(ex.read(n_len))
            if chunk_tokens != self.client.chunk_tokens:
                raise InvalidRequest(f"the server chunks {chunk_tokens} tokens, this worker {self.client.chunk_tokens}")
            post(self._set_scope, scope)
            shared = _shared_part(ex.headers.get("x-kv-shared"), len(group))
            if shared is not None:  # the leading chunks of a published prefix, read from its scope
                post(self._set_shared, group[: shared[0]], shared[1:])
            for i in group:
                item = frames.parse_keyed_item_head(ex.read(frames.KEYED_ITEM_HEAD))
                if item.chained_hash != self.chunks[i].chained_hash or item.length > _MAX_ENVELOPE:
                    raise BadFrame("the response does not answer the hashes asked")
                if window is not None and (item.status not in (frames.IN_REGION, frames.IN_ARENA) or i == group[-1]):
                    window.settled = True  # the server put all it will put there (it ends here, or streams)
                if item.status == frames.KEY_UNAVAILABLE:  # its key version is destroyed: a miss
                    post(self._ended, i, FetchFailed("key_unavailable", unavailable=True))
                    ex.at_end()  # the end of the prefix is the end of the body: the connection is kept
                    return 200, False
                if item.status not in (frames.OK, frames.UNKEYED, frames.IN_REGION, frames.IN_ARENA):
                    if item.status == frames.MISSING:
                        post(self._ended, i, None)
                    else:  # the server's tier could not answer, or missed its deadline
                        why: TierReason = "tier_timeout" if item.status == frames.TIMEOUT else "tier_unavailable"
                        post(self._ended, i, FetchFailed(why, unavailable=True))
                    ex.at_end()
                    return 200, False
                key: IssuedKey | None = None
                if item.status in (frames.OK, frames.IN_REGION, frames.IN_ARENA):
                    try:
                        key = IssuedKey(item.salt, item.key)
                    except ValueError:
                        raise BadFrame("a malformed key") from None
                if item.status == frames.IN_REGION:
                    if window is None:
                        raise BadFrame("an item in a shared-memory region this load did not lend")
                    buf = window.take(item.length)  # the server copied it there: nothing to receive
                    post(self._shm_envelope, False)
                elif item.status == frames.IN_ARENA:
                    at = frames.parse_arena_offset(ex.read(frames.ARENA_OFFSET))
                    if window is None:
                        raise BadFrame("an item lent in place to a load that lent no region")
                    buf = window.take(item.length, at)  # in the namespace's arena, where the server keeps it
                    post(self._shm_envelope, True)
                else:
                    buf = receive_buffers.take(item.length)  # the envelope's own buffer (a reused one where free)
                    ex.readinto(buf)
                post(self._arrived, i, buf, key, item.storage_key.hex())
                if item.status == frames.UNKEYED:  # it fails to open (an integrity failure): the end
                    ex.at_end()
                    return 200, False
            ex.at_end()  # the body's last chunk: the connection goes back to the pool
            return 200, True
        finally:
            ex.close()

    def _set_scope(self, scope: tuple[str, str]) -> None:
        self._scope = scope

    def _set_shared(self, indices: list[int], scope: tuple[str, str]) -> None:
        for i in indices:
            self._shared[i] = scope

    def _shm_envelope(self, in_place: bool) -> None:
        self.client.metrics.shm_envelopes += 1
        if in_place:
            self.client.metrics.arena_envelopes += 1

    def _arrived(self, i: int, buf: memoryview, key: IssuedKey | None, storage_key: str) -> None:
        if self._closed:  # arrived after the session closed: its key is not kept
            return
        if key is not None:
            self._opening[i] = key
            self._storage_keys[i] = storage_key
        f = self._fetches.get(i)
        if f is not None and not f.done():
            f.set_result(Fetched(buf, "remote"))

    def _ended(self, i: int, got: FetchFailed | None) -> None:
        """The prefix ends at chunk ``i``: a miss (``got`` None), or a chunk the server could not
        hand over (counted)."""
        if got is not None:
            metrics = self.client.metrics
            metrics.unavailable += 1
            if got.reason == "key_unavailable":
                metrics.key_unavailable += 1
            elif got.reason == "tier_timeout" or got.reason == "tier_unavailable":
                metrics.fetch_failed[got.reason] += 1
        f = self._fetches.get(i)
        if got is not None and f is not None and not f.done():
            f.set_result(got)

    async def fetch(self, i: int) -> Fetched:
        """Chunk ``i``'s envelope, handed over once: the session keeps no reference to it after
        (its receive buffer goes back to ``receive_buffers`` as soon as the plane has opened it,
        for the next envelopes of this load; a second fetch of ``i`` fetches it again)."""
        if i not in self._fetches:
            self.prefetch([i])
        got = await self._fetches[i]
        if got is None:
            raise FetchFailed("miss")
        if isinstance(got, FetchFailed):
            raise got
        del self._fetches[i]
        return got

    async def put(self, i: int, envelope: memoryview) -> None:
        """Keep the envelope for the next batch (sent once ``_BATCH_BYTES`` are kept; see
        ``flush``). A refusal or failure of an earlier batch is raised here too."""
        self._raise_error()
        self._pending.append((i, envelope))
        self._pending_bytes += envelope.nbytes
        if self._pending_bytes >= _BATCH_BYTES or len(self._pending) >= _BATCH_ITEMS:
            await self._send_pending()

    async def flush(self) -> None:
        """Send what is kept and wait for every batch; raises what one met (AccessDenied: the
        keys it was sealed under were revoked, so the plane seals again with fresh ones;
        NamespaceChanged: a clear ended the epoch they were sealed for, and the plane drops the
        store). Every reservation in the arena is committed, the rest of it given back."""
        if self._pending:
            await self._send_pending()
        if self._commits:
            self._send_commits(last=True)
        if self._committing is not None:
            await self._committing
            self._committing = None
        if self._sending is not None:
            await self._sending
            self._sending = None
        self._raise_error()

    def _raise_error(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err

    async def _send_pending(self) -> None:
        items, self._pending, self._pending_bytes = self._pending, [], 0
        if self._sending is not None:  # one batch in flight: the next waits for it (bounded memory)
            await self._sending
            self._raise_error()
        self._sending = asyncio.ensure_future(self._upload(items))

    async def _upload(self, items: list[tuple[int, memoryview]]) -> None:
        """One ``PUT /v1/chunks`` frame: the index, each item naming the storage key its sealing
        key came with (so the server refuses a batch sealed before a clear: ``NamespaceChanged``),
        then each envelope sent from its own buffer."""
        views = [env.cast("B") if env.format != "B" or env.ndim != 1 else env for _i, env in items]
        index = frames.encode_sealed_index([
            (self.chunks[i].chained_hash, bytes.fromhex(self._storage_keys[i]), v.nbytes) for (i, _e), v in zip(items, views)
        ])
        try:
            await self.client._wire_call("PUT", "/v1/chunks", _put, [index, *views], retry=False)
        except AccessDenied as exc:
            self.client._forget()  # revoked (a clear): the keys it was sealed under are gone too
            self._error = exc
        except GatewayError as exc:  # NamespaceChanged among them: raised to the plane once, from flush or put
            self._error = exc

    def reserve(self, i: int, nbytes: int) -> Reserved | None:
        """The extent the server reserved for chunk ``i`` in the namespace's arena, to seal into;
        None (the envelope is sealed into a buffer and sent) where there is none of that size."""
        slot = self._slots.pop(i, None)
        if slot is None or self._arena is None or slot[3] != nbytes:
            return None
        upload, place, offset, _n = slot
        return Reserved(self._arena.arena_slot(offset, nbytes), (upload, place))

    async def commit(self, reserved: Reserved) -> bool:
        """Count a sealed extent in for its upload's commit (sent once ``_BATCH_BYTES`` are sealed,
        and at ``flush``); what the commit meets is raised from ``commit`` or ``flush`` after it."""
        self._raise_error()
        upload, place = reserved.token
        self._commits[upload].append(place)
        self.client.metrics.arena_sealed += 1
        self._commit_bytes += reserved.view.nbytes
        if self._commit_bytes >= _BATCH_BYTES:
            self._send_commits(last=False)
        return True

    def abort(self, reserved: Reserved) -> None:
        return None  # its place is not committed: the upload's last commit gives it back

    def _send_commits(self, *, last: bool) -> None:
        """``POST /v1/chunks/commit`` of the places sealed so far of each upload (``last``: of
        every upload, which then ends), in the background, after the commit sent before it (an
        upload's last commit must come after its others)."""
        todo = {u: places for u, places in self._commits.items() if places or last}
        self._commits = {} if last else {u: [] for u in self._commits}
        self._commit_bytes = 0
        if todo and self._arena is not None:
            self._committing = asyncio.ensure_future(self._commit(self._committing, self._arena.id, todo, last))

    async def _commit(self, before: asyncio.Task[None] | None, region: str, todo: dict[str, list[int]], last: bool) -> None:
        if before is not None:
            await asyncio.wait([before])  # what it met is in _error already
        try:
            for upload, places in todo.items():
                body = json.dumps({"region": region, "upload": upload, "items": places, "last": last}).encode()
                await self.client._wire_call("POST", "/v1/chunks/commit", _post_json, "/v1/chunks/commit", body, retry=False)
        except AccessDenied as exc:
            self.client._forget()
            self._error = self._error or exc
        except GatewayError as exc:  # NamespaceChanged among them, as for an upload
            self._error = self._error or exc

    async def integrity_failure(self, i: int, tier: str, envelope_sha256: bytes) -> None:
        # counted by the data plane that found it (the same Metrics): reported here
        await self.client._report_integrity_failure(self.chunks[i], envelope_sha256)

    async def aclose(self) -> None:
        """Stop what is still in flight: a batch not flushed is dropped (cut mid-body, the server
        stores none of it), a fetch still streaming is closed."""
        self._closed = True
        tasks = [*self._readers, *(t for t in (self._sending, self._committing) if t is not None)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for f in self._fetches.values():
            f.cancel()
        self._readers.clear()
        self._fetches.clear()
        self._opening.clear()  # the request's keys go with it
        self._pending.clear()
        self._slots.clear()  # an upload never committed is given back by the server when it expires
        self._commits.clear()
        self._sending = self._committing = None


def _put(ex: Exchange, headers: list[tuple[str, str]], parts: list[bytes | memoryview]) -> tuple[int, str]:
    """(In a thread of the data plane's client.) Send an upload frame; ``(status, answer body)``."""
    try:
        ex.start("PUT", "/v1/chunks", headers, parts)
        return ex.status, ex.read_rest().decode("utf-8", "replace")
    finally:
        ex.close()


_JSON_ANSWER = 4 << 20  # the most of a JSON answer read (a 4,096-hash lookup's is about 100 KB)


def _post_json(ex: Exchange, headers: list[tuple[str, str]], path: str, body: bytes) -> tuple[int, Any]:
    """(In a thread of the data plane's client.) POST a JSON body to ``path``: ``(status, the
    parsed answer)`` for a 2xx, ``(status, the answer's text)`` otherwise."""
    try:
        ex.start("POST", path, headers, [body])
        raw = ex.read_rest(_JSON_ANSWER)
        if not ex.at_end():
            raise RemoteUnavailable(f"POST {path}: the answer was cut short")
        if len(raw) >= _JSON_ANSWER:
            raise RemoteUnavailable(f"POST {path}: an answer of over {_JSON_ANSWER} bytes")
        if not 200 <= ex.status < 300:
            return ex.status, raw.decode("utf-8", "replace")
        if ex.status == 204:  # no content
            return ex.status, None
        try:
            return ex.status, json.loads(raw)
        except ValueError:
            raise RemoteUnavailable(f"POST {path}: an answer that is not JSON") from None
    finally:
        ex.close()


def _shared_part(value: str | None, n: int) -> tuple[int, str, str] | None:
    """The fetch answer's ``X-KV-Shared: <count> <owner> <namespace>`` (published prefixes), or
    None; one that does not parse is the server's failure."""
    if value is None:
        return None
    parts = value.split(" ")
    if len(parts) != 3 or not parts[0].isdigit() or not 0 < int(parts[0]) <= n or not all(parts[1:]):
        raise BadFrame("a malformed X-KV-Shared header")
    return int(parts[0]), parts[1], parts[2]


def _storage_key(item: dict[str, Any]) -> str:
    """The storage key (64 lowercase hex characters) issued with a sealing key; a malformed one
    is the server's failure."""
    key = item.get("storage_key")
    if not isinstance(key, str) or len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise RemoteUnavailable("envelope keys: a malformed storage key")
    return key


def _issued(item: dict[str, Any]) -> IssuedKey:
    """One envelope's key from the server's answer (a malformed one is the server's failure)."""
    try:
        return IssuedKey(base64.b64decode(item["salt"], validate=True), base64.b64decode(item["key"], validate=True))
    except (ValueError, TypeError):
        raise RemoteUnavailable("envelope keys: a malformed key") from None
