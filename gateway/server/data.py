"""Data-plane routes: capabilities, lookup, chunks, pins, per-envelope keys, integrity and hand-off reports.

A prefix moves in one request each way: ``PUT /v1/chunks`` takes a frame of envelopes and stores
all of them or none, ``POST /v1/chunks/fetch`` streams the stored prefix of a list of hashes
back, each envelope after the key that opens it (frames: ``gateway.protocol.frames``; buffers and
the prefix walk: ``gateway.chunks.batches``). ``POST /v1/keys/envelopes`` issues the keys a remote
worker seals envelopes with (and, on the Unix socket, reserves extents of its namespace's arena to
seal them into, which ``POST /v1/chunks/commit`` stores: ``gateway.server.shm``),
``POST /v1/chunks/integrity-failures`` takes its report of one that
failed to open (``gateway.chunks.envelopes``), ``POST /v1/handoff/refusals`` a vLLM consumer's
report of a P/D receipt it refused (audited).
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Path, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from gateway.chunks import batches
from gateway.chunks.service import KeysUnavailable
from gateway.errors import BadFrame, InvalidRequest, NamespaceChanged, TooLarge
from gateway.protocol import frames
from gateway.server import rawbody, rawchunks, shm
from gateway.server.bodylimits import BodySize, takes
from gateway.server.deps import (
    Authorize,
    Name,
    PrincipalDep,
    Scope,
    ServerState,
    StateDep,
    Strict,
    actor_of,
    authorize_action,
    on_capability,
)
from gateway.server.jsonbody import JsonBodyRoute
from gateway.server.problems import COMMON_PROBLEMS, problem_responses
from storage.memory import MemoryTier
from tenancy.capabilities import read_unverified
from tenancy.errors import CapabilityDenied, PermissionDenied
from tenancy.roles import Action, allowed_capability_ops
from tenancy.types import Capability

router = APIRouter(prefix="/v1", route_class=JsonBodyRoute, responses=problem_responses(*COMMON_PROBLEMS))
_NOT_FOUND = problem_responses(404)

_BATCH_MEDIA = "application/octet-stream"
_BATCH_SCHEMA = {"schema": {"type": "string", "format": "binary"}}
_BATCH_BODY = {
    "requestBody": {
        "required": True,
        "description": "integers little endian: b'KVB2', count u32, count x (chained hash 32 bytes, storage key "
        "32 bytes as issued with the item's sealing key, envelope length u64), then the envelopes concatenated in "
        "that order (gateway.protocol.frames); b'KVB1' (older workers): items without the storage key",
        "content": {_BATCH_MEDIA: _BATCH_SCHEMA},
    }
}
_BATCH_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "integers little endian: b'KVK1', chunk_tokens u32, tenant and namespace (u16 lengths, "
        "UTF-8), then per chunk of the stored prefix: chained hash 32, status u8 (0 ok), key version u32, salt 32, "
        "key 32, storage key 32, length u64, the envelope; the first chunk not served ends it with status 1 "
        "(missing), 2 (a tier could not answer), 6 (a tier missed its deadline) or 3 (key version destroyed) "
        "and length 0; status 4: a header that does not parse, sent without a key, and nothing after it; "
        "5: the envelope is in the caller's shared-memory window (gateway.protocol.frames)",
        "content": {_BATCH_MEDIA: _BATCH_SCHEMA},
    }
}

# A streamed envelope goes out in views of this size: h11 copies each part once as it frames it,
# and 1 MiB parts keep that copy in reused memory (a whole 32 MiB part is a fresh mmap each time).
_PIECE = 1 << 20

HashPath = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$", description="chained sha256 of the chunk, hex")]
Op = Literal["lookup", "get", "put", "pin"]


class CapabilityRequest(Strict):
    namespace: Name
    ops: list[Op] = Field(min_length=1, max_length=4)
    ttl: int | None = Field(default=None, ge=1, le=86400)
    tenant: Name | None = Field(default=None, description="operators only; default: the caller's")


class CapabilityResponse(BaseModel):
    capability: str
    cap_id: str
    tenant: str
    namespace: str
    ops: list[str]
    expires_at: float
    epoch: int = Field(description="the namespace's current epoch (a secure clear bumps it); the vLLM middleware derives cache_salt from it")
    shared: str = Field("", description="a digest of the published prefixes the tenant reads (empty: none); the vLLM "
                        "middleware folds it into cache_salt, so a revoke or a membership removed reaches vLLM's cache")


class LookupRequest(Strict):
    hashes: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(min_length=1, max_length=4096)
    chunk_tokens: int | None = Field(default=None, ge=1, le=1 << 20)
    last_chunk_tokens: int | None = Field(default=None, ge=1, le=1 << 20)


class ShmWindow(Strict):
    region: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    offset: int = Field(ge=0, le=1 << 40)
    length: int = Field(ge=1, le=1 << 40)
    arena: bool = Field(
        default=False,
        description="the worker maps its namespace's arena (POST /v1/shm/regions handed it over): an envelope the "
        "memory tier holds there is lent in place (item status 7, its offset after the head), not copied",
    )
    lend: int | None = Field(
        default=None, ge=0, le=1 << 62,
        description="the worker's number for this load of the region: a store's reserve.returned naming it says "
        "the load is over, and what it read in place may be reused",
    )


class FetchRequest(Strict):
    hashes: list[Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]] = Field(min_length=1, max_length=4096)
    keys: Literal[True] = Field(
        description="true: each envelope comes after the key that opens it (frame KVK1; the caller's roles "
        "must also allow envelope_keys), a remote worker's load in one request",
    )
    shm: ShmWindow | None = Field(
        default=None,
        description="on the Unix socket: a window of the caller's shared-memory region "
        "(POST /v1/shm/regions) the envelopes that fit are copied into (item status 5) instead of "
        "being streamed (gateway.server.shm)",
    )


class IntegrityReport(Strict):
    hash: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    envelope_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256 of the envelope that failed")]


class IntegrityReportResponse(BaseModel):
    dropped: bool = Field(description="the stored copy was that envelope and is gone from every tier")


# a P/D receipt's reasons for refusal (gateway.vllm.handoff), as a consumer reports them
RefusalReason = Literal["receipt_other_tenant", "receipt_malformed", "receipt_stale_epoch"]


class HandoffRefusal(Strict):
    request: str = Field(min_length=1, max_length=128, description="the vLLM request id the receipt came with")
    reason: RefusalReason = Field(description="why the consumer refused the receipt (docs/vllm.md)")


class RegionRequest(Strict):
    bytes: int = Field(ge=64, le=1 << 40, description="the region's size")


class LookupResponse(BaseModel):
    hit_chunks: int
    hit_tokens: int | None
    locations: list[list[str]]
    degraded: str = Field("", description="why the answer may be short although chunks are stored: tier_timeout or "
                          "tier_unavailable (a tier could not answer in time, or at all); empty where it is not")


class PinRequest(Strict):
    hash: str = Field(pattern=r"^[0-9a-f]{64}$")


ChunkHash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="chained sha256 of the chunk, hex")]
_MAX_KEYS = 4096


class ArenaReserve(Strict):
    region: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    sizes: list[Annotated[int, Field(ge=1, le=1 << 40)]] = Field(min_length=1, max_length=_MAX_KEYS)
    returned: int | None = Field(
        default=None, ge=0, le=1 << 62,
        description="the number (shm.lend) of the region's last load that has ended, none of its views alive: "
        "if it is the last one lent, the extents it read in place go back first (a store after a hit reuses them)",
    )


class SealKeysRequest(Strict):
    purpose: Literal["seal"] = Field(
        description="keys to seal new envelopes with (capability op put); keys to open envelopes come with "
        "the fetch (POST /v1/chunks/fetch)",
    )
    hashes: list[ChunkHash] = Field(min_length=1, max_length=_MAX_KEYS, description="the chunks the worker will store")
    reserve: ArenaReserve | None = Field(
        default=None,
        description="on the Unix socket, for a worker that maps its namespace's arena (POST /v1/shm/regions): "
        "reserve an extent of each envelope's size (in hash order) in that arena, for the worker to seal "
        "into and commit (POST /v1/chunks/commit) instead of uploading the envelopes",
    )


class EnvelopeKeyItem(BaseModel):
    hash: str
    key_version: int
    salt: str = Field(description="base64; a sealing key's salt is fresh, drawn by the server")
    key: str = Field(description="the envelope's AES-256 segment key, base64")
    storage_key: str = Field(description="HMAC(namespace index key, hash), hex: the envelope's AAD binds it")
    arena_offset: int | None = Field(default=None, description="where the extent reserved for it starts in the arena")


class EnvelopeKeysResponse(BaseModel):
    tenant: str
    namespace: str
    chunk_tokens: int = Field(description="tokens per chunk; a worker must chain-hash with the same")
    keys: list[EnvelopeKeyItem] = Field(description="one per requested envelope, in request order")
    upload: str | None = Field(
        default=None, description="the reservation's id, where extents were reserved in the arena (commit by it)",
    )


class CommitRequest(Strict):
    region: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    upload: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    items: list[Annotated[int, Field(ge=0, lt=_MAX_KEYS)]] = Field(
        max_length=_MAX_KEYS, description="the envelopes to store now, by their place in the reservation",
    )
    last: bool = Field(default=True, description="the reservation ends: what it holds and is not stored is given back")


# The verified scope of each data-plane action: the caller's roles allow it on the tenant the
# request's capability names (``scope.capability``), decided before the route runs.
LookupScope = Annotated[Scope, Depends(Authorize(Action.LOOKUP, on=on_capability))]
GetScope = Annotated[Scope, Depends(Authorize(Action.GET, on=on_capability))]
PutScope = Annotated[Scope, Depends(Authorize(Action.PUT, on=on_capability))]
PinScope = Annotated[Scope, Depends(Authorize(Action.PIN, on=on_capability))]
EnvelopeKeysScope = Annotated[Scope, Depends(Authorize(Action.ENVELOPE_KEYS, on=on_capability))]


def _cap(scope: Scope) -> str:
    assert scope.capability is not None  # on_capability always sets it
    return scope.capability


@router.post("/capabilities", response_model=CapabilityResponse, status_code=201)
async def mint_capability(body: CapabilityRequest, principal: PrincipalDep, state: StateDep, request: Request) -> CapabilityResponse:
    tenant = body.tenant or principal.tenant
    allowed = allowed_capability_ops(principal, tenant)
    if not set(body.ops) <= allowed:
        authorize_action(state, principal, tenant, Action(sorted(set(body.ops) - allowed)[0]), request)
    token = await state.runtime.access.mint(
        tenant, body.namespace, body.ops, body.ttl, actor=actor_of(principal, request)
    )
    cap = read_unverified(token)
    try:  # the namespace made ready for the chunk routes (its keys unwrapped, made on first use)
        epoch = (await state.runtime.chunks.namespace(cap)).epoch
    except KeysUnavailable:
        # the KEK cannot unwrap it now: the epoch as the registry holds it (0 for a namespace not
        # made yet), so a KEK outage costs inference requests their cache, not their answer
        rec = await state.runtime.registry.get_namespace(cap.tenant, cap.namespace)
        epoch = rec.epoch if rec is not None else 0
    return CapabilityResponse(
        capability=token, cap_id=cap.cap_id, tenant=cap.tenant, namespace=cap.namespace,
        ops=sorted(cap.ops), expires_at=cap.expires_at, epoch=epoch,
        shared=await state.runtime.prefixes.revision(cap.tenant),
    )


SHARED_READS = "x-kv-shared-reads"
"""A request header: ``1`` where the worker opens each chunk in the context it is told, so a
published prefix's chunks may be read from their scope (docs/prefixes.md, "Remote workers")."""
SharedReads = Annotated[
    str | None,
    Header(alias=SHARED_READS, description="1: read a published prefix's leading chunks from its scope (the fetch's "
           "X-KV-Shared answer header says which); absent: the capability's own namespace only"),
]


