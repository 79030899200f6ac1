"""The server's side of the remote data plane: envelopes by chained hash, for workers that talk to
a kvgate server instead of running the core in process (docs/architecture.md, section 3).

``EnvelopePlane`` maps each chained hash to the storage key of the capability's namespace
through the chunk service (``gateway.chunks``), so the same hash from two tenants lands on
unrelated keys, exactly as in process, and every call verifies the capability for its operation
and chunks. ``seal_keys`` (``POST /v1/keys/envelopes``) and the fetch stream (``KeyIssue``) issue
one key per envelope, ``HKDF(dek || binding_secret, salt)``: a worker never holds a tenant's data
key, namespace binding secret or index key; keys are counted, bounded per request and per
capability (``KeyBudgetSpent``), and audited once per request (``key.issue``).
``integrity_failure`` takes a worker's report of an envelope that failed authentication.
Design notes: docs/architecture.md, section 5.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from crypto.envelope import SALT_BYTES
from crypto.errors import KeyUnavailable
from crypto.segments import derive_segment_key
from gateway.chunks.service import ChunkService, KeysUnavailable, NamespaceChunks
from gateway.errors import InvalidRequest, KeyBudgetSpent
from gateway.services.pins import Pins
from storage.types import ChunkKey
from tenancy.keyring import Keyring
from tenancy.namespaces import NamespaceKeys
from tenancy.types import Capability

__all__ = ["EnvelopeKey", "EnvelopePlane", "IssuedKeys", "KeyIssue", "LookupAnswer", "parse_hash"]

_HASH = re.compile(r"[0-9a-f]{64}")


def parse_hash(value: str) -> bytes:
    """A chained hash as 64 lowercase hex characters (a compiled pattern, not a character loop in
    Python: a lookup checks up to 4,096 of them on a load's critical path)."""
    if not isinstance(value, str) or _HASH.fullmatch(value) is None:
        raise InvalidRequest("a chunk hash is 64 lowercase hex characters (sha256)")
    return bytes.fromhex(value)


@dataclass(frozen=True, slots=True)
class EnvelopeKey:
    """One envelope's key as the server issues it: ``key`` is None where its key version is
    unavailable (destroyed, or never existed)."""

    chunk_hash: str
    key_version: int
    salt: bytes
    key: bytes | None = field(repr=False)
    storage_key: str


@dataclass(frozen=True, slots=True)
class IssuedKeys:
    """The answer to one key request: every envelope's key, in request order."""

    tenant: str
    namespace: str
    keys: list[EnvelopeKey]


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    hit_chunks: int
    locations: list[list[str]]
    degraded: str = ""  # why it may be short although chunks are stored (``Located.degraded``)


class EnvelopePlane:
    def __init__(
        self,
        *,
        keyring: Keyring,
        pins: Pins,
        audit: AuditSink,
        chunks: ChunkService,
        max_chunk_bytes: int = 64 << 20,
        max_keys_per_request: int = 4096,
        max_keys_per_capability: int = 1 << 16,
        salt_source: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self.keyring = keyring
        self.pins = pins
        self.audit = audit
        self.chunks = chunks
        self.max_chunk_bytes = max_chunk_bytes
        self.max_keys_per_request = max_keys_per_request
        self.max_keys_per_capability = max_keys_per_capability
        self._salt_source = salt_source
        self._issued: dict[str, tuple[int, float]] = {}  # capability id -> (keys issued, expires at)

    async def opened(self, token: str, op: str, hashes: Sequence[str], *, shared: bool = False) -> NamespaceChunks:
        """The hashes (64 lowercase hex characters each) in the namespace of ``token``, verified
        for ``op`` on every one (its chunk allowlist included): the chunk service's session.
        ``shared``: the caller opens each chunk in the context it is told (published prefixes)."""
        chained = [parse_hash(h) for h in hashes]
        return await self.chunks.session(token, op, chained, shared=shared)

    async def _authorized(self, token: str, op: str, hashes: Sequence[str]) -> tuple[Capability, list[ChunkKey]]:
        opened = await self.opened(token, op, hashes)
        return opened.cap, opened.keys

    async def keys_for(self, token: str, op: str, hashes: Sequence[str]) -> tuple[Capability, list[ChunkKey]]:
        """The capability verified for ``op`` on every hash and the hashes' storage keys in its
        namespace."""
        return await self._authorized(token, op, hashes)

    async def lookup(self, token: str, hashes: Sequence[str], *, shared: bool = False) -> LookupAnswer:
        """Prefix walk over chained hashes: how many leading chunks are stored, and where."""
        if not hashes:
            raise InvalidRequest("hashes must not be empty")
        opened = await self.opened(token, "lookup", hashes, shared=shared)
        found = await opened.locate(where=True)  # one batched check per tier, not per chunk
        hits = found.hits
        self.chunks.counts.lookup(hits, found.degraded)
        return LookupAnswer(hits, found.locations[:hits], found.degraded)

    async def integrity_failure(
        self, token: str, chunk_hash: str, envelope_sha256: bytes, *, actor: Actor | None = None,
    ) -> bool:
        """A worker's report that an envelope it loaded under this capability (op ``get``) failed
        authentication: audited as ``integrity.failure``, and the stored copy dropped where it is
        the envelope of that digest (never a good copy stored since); whether one was dropped."""
        opened = await self.opened(token, "get", [chunk_hash])
        return await opened.integrity_failure(0, actor=actor, envelope_sha256=envelope_sha256)

    async def pin(self, token: str, chunk_hash: str, *, pin: bool = True) -> None:
        cap, keys = await self._authorized(token, "pin", [chunk_hash])
        await self.pins.set(cap, keys, pin=pin, strict=True)

    def issued_to(self, cap_id: str) -> int:
        """Envelope keys issued so far under one capability (by this server)."""
        return self._issued.get(cap_id, (0, 0.0))[0]

    def _charge(self, cap: Capability, n: int) -> int:
        """Count ``n`` keys against the capability's budget (``KeyBudgetSpent`` past it, nothing
        counted); returns its total so far. Expired capabilities' counts are dropped."""
        now = time.time()
        if len(self._issued) > 1024:
            self._issued = {k: v for k, v in self._issued.items() if v[1] > now}
        used = self._issued.get(cap.cap_id, (0, cap.expires_at))[0]
        if used + n > self.max_keys_per_capability:
            raise KeyBudgetSpent()
        self._issued[cap.cap_id] = (used + n, cap.expires_at)
        return used + n

    async def begin_issue(
        self, cap: Capability, purpose: Literal["seal", "open"], n: int, *, actor: Actor | None = None,
        route: str = "/v1/keys/envelopes", ns: NamespaceKeys | None = None,
    ) -> KeyIssue:
        """Start issuing up to ``n`` keys under a verified capability: its namespace keys are
        resolved (unless given) and ``n`` keys charged against its budget (``KeyBudgetSpent``,
        counted as a denial and audited, where that would pass the bound). The caller closes the
        issue."""
        if ns is None:
            ns = await self.chunks.namespace(cap)
        who = actor or Actor(tenant=cap.tenant, token_id=cap.cap_id)
        try:
            total = self._charge(cap, n)
        except KeyBudgetSpent:
            self.chunks.counts.denied()
            self.audit.emit(
                AuditEvent(
                    Actions.KEY_ISSUE, outcome="denied", actor=who,
                    target=Target(tenant=cap.tenant, namespace=cap.namespace, chunk_count=n),
                    details={"purpose": purpose, "cap_id": cap.cap_id, "reason": "key budget spent",
                             "requested": n, "capability_total": self.issued_to(cap.cap_id), "route": route},
                )
            )
            raise
        return KeyIssue(self, cap, ns, purpose, n, total, who, route)

    async def seal_keys(self, token: str, hashes: Sequence[str], *, actor: Actor | None = None) -> IssuedKeys:
        """The keys to seal a batch of envelopes of the capability's namespace with (op ``put``):
        a fresh salt per hash and its key (see the module docstring)."""
        if not hashes:
            raise InvalidRequest("hashes must not be empty")
        if len(hashes) > self.max_keys_per_request:
            raise InvalidRequest(f"at most {self.max_keys_per_request} envelope keys per request")
        chained = [parse_hash(h) for h in hashes]
        cap = self.chunks.authorize(token, "put", hashes)
        await self.chunks.guard(cap, "put", chained)  # a scope's owner: its published chunks only
        issue = await self.begin_issue(cap, "seal", len(hashes), actor=actor)
        try:
            keys = [await issue.seal(h, c) for h, c in zip(hashes, chained, strict=True)]
        except BaseException:
            issue.cancel()  # no key left the server
            raise
        issue.close()
        return IssuedKeys(cap.tenant, cap.namespace, keys)

    def _refund(self, cap: Capability, n: int) -> None:
        if n:
            used, expires = self._issued.get(cap.cap_id, (0, cap.expires_at))
            self._issued[cap.cap_id] = (max(0, used - n), expires)


class KeyIssue:
    """The envelope keys of one request under one capability (``EnvelopePlane.begin_issue``):
    charged against the capability's budget up front, derived one envelope at a time, and closed
    once. ``close`` refunds what was charged and not issued, counts what was
    (``ChunkStats.keys_issued``) and audits one ``key.issue``
    event with the count; ``cancel`` (nothing left the server) refunds it all and audits nothing.

    ``POST /v1/keys/envelopes`` issues a list of keys in one; ``POST /v1/chunks/fetch`` with keys
    issues each envelope's key as the prefix walk reaches it (``gateway.chunks.batches``)."""

    def __init__(
        self, plane: EnvelopePlane, cap: Capability, ns: NamespaceKeys, purpose: Literal["seal", "open"],
        charged: int, total: int, actor: Actor, route: str,
    ) -> None:
        self._plane = plane
        self.cap = cap
        self._ns = ns
        self.purpose = purpose
        self._charged = charged
        self._total = total
        self._actor = actor
        self._route = route
        self._deks: dict[tuple[str, int], bytes | None] = {}
        self._versions: set[int] = set()
        self.issued = 0
        self.unavailable = 0
        self._done = False

    def _take(self) -> None:
        if self._done:
            raise RuntimeError("this key issue is closed")
        if self.issued + self.unavailable >= self._charged:
            raise InvalidRequest("more keys than were asked for")

    async def seal(self, chunk_hash: str, chained: bytes) -> EnvelopeKey:
        """A fresh salt and its key under the active data key (one invocation of it, counted as
        in process)."""
        self._take()
        try:
            version, dek = await self._plane.keyring.encryption_key(self.cap.tenant)
        except KeyUnavailable:  # contention, or the KEK cannot unwrap it now: retry later
            raise KeysUnavailable("no data key can be had now") from None  # a 503 the worker reads as in process
        salt = self._plane._salt_source(SALT_BYTES)
        self.issued += 1
        self._versions.add(version)
        ns = self._ns
        return EnvelopeKey(chunk_hash, version, salt, derive_segment_key(dek, ns.binding_secret, salt), ns.storage_key(chained))

    async def open(
        self, chunk_hash: str, chained: bytes, version: int, salt: bytes, *, ns: NamespaceKeys | None = None,
    ) -> EnvelopeKey:
        """The key of the envelope sealed with ``(version, salt)``; its ``key`` is None where that
        key version is destroyed (or never existed): the envelope is a miss. ``ns``: the
        namespace the envelope is read from where it is not the capability's (a published
        prefix's scope, ``NamespaceChunks.owner_of``)."""
        self._take()
        ns = ns or self._ns
        if (ns.tenant, version) not in self._deks:
            try:
                self._deks[ns.tenant, version] = await self._plane.keyring.decryption_key(ns.tenant, version)
            except KeyUnavailable:
                self._deks[ns.tenant, version] = None
        opener = self._deks[ns.tenant, version]
        if opener is None:
            self.unavailable += 1
            return EnvelopeKey(chunk_hash, version, salt, None, ns.storage_key(chained))
        self.issued += 1
        self._versions.add(version)
        return EnvelopeKey(chunk_hash, version, salt, derive_segment_key(opener, ns.binding_secret, salt), ns.storage_key(chained))

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._plane._refund(self.cap, self._charged)

    def close(self) -> None:
        """Refund what was not issued, count and audit what was (once; later calls do nothing)."""
        if self._done:
            return
        self._done = True
        plane, cap, issued = self._plane, self.cap, self.issued
        plane._refund(cap, self._charged - issued)
        plane.chunks.counts.keys_issued(self.purpose, issued)
        plane.audit.emit(
            AuditEvent(
                Actions.KEY_ISSUE,
                actor=self._actor,
                target=Target(tenant=cap.tenant, namespace=cap.namespace, chunk_count=issued),
                details={
                    "purpose": self.purpose, "cap_id": cap.cap_id, "issued": issued, "unavailable": self.unavailable,
                    "versions": sorted(self._versions), "capability_total": self._total - (self._charged - issued),
                    "route": self._route,
                },
            )
        )
