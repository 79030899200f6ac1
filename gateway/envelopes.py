"""The remote data plane of the gateway core: envelopes by chained hash, for workers that talk to
a kvgate server over HTTP instead of running the core in process (DESIGN section 3, remote mode).

The worker computes the chained hashes itself (it knows the tokens and the model), seals the
envelopes on its own device with a leased data key, and sends ciphertext only. The server maps each
chained hash to the namespaced storage key of the capability's namespace, so the same hash from
two tenants lands on unrelated keys, exactly as in process. Every call verifies the capability
for its operation and, where the holder restricted it to a chunk allowlist, for the chunk.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from crypto.envelope import read_header
from crypto.errors import DecryptionFailed, KeyUnavailable
from gateway.access import Access
from gateway.datapath.stores import prefix_hits
from gateway.errors import AccessDenied, ChunkMissing, InvalidRequest, TenantUnavailable
from gateway.namespaces import NamespaceResolver
from gateway.pins import Pins
from storage.manager import TierManager
from storage.types import ChunkKey, ChunkNotFound, StoredChunk
from tenancy.errors import DependencyUnavailable
from tenancy.keyring import Keyring
from tenancy.types import Capability

__all__ = ["EnvelopePlane", "KeyLease", "LookupAnswer", "parse_hash"]

_HASH_LEN = 64


def parse_hash(value: str) -> bytes:
    """A chained hash as 64 lowercase hex characters."""
    if len(value) != _HASH_LEN or any(c not in "0123456789abcdef" for c in value):
        raise InvalidRequest("a chunk hash is 64 lowercase hex characters (sha256)")
    return bytes.fromhex(value)


@dataclass(frozen=True, slots=True)
class KeyLease:
    """What a remote worker needs to seal and open envelopes of one namespace on its own device.
    Held only in the worker's memory; revoked by secure clear (the key version is destroyed)."""

    tenant: str
    namespace: str
    key_version: int
    invocations: int  # envelopes the worker may seal under this lease
    dek: bytes
    binding_secret: bytes
    index_key: bytes
    expires_at: float


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    hit_chunks: int
    locations: list[list[str]]