async def answer_lookup(
    state: ServerState, capability: str, body: LookupRequest, *, shared: bool = False,
) -> dict[str, Any]:
    """The lookup's answer (a ``LookupResponse``'s fields), for the route below and for the
    gatekeeper's own answer to it (``gateway.server.rawlookup``). ``shared``: the caller sent
    ``X-KV-Shared-Reads: 1``."""
    answer = await state.plane.lookup(capability, body.hashes, shared=shared)
    hit_tokens = None
    if body.chunk_tokens is not None:
        hit_tokens = answer.hit_chunks * body.chunk_tokens
        if answer.hit_chunks == len(body.hashes) and body.last_chunk_tokens is not None:
            hit_tokens += body.last_chunk_tokens - body.chunk_tokens
    return {"hit_chunks": answer.hit_chunks, "hit_tokens": hit_tokens, "locations": answer.locations,
            "degraded": answer.degraded}


@router.post("/lookup", response_model=LookupResponse)
@takes(BodySize.HASHES)
async def lookup(body: LookupRequest, scope: LookupScope, state: StateDep, shared: SharedReads = None) -> LookupResponse:
    """How many leading chunks of ``hashes`` are stored, and in which tiers. With the raw paths
    on, the router finds ``gateway.server.rawlookup.RawLookup`` first (the same checks in the
    same order, without FastAPI's per-request cost); this route is its description, and serves
    when they are off."""
    return LookupResponse(**await answer_lookup(state, _cap(scope), body, shared=shared == "1"))


