"""Remote mode (DESIGN section 3): a worker that holds no tier credentials talks to a kvgate server.

``RemoteGateway(base_url, bearer_token)`` mirrors ``gateway.core.Gateway``'s data operations
(``store`` / ``lookup`` / ``retrieve``, minus the capability argument: it mints and renews its own)
and does on the worker everything that touches plaintext, exactly as the core does in process:

    tokens --chain_hashes--> h_i                       (same chunk size as the server)
    paged KV --pack--> chunk --seal (leased DEK, AAD: tenant, namespace,
        HMAC(leased index key, h_i), model fingerprint, key version)--> PUT /v1/chunks/{h_i}
    GET /v1/chunks/{h_i} --open (every tag checked)--> chunk --unpack--> paged KV

So the server and its tiers only ever see ciphertext, and an envelope stored remotely opens in
the core (and back). A chunk that fails authentication, was sealed under a key version the lease
does not hold, or cannot be fetched ends the loaded prefix: a miss, counted, never handed to the
engine (an inauthentic one is also deleted, so a recompute stores a good copy).

Leases (``POST /v1/keys/lease``: the current key to seal with; an older version, on demand, to
open what was sealed before a rotation) are held only in memory. A 403 on a data call (the tenant was
cleared, its capabilities revoked) drops the cached capability and lease and retries once.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import httpx
import torch

from crypto.envelope import (
    ChunkCipher,
    EnvelopeContext,
    peek_key_version,
    plaintext_length,
)
from crypto.errors import DecryptionFailed
from gateway.chunking import Chunk, InvalidTokens, chain_hashes
from gateway.core import KVModel, LookupResult, RetrieveResult, StoreResult
from gateway.envelopes import KeyLease
from gateway.errors import AccessDenied, GatewayError, InvalidRequest
from kernels.errors import KVLayoutError
from kernels.pack import pack, slots_from_block_ids, unpack
from kernels.paged import PagedKV

__all__ = ["RemoteGateway", "RemoteUnavailable"]

_MARGIN_S = 15.0  # renew a capability or lease this long before it expires
_FETCH_CONCURRENCY = 8


class RemoteUnavailable(GatewayError):
    """The kvgate server could not be reached or failed (5xx, 429, transport error)."""


@dataclass(slots=True)
class _Cap:
    token: str
    expires_at: float


class RemoteGateway:
    """A worker's client of a kvgate server. ``http`` may be shared (then it is not closed here)."""

    def __init__(
        self,
        base_url: str,
        bearer_token: str,
        *,
        http: httpx.AsyncClient | None = None,
        namespace: str = "default",
        chunk_tokens: int = 256,
        ops: Sequence[str] = ("lookup", "get", "put"),
        capability_ttl: int = 300,
        segment_bytes: int = 2 << 20,
    ) -> None:
        if chunk_tokens <= 0:
            raise InvalidRequest("chunk_tokens must be positive")
        self.base_url = base_url.rstrip("/")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.ops = sorted(set(ops))
        self.capability_ttl = capability_ttl
        self._bearer = bearer_token
        self._own_http = http is None
        self._http = http or httpx.AsyncClient(timeout=30.0)
        self._cipher = ChunkCipher(segment_bytes=segment_bytes)
        self._cap: _Cap | None = None
        self._lease: KeyLease | None = None  # the current key, to seal with
        self._open: dict[int, KeyLease] = {}  # older key versions, to open with
        self._used = 0  # envelopes sealed under the current lease
        self._lock = asyncio.Lock()
        self.stats = {"integrity_failures": 0, "unavailable": 0}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._forget()
        if self._own_http:
            await self._http.aclose()

    # -- HTTP --------------------------------------------------------------------------------
    async def _send(self, method: str, path: str, *, cap: bool = True, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self._bearer}"}
        if cap:
            headers["X-KV-Capability"] = await self.capability()
        try:
            r = await self._http.request(method, self.base_url + path, headers=headers, **kw)
        except httpx.HTTPError as exc:
            raise RemoteUnavailable(f"{method} {path}: {type(exc).__name__}") from None
        if r.status_code in (401, 403):
            raise AccessDenied(f"{method} {path}: {r.status_code}")
        if r.status_code in (413, 422):
            raise InvalidRequest(f"{method} {path}: {r.status_code} {r.text[:200]}")
        if r.status_code == 429 or r.status_code >= 500:
            raise RemoteUnavailable(f"{method} {path}: {r.status_code}")
        return r

    async def _retrying(self, method: str, path: str, **kw) -> httpx.Response:
        """One retry with a fresh capability and lease after a 403 (revoked by a clear)."""
        try:
            return await self._send(method, path, **kw)
        except AccessDenied:
            self._forget()
            return await self._send(method, path, **kw)

    def _forget(self) -> None:
        """Drop the capability and every key held (after a revocation)."""
        self._cap = self._lease = None
        self._open.clear()

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

    async def lease(self) -> KeyLease:
        """The tenant's current data key, leased for sealing (renewed when spent or expiring)."""
        async with self._lock:
            lease = self._lease
            if lease is not None and self._used < lease.invocations and lease.expires_at - _MARGIN_S > time.time():
                return lease
            r = await self._send("POST", "/v1/keys/lease")
            if r.status_code != 200:
                raise RemoteUnavailable(f"leasing a key: {r.status_code}")
            self._lease = self._parse_lease(r.json())
            self._used = 0
            return self._lease

    def _parse_lease(self, j: dict) -> KeyLease:
        if j.get("chunk_tokens", self.chunk_tokens) != self.chunk_tokens:
            raise InvalidRequest(f"the server chunks {j['chunk_tokens']} tokens, this worker {self.chunk_tokens}")
        b = base64.b64decode
        return KeyLease(
            j["tenant"], j["namespace"], int(j["key_version"]), int(j["invocations"]),
            b(j["dek"]), b(j["binding_secret"]), b(j["index_key"]), float(j["expires_at"]),
        )

    # -- planning ----------------------------------------------------------------------------
    def _chunks(self, model: KVModel, tokens: Sequence[int] | torch.Tensor) -> list[Chunk]:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        try:
            return chain_hashes(tokens, model.fingerprint, self.chunk_tokens, vocab_size=model.vocab_size)
        except InvalidTokens as exc:
            raise InvalidRequest(str(exc)) from None

    @staticmethod
    def _slots(model: KVModel, kv_layers, num_tokens: int, block_ids, slot_mapping) -> tuple[PagedKV, torch.Tensor]:
        """Every slot of the request, validated before anything is sent or written."""
        if (block_ids is None) == (slot_mapping is None):
            raise InvalidRequest("give exactly one of block_ids and slot_mapping")
        g = model.geometry
        try:
            kv = PagedKV.of(kv_layers, g)
            if block_ids is not None:
                slots = slots_from_block_ids(block_ids, g.block_size, 0, num_tokens, device=kv.device)
            else:
                slots = torch.as_tensor(slot_mapping).to(kv.device)
                if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
                    raise InvalidRequest("slot_mapping must be a 1-D integer sequence")
                if slots.numel() != num_tokens:
                    raise InvalidRequest(f"slot_mapping has {slots.numel()} slots for {num_tokens} tokens")
                slots = slots.to(torch.int64)
        except KVLayoutError as exc:
            raise InvalidRequest(str(exc)) from None
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= kv.num_slots:
            raise InvalidRequest(f"slots must lie in [0, {kv.num_slots}), got [{lo}, {hi}]")
        return kv, slots

    @staticmethod
    def _context(lease: KeyLease, chunk: Chunk, model: KVModel, version: int) -> EnvelopeContext:
        return EnvelopeContext(
            tenant=lease.tenant,
            namespace=lease.namespace,
            storage_key=hmac.new(lease.index_key, chunk.chained_hash, hashlib.sha256).hexdigest(),
            model_fingerprint=model.fingerprint_digest,
            key_version=version,
        )

    def _segment_bytes(self, model: KVModel, n: int) -> int:
        layer = model.geometry.chunk_nbytes(n) // model.geometry.num_layers
        return layer * max(1, self._cipher.segment_bytes // layer)

    # -- data operations ---------------------------------------------------------------------
    async def lookup(self, model: KVModel, tokens: Sequence[int] | torch.Tensor) -> LookupResult:
        """How many leading tokens the server holds for this namespace (prefix walk)."""
        chunks = self._chunks(model, tokens)
        body = {"hashes": [c.chained_hash.hex() for c in chunks]}
        r = await self._retrying("POST", "/v1/lookup", json=body)
        hits = int(r.json()["hit_chunks"])
        return LookupResult(
            hit_tokens=chunks[hits - 1].end if hits else 0, hit_chunks=hits, total_chunks=len(chunks),
            locations=r.json().get("locations", []),
        )

    async def store(
        self,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        skip_existing: bool = True,
    ) -> StoreResult:
        """Seal every chunk of ``tokens`` on this worker and PUT the envelopes."""
        chunks = self._chunks(model, tokens)
        kv, slots = self._slots(model, kv_layers, chunks[-1].end, block_ids, slot_mapping)
        todo = list(range(len(chunks)))
        if skip_existing:
            have = (await self.lookup(model, tokens)).hit_chunks
            todo = todo[have:]
        stored_bytes = 0
        for i in todo:
            c = chunks[i]
            plain = pack(kv, slots[c.start : c.end], model.geometry).contiguous().cpu()
            view = memoryview(plain.view(-1).view(torch.uint8).numpy())
            for attempt in (0, 1):
                env = await self._seal(model, c, view)
                try:
                    await self._send("PUT", f"/v1/chunks/{c.chained_hash.hex()}", content=bytes(env))
                    break
                except AccessDenied:
                    # revoked (a clear): the lease it was sealed under is gone too; reseal once
                    self._forget()
                    if attempt:
                        raise
            stored_bytes += len(env)
        return StoreResult(
            tokens=chunks[-1].end, chunks=len(chunks), stored=len(todo), skipped=len(chunks) - len(todo),
            bytes_stored=stored_bytes,
        )

    async def _seal(self, model: KVModel, chunk: Chunk, plain: memoryview) -> bytearray:
        lease = await self.lease()
        self._used += 1
        ctx = self._context(lease, chunk, model, lease.key_version)
        seg = self._segment_bytes(model, chunk.num_tokens)
        env = bytearray(self._cipher.envelope_size(plain.nbytes, seg))
        await asyncio.to_thread(
            self._cipher.seal_into, lease.dek, lease.binding_secret, ctx, plain, env, segment_bytes=seg
        )
        return env

    async def _fetch(self, path: str, gate: asyncio.Semaphore) -> httpx.Response | None:
        async with gate:
            try:
                r = await self._retrying("GET", path)
            except RemoteUnavailable:
                self.stats["unavailable"] += 1
                return None
        return r if r.status_code == 200 else None

    async def retrieve(
        self,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
    ) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers`` (GET, open, unpack)."""
        chunks = self._chunks(model, tokens)
        kv, slots = self._slots(model, kv_layers, chunks[-1].end, block_ids, slot_mapping)
        gate = asyncio.Semaphore(_FETCH_CONCURRENCY)
        fetches = [asyncio.ensure_future(self._fetch(f"/v1/chunks/{c.chained_hash.hex()}", gate)) for c in chunks]
        loaded = failures = unavailable = 0
        reason = ""
        try:
            for c, fut in zip(chunks, fetches):
                r = await fut
                if r is None:
                    reason = "miss"
                    break
                envelope = r.content
                try:
                    version = peek_key_version(envelope)
                    lease = await self._opening_lease(version)
                    if lease is None:  # that key version is destroyed (or never existed)
                        unavailable += 1
                        reason = "key_unavailable"
                        self.stats["unavailable"] += 1
                        break
                    plain = torch.empty(model.geometry.chunk_shape(c.num_tokens), dtype=model.geometry.dtype)
                    out = memoryview(plain.view(-1).view(torch.uint8).numpy())
                    if plaintext_length(envelope) != out.nbytes:
                        raise DecryptionFailed
                    ctx = self._context(lease, c, model, version)
                    await asyncio.to_thread(self._cipher.open_into, lease.dek, lease.binding_secret, ctx, envelope, out)
                except DecryptionFailed:
                    failures += 1
                    reason = "integrity"
                    self.stats["integrity_failures"] += 1
                    await self._drop(c)
                    break
                unpack(plain.to(kv.device), kv, slots[c.start : c.end], model.geometry)
                loaded += 1
        finally:
            for f in fetches:
                f.cancel()
            await asyncio.gather(*fetches, return_exceptions=True)
        return RetrieveResult(
            loaded_tokens=chunks[loaded - 1].end if loaded else 0, loaded_chunks=loaded,
            integrity_failures=failures, unavailable=unavailable, reason=reason if loaded < len(chunks) else "",
        )

    async def _opening_lease(self, version: int) -> KeyLease | None:
        """The lease to open an envelope of key ``version`` with: the sealing lease when it is
        that version, else a lease on that version alone (``POST /v1/keys/lease {version}``)."""
        lease = self._lease
        if lease is not None and lease.key_version == version and lease.expires_at - _MARGIN_S > time.time():
            return lease
        held = self._open.get(version)
        if held is not None and held.expires_at - _MARGIN_S > time.time():
            return held
        r = await self._retrying("POST", "/v1/keys/lease", json={"version": version})
        if r.status_code == 404:
            return None
        if r.status_code != 200:
            raise RemoteUnavailable(f"leasing key version {version}: {r.status_code}")
        self._open[version] = got = self._parse_lease(r.json())
        return got

    async def _drop(self, chunk: Chunk) -> None:
        """Delete an inauthentic envelope (best effort: needs the put op)."""
        try:
            await self._send("DELETE", f"/v1/chunks/{chunk.chained_hash.hex()}")
        except GatewayError:
            pass