class EnvelopePlane:
    def __init__(
        self,
        *,
        access: Access,
        resolver: NamespaceResolver,
        keyring: Keyring,
        tiers: TierManager,
        pins: Pins,
        audit: AuditSink,
        stats: Counter[str],
        max_chunk_bytes: int = 64 << 20,
        lease_ttl_s: float = 300.0,
        lease_invocations: int = 4096,
    ) -> None:
        self.access = access
        self.resolver = resolver
        self.keyring = keyring
        self.tiers = tiers
        self.pins = pins
        self.audit = audit
        self.stats = stats
        self.max_chunk_bytes = max_chunk_bytes
        self.lease_ttl_s = lease_ttl_s
        self.lease_invocations = lease_invocations

    async def _authorized(self, token: str, op: str, hashes: Sequence[str]) -> tuple[Capability, list[ChunkKey]]:
        chained = [parse_hash(h) for h in hashes]
        cap = self.access.authorize(token, op, chunks=list(hashes))
        try:
            keys = self.resolver.chunk_keys(await self.resolver.keys(cap.tenant, cap.namespace), chained)
        except DependencyUnavailable:
            raise  # an outage (503), not a refusal
        except Exception as exc:  # the tenant was disabled after the capability was minted
            raise AccessDenied("tenant unavailable") from exc
        return cap, keys

    async def keys_for(self, token: str, op: str, hashes: Sequence[str]) -> tuple[Capability, list[ChunkKey]]:
        """The capability verified for ``op`` on every hash (its chunk allowlist included) and
        the hashes' storage keys in its namespace (the batched routes, ``gateway.batches``)."""
        return await self._authorized(token, op, hashes)

    async def lookup(self, token: str, hashes: Sequence[str]) -> LookupAnswer:
        """Prefix walk over chained hashes: how many leading chunks are stored, and where."""
        if not hashes:
            raise InvalidRequest("hashes must not be empty")
        _cap, keys = await self._authorized(token, "lookup", hashes)
        present = await self.tiers.contains_many(keys)
        hits = prefix_hits(present)
        self.stats["lookup_hits" if hits else "lookup_misses"] += 1
        locations = [await self.tiers.locate(k) for k in keys[:hits]]
        return LookupAnswer(hits, locations)

    async def put(self, token: str, chunk_hash: str, envelope: memoryview) -> list[str]:
        """Store an envelope the worker sealed; returns the tiers that took it. Only its header is
        checked here (the server holds no plaintext and does not need to decrypt); a bad envelope
        fails authentication at load."""
        _cap, (key,) = await self._authorized(token, "put", [chunk_hash])
        if envelope.nbytes > self.max_chunk_bytes:
            raise InvalidRequest("envelope larger than the configured limit")
        try:
            header = read_header(envelope)
        except DecryptionFailed:
            raise InvalidRequest("not a kvgate envelope") from None
        if header.envelope_length != envelope.nbytes:
            raise InvalidRequest("envelope length does not match its header")
        written = await self.tiers.put(key, envelope)
        self.stats["chunks_stored"] += 1
        self.stats["bytes_in"] += envelope.nbytes
        return written

    async def get(self, token: str, chunk_hash: str) -> StoredChunk:
        _cap, (key,) = await self._authorized(token, "get", [chunk_hash])
        try:
            found = await self.tiers.get(key)
        except ChunkNotFound:
            self.stats["load_misses"] += 1
            raise ChunkMissing("not found") from None
        self.stats["load_hits"] += 1
        self.stats["chunks_loaded"] += 1
        self.stats["bytes_out"] += found.nbytes
        return found

    async def head(self, token: str, chunk_hash: str) -> list[str]:
        _cap, (key,) = await self._authorized(token, "lookup", [chunk_hash])
        where = await self.tiers.locate(key)
        if not where:
            raise ChunkMissing("not found")
        return where

    async def delete(self, token: str, chunk_hash: str) -> None:
        """Remove one chunk of the capability's namespace (an explicit eviction by its writer)."""
        cap, (key,) = await self._authorized(token, "put", [chunk_hash])
        if not await self.tiers.delete(key):
            raise ChunkMissing("not found")
        self.audit.emit(
            AuditEvent(
                Actions.CHUNK_DELETE,
                actor=Actor(tenant=cap.tenant, token_id=cap.cap_id),
                target=Target(tenant=cap.tenant, namespace=cap.namespace, chunk_count=1),
            )
        )

    async def pin(self, token: str, chunk_hash: str, *, pin: bool = True) -> None:
        cap, keys = await self._authorized(token, "pin", [chunk_hash])
        await self.pins.set(cap, keys, pin=pin, strict=True)

    async def lease_key(self, token: str, *, version: int | None = None, actor: Actor | None = None) -> KeyLease:
        """A worker's lease on its tenant's data key (remote mode), short-lived and audited.

        Without ``version``: the current key, to seal with (capability op ``put``; reserves
        invocations against the key's limit). With ``version``: that key, to open envelopes sealed
        before a rotation (op ``get``; no invocations). A destroyed or unknown version is
        ``ChunkMissing``."""
        cap = self.access.authorize(token, "put" if version is None else "get")
        if version is None:
            version, dek, granted = await self.keyring.reserve(cap.tenant, self.lease_invocations)
        else:
            try:
                dek, granted = await self.keyring.decryption_key(cap.tenant, version), 0
            except KeyUnavailable:
                raise ChunkMissing("no such key version") from None
        try:
            ns = await self.resolver.keys(cap.tenant, cap.namespace)
        except TenantUnavailable:
            raise AccessDenied("tenant unavailable") from None
        expires = min(cap.expires_at, time.time() + self.lease_ttl_s)
        self.audit.emit(
            AuditEvent(
                Actions.KEY_LEASE,
                actor=actor or Actor(tenant=cap.tenant, token_id=cap.cap_id),
                target=Target(tenant=cap.tenant, namespace=cap.namespace),
                details={"version": version, "invocations": granted, "expires_at": expires,
                         "purpose": "seal" if granted else "open"},
            )
        )
        return KeyLease(cap.tenant, cap.namespace, version, granted, dek, ns.binding_secret, ns.index_key, expires)