def _verify_before_body(state: ServerState, cap: str, op: str) -> None:
    """Verify ``cap`` for ``op`` before a byte of the body is read, so a forged or foreign
    capability costs no read. A chunk allowlist is named as its own here; the hashes the body
    names are checked against it once they are read."""
    try:
        claimed = read_unverified(cap).chunks
    except CapabilityDenied:
        claimed = None  # garbled: the check below refuses it (counted and audited)
    state.runtime.access.authorize(cap, op, chunks=sorted(claimed or ()))


def _content_length(request: Request, limit: int) -> int:
    declared = request.headers.get("content-length")
    if declared is None:
        raise InvalidRequest("Content-Length is required")
    try:
        size = int(declared)
    except ValueError:
        raise InvalidRequest("bad Content-Length") from None
    if size > limit:
        raise TooLarge()
    if size < 0:
        raise InvalidRequest("bad Content-Length")
    return size


@router.put(
    "/chunks", status_code=204, openapi_extra=_BATCH_BODY,
    responses=problem_responses(400, 409),
)
@takes(BodySize.BATCH)
async def put_chunks(scope: PutScope, state: StateDep, request: Request) -> Response:
    """Store a batch of envelopes (a frame, ``gateway.protocol.frames``): all of them, or none.

    The capability is verified before a byte of the body is read; the index is read and checked
    next (count, sizes, the total against ``Content-Length``, the capability for every hash); then each envelope is read straight into the buffer that
    keeps it (by the kernel, where the server's protocol offers ``gateway.server.rawbody``);
    only a whole frame whose envelopes all have a valid header is stored. A bad frame
    is a 400 and a torn body (a client gone mid-upload) stores nothing. A batch sealed for a
    namespace epoch a clear has ended (an item's storage key is not the namespace's now, or a
    clear passed while it was stored) is a 409 ``namespace-changed``, nothing stored."""
    cap = _cap(scope)
    _verify_before_body(state, cap, "put")
    s = state.settings
    size = _content_length(request, max(s.max_batch_bytes, s.max_chunk_bytes + frames.HEAD + frames.SEALED_INDEX_ITEM))
    raw = request.scope.get("extensions", {}).get(rawbody.EXTENSION)  # envelopes straight from the socket
    body = frames.Reader(request.stream(), direct=raw.readinto if isinstance(raw, rawbody.RawBody) else None)
    if size < frames.HEAD:
        raise BadFrame("the body is shorter than a frame head")
    count, sealed = frames.parse_upload_head(await body.read(frames.HEAD), s.max_batch_items)
    index = count * (frames.SEALED_INDEX_ITEM if sealed else frames.INDEX_ITEM)
    if size < frames.HEAD + index:
        raise BadFrame("the body is shorter than the frame's index")
    sealed_for: list[str] | None = None
    if sealed:
        items, sealed_for = frames.parse_sealed_index(await body.read(index), count, s.max_chunk_bytes)
    else:
        items = frames.parse_index(await body.read(index), count, s.max_chunk_bytes)
    if frames.HEAD + index + sum(n for _h, n in items) != size:
        raise BadFrame("Content-Length does not match the frame's index")
    batch = await batches.open_upload(state.plane, cap, items, sealed_for)
    try:
        for view in batch.views:
            await body.into(view)
        await body.end()
    except BaseException:  # a torn frame, a client gone: nothing was stored
        batch.abort()
        raise
    for where, n in zip(await batch.commit(), batch.sizes):
        for tier in where:
            state.telemetry.bytes.add(n, {"direction": "in", "tier": tier})
    return Response(status_code=204)


