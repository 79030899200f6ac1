"""Remote mode (DESIGN section 3): a worker that holds no tier credentials talks to a kvgate server.

``RemoteGateway(base_url, bearer_token)`` mirrors ``gateway.core.Gateway``'s data operations
(``store`` / ``lookup`` / ``retrieve``, minus the capability argument: it mints and renews its own)
and does on the worker everything that touches plaintext, with the core's own data path
(``gateway.datapath``: the same sealers, on the worker's device; this module is only the
``ChunkStore`` that speaks HTTP):

    tokens --chain_hashes--> h_i                       (same chunk size as the server)
    POST /v1/keys/envelopes {seal: h_0..h_n} --> per h_i: salt, key, storage key, key version
    paged KV --pack--> chunk --seal (that envelope's key and salt, AAD: tenant, namespace,
        storage key, model fingerprint, key version)--> PUT /v1/chunks/{h_i}
    GET /v1/chunks/{h_i} --read headers--> POST /v1/keys/envelopes {open: (h_i, version, salt)...}
        --open (every tag checked)--> chunk --unpack--> paged KV

The worker never holds the tenant's data key, the namespace binding secret or the index key: the
server issues one key per envelope (``HKDF(dek || binding_secret, salt)``, the derivation of
embedded mode, so an envelope stored remotely opens in the core and back), for all the chunks of
a request in one call, counted and audited there. A key opens only the envelope that carries its
salt; keys live in the request's session and are dropped with it. A chunk that fails
authentication, whose key version is destroyed, or cannot be fetched ends the loaded prefix: a
miss, counted, never handed to the engine (an inauthentic one is also deleted, so a recompute
stores a good copy).

A 403 on any call (the tenant was cleared, its capabilities revoked, or the capability's key
budget is spent) drops the cached capability and retries once with a fresh one.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

import httpx
import torch

from crypto.envelope import ChunkCipher, EnvelopeContext, EnvelopeKeys, IssuedKey
from gateway.chunking import Chunk
from gateway.datapath.path import DataPath
from gateway.datapath.plane import DataPlane
from gateway.datapath.stores import Fetched, FetchFailed, KeyRef, Presence, Reserved
from gateway.errors import AccessDenied, GatewayError, InvalidRequest
from gateway.types import KVModel, LookupResult, RetrieveResult, StoreResult

__all__ = ["RemoteGateway", "RemoteUnavailable"]

_MARGIN_S = 15.0  # renew a capability this long before it expires
_FETCH_CONCURRENCY = 8
_KEYS_PER_CALL = 4096  # the server's bound per key request


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
        threads: int = 2,
        device_cipher: str = "auto",
        device_aes: str = "auto",
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
        self._plane = DataPlane(
            DataPath(ChunkCipher(segment_bytes=segment_bytes), threads, device_cipher=device_cipher, device_aes=device_aes),
            chunk_tokens, Counter(),
        )
        self._cap: _Cap | None = None
        self.stats: Counter[str] = self._plane.stats

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._forget()
        self._plane.datapath.close()
        if self._own_http:
            await self._http.aclose()

    # -- HTTP --------------------------------------------------------------------------------
    async def _send(self, method: str, path: str, *, cap: bool = True, **kw: Any) -> httpx.Response:
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

    async def _retrying(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """One retry with a fresh capability after a 403 (revoked by a clear, or its key budget spent)."""
        try:
            return await self._send(method, path, **kw)
        except AccessDenied:
            self._forget()
            return await self._send(method, path, **kw)

    def _forget(self) -> None:
        """Drop the capability (after a revocation); keys are held only by a request's session."""
        self._cap = None

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
    ) -> StoreResult:
        """Seal every chunk of ``tokens`` on this worker (its device, as embedded mode does) and
        PUT the envelopes."""
        return await self._plane.store(
            self, "", model, tokens, kv_layers, block_ids=block_ids, slot_mapping=slot_mapping,
            skip_existing=skip_existing,
        )

    async def retrieve(
        self,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
    ) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers`` (GET, open, scatter)."""
        return await self._plane.retrieve(
            self, "", model, tokens, kv_layers, block_ids=block_ids, slot_mapping=slot_mapping
        )

    async def _fetch(self, path: str, gate: asyncio.Semaphore) -> httpx.Response | None:
        async with gate:
            try:
                r = await self._retrying("GET", path)
            except RemoteUnavailable:
                self.stats["unavailable"] += 1
                return None
        return r if r.status_code == 200 else None

    async def _drop(self, chunk: Chunk) -> None:
        """Delete an inauthentic envelope (best effort: needs the put op)."""
        try:
            await self._send("DELETE", f"/v1/chunks/{chunk.chained_hash.hex()}")
        except GatewayError:
            pass


class _HttpSession:
    """One request against the server: the keys of its envelopes are asked for in one call each
    way, and held only here."""

    keys_local = False  # every key is the server's answer: one call per request

    def __init__(self, client: RemoteGateway, chunks: Sequence[Chunk]) -> None:
        self.client = client
        self.chunks = chunks
        self._scope: tuple[str, str] | None = None  # tenant, namespace (from the key answer)
        self._storage_keys: dict[int, str] = {}
        self._fetches: dict[int, asyncio.Future[httpx.Response | None]] = {}

    def context(self, i: int, model: KVModel, version: int) -> EnvelopeContext:
        storage_key = self._storage_keys.get(i)
        if self._scope is None or storage_key is None:  # no key asked for (an unparsable header):
            return EnvelopeContext(tenant="-", namespace="-", storage_key="0" * 64,  # cannot authenticate
                                   model_fingerprint=model.fingerprint_digest, key_version=version)
        return EnvelopeContext(
            tenant=self._scope[0],
            namespace=self._scope[1],
            storage_key=storage_key,
            model_fingerprint=model.fingerprint_digest,
            key_version=version,
        )

    async def _keys(self, indices: Sequence[int], body: dict[str, Any]) -> list[dict[str, Any]]:
        """Ask for the keys of ``indices`` (``body`` without its list) and record their storage keys."""
        got = await self.client.envelope_keys(body)
        items: list[dict[str, Any]] = got["keys"]
        if len(items) != len(indices) or any(
            item["hash"] != self.chunks[i].chained_hash.hex() for i, item in zip(indices, items, strict=True)
        ):
            raise RemoteUnavailable("envelope keys: the answer does not match the request")
        self._scope = (got["tenant"], got["namespace"])
        for i, item in zip(indices, items, strict=True):
            self._storage_keys[i] = item["storage_key"]
        return items

    async def sealing_keys(self, indices: Sequence[int]) -> list[tuple[int, EnvelopeKeys]]:
        out: list[tuple[int, EnvelopeKeys]] = []
        for at in range(0, len(indices), _KEYS_PER_CALL):
            part = indices[at : at + _KEYS_PER_CALL]
            body = {"purpose": "seal", "hashes": [self.chunks[i].chained_hash.hex() for i in part]}
            for item in await self._keys(part, body):
                out.append((int(item["key_version"]), _issued(item)))
        return out

    async def opening_keys(self, refs: Sequence[tuple[int, KeyRef]]) -> list[EnvelopeKeys | None]:
        out: list[EnvelopeKeys | None] = []
        for at in range(0, len(refs), _KEYS_PER_CALL):
            part = refs[at : at + _KEYS_PER_CALL]
            envelopes = [
                {"hash": self.chunks[i].chained_hash.hex(), "key_version": version,
                 "salt": base64.b64encode(salt).decode()}
                for i, (version, salt) in part
            ]
            for item in await self._keys([i for i, _ref in part], {"purpose": "open", "envelopes": envelopes}):
                if item["key"] is None:  # that key version is destroyed (or never existed): a miss
                    self.client.stats["unavailable"] += 1
                    out.append(None)
                else:
                    out.append(_issued(item))
        return out

    async def presence(self) -> Presence:
        body = {"hashes": [c.chained_hash.hex() for c in self.chunks]}
        r = await self.client._retrying("POST", "/v1/lookup", json=body)
        got = r.json()
        hits = int(got["hit_chunks"])
        return Presence([i < hits for i in range(len(self.chunks))], locations=got.get("locations", []))

    def prefetch(self, indices: Sequence[int]) -> None:
        gate = asyncio.Semaphore(_FETCH_CONCURRENCY)
        for i in indices:
            if i not in self._fetches:
                path = f"/v1/chunks/{self.chunks[i].chained_hash.hex()}"
                self._fetches[i] = asyncio.ensure_future(self.client._fetch(path, gate))

    async def fetch(self, i: int) -> Fetched:
        if i not in self._fetches:
            self.prefetch([i])
        r = await self._fetches[i]
        if r is None:
            raise FetchFailed("miss")
        return Fetched(memoryview(r.content), "remote")

    async def put(self, i: int, envelope: memoryview) -> None:
        try:
            await self.client._send("PUT", f"/v1/chunks/{self.chunks[i].chained_hash.hex()}", content=bytes(envelope))
        except AccessDenied:
            self.client._forget()  # revoked (a clear): the key it was sealed under is gone too
            raise

    def reserve(self, i: int, nbytes: int) -> Reserved | None:
        return None  # envelopes are sent, not kept here

    async def commit(self, reserved: Reserved) -> bool:
        raise AssertionError("nothing is reserved in remote mode")

    def abort(self, reserved: Reserved) -> None:
        return None

    async def integrity_failure(self, i: int, tier: str) -> None:
        self.client.stats["integrity_failures"] += 1
        await self.client._drop(self.chunks[i])

    async def aclose(self) -> None:
        for f in self._fetches.values():
            f.cancel()
        await asyncio.gather(*self._fetches.values(), return_exceptions=True)
        self._fetches.clear()


def _issued(item: dict[str, Any]) -> IssuedKey:
    """One envelope's key from the server's answer (a malformed one is the server's failure)."""
    try:
        return IssuedKey(base64.b64decode(item["salt"], validate=True), base64.b64decode(item["key"], validate=True))
    except (ValueError, TypeError):
        raise RemoteUnavailable("envelope keys: a malformed key") from None