_ENDED = {"missing": frames.MISSING, "key_unavailable": frames.KEY_UNAVAILABLE, "tier_timeout": frames.TIMEOUT}
"""The frame status that ends a walk, by ``PrefixItem.reason`` (any other: ``UNAVAILABLE``)."""


@router.post("/chunks/fetch", response_class=Response, responses=_BATCH_RESPONSE)
@takes(BodySize.HASHES)
async def fetch_chunks(
    body: FetchRequest, scope: GetScope, state: StateDep, request: Request, shared: SharedReads = None,
) -> Response:
    """The stored prefix of ``hashes``, streamed as a frame (``gateway.protocol.frames``): each envelope
    is written from its tier's buffer as soon as it is had, and the next is read from its tier
    only once the previous one was handed to the connection (a slow reader holds the server
    to about one envelope; where envelopes go into the caller's shared-memory region, to two:
    one being copied while the item before it is written). The capability is checked for every
    hash before anything is read.

    Each envelope's item carries the key that opens it, issued from the key version and salt in
    its header: counted against the capability's key budget (a 403 ``key-budget-spent`` before
    anything is sent past it) and audited as one ``key.issue`` event per fetch.

    With ``X-KV-Shared-Reads: 1``, the leading chunks of a published prefix the capability may
    read come from their scope, each with its key and the scope's storage key, and the answer's
    ``X-KV-Shared: <count> <owner> <namespace>`` header names the context they open in."""
    cap = _cap(scope)
    authorize_action(state, scope.principal, scope.tenant, Action.ENVELOPE_KEYS, request)
    hold, shm_headers = _window(body, cap, state, request)
    region = hold.region if hold is not None else None
    try:
        opened = await state.plane.opened(cap, "get", body.hashes, shared=shared == "1")  # a refusal is a 403
        if opened.shared is not None:
            part = opened.shared
            shm_headers = [*shm_headers, ("x-kv-shared", f"{part.count} {part.ns.tenant} {part.ns.namespace}")]
        walk = batches.fetch_prefix(state.plane, cap, body.hashes, actor=scope.actor, opened=opened)
        first = await walk.__anext__()  # the key budget is charged here: past it, a 403
    except BaseException:
        if hold is not None:
            hold.release()
        raise
    verified = read_unverified(cap)  # verified by the walk just now
    lender = _lender(state, region, verified) if body.shm is not None and body.shm.arena else None
    head = frames.keyed_head(state.settings.chunk_tokens, verified.tenant, verified.namespace)

    def item(got: batches.PrefixItem, status: int = frames.OK) -> bytes:
        """The item's head: ``status`` (in the stream, the window or the arena) with its key, or
        the end of the walk, or an envelope whose header does not parse (no key to send)."""
        if got.found is None:
            return frames.keyed_item_head(got.chained_hash, _ENDED.get(got.reason, frames.UNAVAILABLE))
        n = got.found.data.nbytes
        k = got.key
        if k is None or k.key is None:
            return frames.keyed_item_head(got.chained_hash, frames.UNKEYED, n)
        return frames.keyed_item_head(
            got.chained_hash, status, n, key_version=k.key_version, salt=k.salt, key=k.key,
            storage_key=bytes.fromhex(k.storage_key),
        )

    async def items() -> AsyncIterator[list[bytes | memoryview]]:
        """Each item of the frame: its head, and the envelope (a view of the tier's buffer), or
        only its head where the envelope was copied into the caller's region (``shm.CopyAhead``:
        each copy starts before the item before it is written)."""
        got: batches.PrefixItem | None = first
        at, end = (body.shm.offset, body.shm.offset + body.shm.length) if region is not None and body.shm else (0, 0)
        lending = region is not None
        copies: shm.CopyAhead[bytes] = shm.CopyAhead()
        try:
            while got is not None:
                found, k = got.found, got.key
                offset = (lender[0].locate(lender[1], found.data)
                          if lender is not None and found is not None and found.tier == lender[0].name else None)
                if (offset is not None and found is not None and region is not None and not region.closed
                        and k is not None and k.key is not None):
                    n = found.data.nbytes
                    region.leases.append(found.data)  # read in place: kept where it is until the worker is done
                    state.telemetry.bytes.add(n, {"direction": "out", "tier": found.tier, "via": "arena"})
                    before = await copies.drain()
                    if before is not None:
                        yield [before]
                    yield [item(got, frames.IN_ARENA) + frames.arena_offset(offset)]
                elif (found is not None and lending and region is not None and not region.closed
                        and at + found.data.nbytes <= end and k is not None and k.key is not None):
                    n = found.data.nbytes
                    state.telemetry.bytes.add(n, {"direction": "out", "tier": found.tier, "via": "shm"})
                    before = await copies.push(region.view[at : at + n], found.data, item(got, frames.IN_REGION))
                    at = shm.aligned(at + n)
                    if before is not None:
                        yield [before]
                else:
                    before = await copies.drain()
                    if before is not None:
                        yield [before]
                    if found is None:
                        yield [item(got)]
                        return
                    lending = False  # and for every later one: the worker knows then that nothing more lands there
                    state.telemetry.bytes.add(found.data.nbytes, {"direction": "out", "tier": found.tier})
                    yield [item(got), found.data]
                got = await anext(walk, None)
            before = await copies.drain()
            if before is not None:
                yield [before]
        finally:
            try:
                await copies.settle()
            finally:
                if hold is not None:
                    hold.release()
                await walk.aclose()

    raw = request.scope.get("extensions", {}).get(rawchunks.EXTENSION)
    stream = items()
    if hold is not None:  # a stream never started (a client gone first) lets the region go too
        hold.tie(stream)
    if isinstance(raw, rawchunks.RawChunks):
        return _RawFrame(raw, head, stream, shm_headers)

    async def frame(parts_of: AsyncIterator[list[bytes | memoryview]]) -> AsyncIterator[bytes | memoryview]:
        yield head
        async for parts in parts_of:
            for part in parts:
                for off in range(0, len(part), _PIECE):  # views of the tier's buffer (see _PIECE)
                    yield part[off : off + _PIECE]

    return StreamingResponse(frame(stream), media_type=_BATCH_MEDIA, headers=dict(shm_headers))


def _peer(request: Request) -> str:
    """The caller's source as the server's protocol reported it (``unix:uid=U:pid=P`` on the Unix socket)."""
    return request.client.host if request.client else "-"


def _window(
    body: FetchRequest, cap: str, state: ServerState, request: Request
) -> tuple[shm.Hold | None, list[tuple[str, str]]]:
    """The caller's region where its fetch lends a window of one (checked before anything is
    read, for the tenant of the verified capability): ``(hold, [])``, the region held until the
    fetch ends; ``(None, [("x-kv-shm", "gone")])`` where the region is not known (or not the
    caller's); a window outside the region is a 422."""
    if body.shm is None:
        return None, []
    tenant = state.runtime.access.authorize(cap, "get").tenant
    client = _peer(request)
    region = state.regions.get(body.shm.region, tenant, client)
    if region is None:
        return None, [("x-kv-shm", "gone")]
    if body.shm.offset + body.shm.length > region.size:
        raise InvalidRequest(f"the window ends past the region's {region.size} bytes")
    return state.regions.hold(body.shm.region, tenant, client, body.shm.lend), []


@router.post("/shm/regions", response_class=Response, responses=problem_responses(400, 503))
async def create_region(body: RegionRequest, scope: GetScope, state: StateDep, request: Request) -> Response:
    """A shared-memory region for this worker's loads (``gateway.server.shm``), on the Unix socket
    only: the answer's body is JSON ``{"region", "bytes", "populate"}`` (``populate``: the server
    faults the region's pages in ahead of the loads, and the worker should map them too), sent with the region's file
    descriptor attached (``SCM_RIGHTS``). 503 where the server has none to give.

    Where the memory tier keeps an arena per namespace and the capability may write every chunk
    of its namespace (op ``put``, no chunk allowlist), a descriptor of that namespace's arena
    comes second (writable: the worker's stores seal into extents reserved there) and ``"arena"``
    gives its size: the worker's fetches that say ``"arena": true`` get the envelopes held there
    lent in place (``gateway.server.shm``)."""
    raw = request.scope.get("extensions", {}).get(rawchunks.EXTENSION)
    if not isinstance(raw, rawchunks.RawChunks):
        raise InvalidRequest("shared memory is for workers on the server's Unix socket")
    verified = state.runtime.access.authorize(_cap(scope), "get")  # expired, revoked, forged: 403
    tenant = verified.tenant
    region, fd = await state.regions.acreate(tenant, _peer(request), body.bytes)
    answer: dict[str, Any] = {"region": region.id, "bytes": region.size, "populate": state.regions.populate}
    fds = [fd]
    try:
        tier = _arenas(state)
        if tier is not None and "put" in verified.ops and verified.chunks is None:
            group = state.runtime.deriver.group_label(tenant, verified.namespace)
            arena = tier.group_arena(group)
            fds.append(os.dup(arena.fd))
            answer["arena"] = arena.size
            region.arena_group = group
    except BaseException:
        os.close(fd)
        state.regions.drop(region.id)
        raise
    return _FdResponse(raw, json.dumps(answer).encode(), fds, lambda: state.regions.drop(region.id))


def _arenas(state: ServerState) -> MemoryTier | None:
    """The memory tier where it keeps each namespace's envelopes in an arena of its own."""
    fast = state.runtime.tiers.tiers[0] if state.runtime.tiers.tiers else None
    return fast if isinstance(fast, MemoryTier) and fast.group_arenas else None


def _lender(state: ServerState, region: shm.Region | None, cap: Capability) -> tuple[MemoryTier, str] | None:
    """The memory tier and group whose arena a fetch under ``cap`` lends envelopes in place from:
    the one handed over with the region, where it is the capability's namespace's."""
    tier = _arenas(state)
    if tier is None or region is None or region.arena_group is None:
        return None
    group = state.runtime.deriver.group_label(cap.tenant, cap.namespace)
    return (tier, group) if group == region.arena_group else None


class _FdResponse(Response):
    """A JSON body sent as one chunk with descriptors attached (``RawChunks.send_fd``); the
    descriptors are closed here whatever happens (the worker holds its own copies)."""

    media_type = "application/json"

    def __init__(self, raw: rawchunks.RawChunks, data: bytes, fds: list[int], on_failure: Callable[[], None]) -> None:
        self.status_code, self.background, self.body = 200, None, b""
        self.raw_headers = [(b"content-type", b"application/json")]
        self._raw, self._data, self._fds, self._on_failure = raw, data, fds, on_failure

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if not self._raw.usable():
                raise shm.ShmUnavailable("the response is not chunked: no descriptor can go with it")
            await self._raw.send_fd(self._data, self._fds)
        except BaseException:
            self._on_failure()
            raise
        finally:
            for fd in self._fds:
                os.close(fd)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class _RawFrame(Response):
    """The fetch frame, each item written as one chunk straight to the connection
    (``gateway.server.rawchunks``: no copy, no task per piece). The head and the last chunk go
    through ASGI; a client gone mid-stream ends the walk (its tier buffers are let go)."""

    media_type = _BATCH_MEDIA

    def __init__(
        self, raw: rawchunks.RawChunks, head: bytes, items: AsyncIterator[list[bytes | memoryview]],
        headers: list[tuple[str, str]] = [],  # noqa: B006  # never mutated
    ) -> None:
        # no Response.__init__: it would declare Content-Length 0; h11 frames this one chunked
        self.status_code, self.background, self.body = 200, None, b""
        self.raw_headers = [(b"content-type", _BATCH_MEDIA.encode()), *((k.encode(), v.encode()) for k, v in headers)]
        self._raw, self._head, self._items = raw, head, items

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if not self._raw.usable():  # framed otherwise (an HTTP/1.0 client): through ASGI
            await send({"type": "http.response.body", "body": self._head, "more_body": True})
            async for parts in self._items:
                for part in parts:
                    await send({"type": "http.response.body", "body": bytes(part), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        pending: list[bytes | memoryview] = [self._head]
        try:
            async for parts in self._items:
                if not await self._raw.write([*pending, *parts]):
                    return  # the client is gone
                pending = []
            if pending and not await self._raw.write(pending):
                return
        finally:
            await self._items.aclose()  # type: ignore[attr-defined]  # an async generator
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@router.post("/chunks/integrity-failures", response_model=IntegrityReportResponse)
async def report_integrity_failure(body: IntegrityReport, scope: GetScope, state: StateDep) -> IntegrityReportResponse:
    """An envelope this capability loaded (op ``get``) failed authentication on the worker:
    audited as ``integrity.failure`` (as in process), and the stored copy dropped where it is the
    envelope of that digest, so a recompute stores a good one and a good copy stored since stays."""
    dropped = await state.plane.integrity_failure(
        _cap(scope), body.hash, bytes.fromhex(body.envelope_sha256), actor=scope.actor,
    )
    return IntegrityReportResponse(dropped=dropped)


@router.post("/handoff/refusals", status_code=204)
async def report_refused_receipt(body: HandoffRefusal, scope: LookupScope, state: StateDep) -> Response:
    """A vLLM consumer (remote mode) refused a P/D receipt for a request holding this capability
    (op ``lookup``): audited as ``authz.denied`` (op ``handoff``, the reason, the request) in the
    capability's tenant and namespace, with the caller as actor, as an embedded connector records
    it; answered once the event is durable. A capability that fails verification is 403."""
    await state.runtime.access.refused_receipt(_cap(scope), body.request, body.reason, actor=scope.actor)
    return Response(status_code=204)


@router.post("/pins", status_code=204, responses=_NOT_FOUND)
async def pin(body: PinRequest, scope: PinScope, state: StateDep) -> Response:
    await state.plane.pin(_cap(scope), body.hash, pin=True)
    return Response(status_code=204)


@router.delete("/pins/{chunk_hash}", status_code=204, responses=_NOT_FOUND)
async def unpin(chunk_hash: HashPath, scope: PinScope, state: StateDep) -> Response:
    await state.plane.pin(_cap(scope), chunk_hash, pin=False)
    return Response(status_code=204)


@router.post("/keys/envelopes", response_model=EnvelopeKeysResponse)
@takes(BodySize.KEYS)
async def envelope_keys(
    body: SealKeysRequest,
    scope: EnvelopeKeysScope,
    state: StateDep,
    request: Request,
) -> EnvelopeKeysResponse:
    """The keys to seal a prefix's envelopes with, one request per prefix (remote mode, op ``put``):
    a fresh salt per hash and its envelope key, so a worker never holds the tenant's data key.
    Counted, bounded per capability (403 ``urn:kvgate:problem:key-budget-spent`` past the bound:
    mint a new capability) and audited once per request. The key that opens a stored envelope
    comes with the envelope, from ``POST /v1/chunks/fetch``.

    With ``reserve`` (a worker on the Unix socket that maps its namespace's arena with the region
    it names): an extent of each size is reserved in that arena, checked for op ``put`` on every
    hash exactly as an upload is, and the answer names each extent's offset and the reservation
    (``upload``); where that cannot be had (no such region or arena, no room, a size over the
    limit) the answer has no ``upload`` and the worker uploads the envelopes."""
    cap = _cap(scope)
    if body.reserve is not None and len(body.reserve.sizes) != len(body.hashes):
        raise InvalidRequest("reserve.sizes has one size per hash")
    got = await state.plane.seal_keys(cap, body.hashes, actor=scope.actor)

    def b64(b: bytes | None) -> str:
        assert b is not None  # a sealing key always has its key (else seal_keys raised)
        return base64.b64encode(b).decode()

    upload, offsets = await _reserve(state, request, cap, body, [k.storage_key for k in got.keys])
    return EnvelopeKeysResponse(
        tenant=got.tenant, namespace=got.namespace, chunk_tokens=state.settings.chunk_tokens,
        keys=[
            EnvelopeKeyItem(
                hash=k.chunk_hash, key_version=k.key_version, salt=b64(k.salt),
                key=b64(k.key), storage_key=k.storage_key, arena_offset=offsets[i] if offsets else None,
            )
            for i, k in enumerate(got.keys)
        ],
        upload=upload,
    )


async def _reserve(
    state: ServerState, request: Request, cap: str, body: SealKeysRequest, sealed_for: list[str],
) -> tuple[str | None, list[int] | None]:
    """``(upload id, offsets)`` of extents reserved in the arena of the region ``body`` names for
    its envelopes, or ``(None, None)`` where they cannot be had (nothing reserved then)."""
    if body.reserve is None:
        return None, None
    verified = read_unverified(cap)  # verified for put on every hash by seal_keys just now
    client = _peer(request)
    region = state.regions.get(body.reserve.region, verified.tenant, client)
    lender = _lender(state, region, verified)
    if region is None or lender is None or max(body.reserve.sizes) > state.plane.max_chunk_bytes:
        return None, None
    shm.returned(region, body.reserve.returned)
    items = [(bytes.fromhex(h), n) for h, n in zip(body.hashes, body.reserve.sizes, strict=True)]
    try:
        batch = await batches.open_upload(state.plane, cap, items, sealed_for)
    except (BadFrame, NamespaceChanged):  # a clear passed since the keys were issued: they upload, and are refused
        return None, None
    offsets = [lender[0].locate(lender[1], view) for view in batch.views]
    if any(off is None for off in offsets):  # no room in the arena for one: the worker uploads them all
        batch.abort()
        return None, None
    upload = shm.add_upload(region, batch, time.monotonic(), cap)
    return (upload, [int(off) for off in offsets if off is not None]) if upload is not None else (None, None)


@router.post("/chunks/commit", status_code=204, responses=problem_responses(400, 404, 409))
async def commit_chunks(body: CommitRequest, scope: PutScope, state: StateDep, request: Request) -> Response:
    """Store envelopes the worker sealed straight into extents reserved for them in its namespace's
    arena (``POST /v1/keys/envelopes`` with ``reserve``): ``items`` of the reservation ``upload`` of
    the caller's ``region``, checked as an upload's envelopes are (every header, then stored, then
    the namespace's epoch), all stored or none. With ``last`` the rest is given back. 404 where the
    reservation is not known (expired, given back, a region dropped, another namespace's: the
    envelopes are lost, as an upload cut off is); 403 where the capability it was reserved under no
    longer allows the store (revoked, expired); 409 ``namespace-changed`` where a clear ended the
    epoch meanwhile; a bad header is a 400 and ends the reservation."""
    cap = _cap(scope)
    verified = state.runtime.access.authorize(cap, "put")
    client = _peer(request)
    region = state.regions.get(body.region, verified.tenant, client)
    up = region.uploads.get(body.upload) if region is not None else None
    if region is None or up is None or not isinstance(up.batch, batches.UploadBatch):
        raise shm.ReservationMissing()  # 404: the worker's store of these envelopes did not happen
    # the capability the extents were reserved under must still allow the store (not revoked, not
    # expired), and be of the caller's namespace: a commit stores nothing another could not
    reserved_by = state.runtime.access.authorize(up.capability, "put")
    if (reserved_by.tenant, reserved_by.namespace) != (verified.tenant, verified.namespace):
        raise shm.ReservationMissing()
    if body.last:
        region.uploads.pop(body.upload, None)
    try:
        written = await up.batch.commit(body.items, last=body.last)
    except BaseException:
        region.uploads.pop(body.upload, None)  # ended by the failure: nothing more of it is stored
        raise
    for where, k in zip(written, body.items):
        for tier in where:
            state.telemetry.bytes.add(up.batch.sizes[k], {"direction": "in", "tier": tier, "via": "arena"})
    return Response(status_code=204)


__all__ = ["router", "PermissionDenied"]
