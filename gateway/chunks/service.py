"""``ChunkService``: authorize, namespace, storage keys, tiers, integrity handling, counters; once,
for the embedded data plane (``gateway.datapath.stores.TierStore``) and the server's chunk
routes (``gateway.chunks.envelopes``, ``gateway.chunks.batches``) alike.

``session`` (or ``open`` for a verified capability) hands out a ``NamespaceChunks``: one request's
chunks in one namespace, with the one prefix walk (``locate``), the one fetch that names why a
chunk could not be had (``fetch``: ``miss``, ``tier_timeout``, ``tier_unavailable``), the one store
path (``reserve``/``commit``/``abort``/``put``, ``roll_back``, ``confirm``) and integrity handling.

Failures before a tier have one answer in both modes: a capability refused or an unknown or
disabled tenant is ``AccessDenied`` (counted); a KEK that cannot unwrap the namespace now is
``KeysUnavailable`` (a miss in process, a 503 from the server); a database down is
``DependencyUnavailable``. ``integrity_failure``: an ``integrity.failure``
audit event and the bad copy dropped, under the loading capability (op ``get``); with the
envelope's digest, never a good copy stored since. ``ChunkStats`` names every counter.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target
from crypto.errors import KekError, KeyUnavailable
from gateway.errors import AccessDenied, NamespaceChanged, TenantUnavailable
from gateway.metrics import KeyPurpose, LoadReason, LookupReason, Metrics, TierReason
from gateway.services.access import Access
from gateway.services.namespaces import NamespaceResolver, keys_digest
from storage.manager import TierManager
from storage.memory import Reservation
from storage.types import ChunkKey, ChunkNotFound, StoredChunk, TierError, failure_reason
from tenancy.errors import DependencyUnavailable
from tenancy.namespaces import NamespaceKeys
from tenancy.sharing import SCOPE_NAMESPACE, is_scope_owner
from tenancy.types import Capability

if TYPE_CHECKING:
    from gateway.services.prefixes import Prefixes

__all__ = [
    "KEYS_UNAVAILABLE", "ChunkService", "ChunkStats", "FetchFailed", "Found", "KeysUnavailable", "Located", "NamespaceChunks",
    "SharedPart", "prefix_hits",
]


KEYS_UNAVAILABLE = "urn:kvgate:problem:keys-unavailable"
"""The problem type of the server's 503 for ``KeysUnavailable`` (a remote worker raises it again)."""


class KeysUnavailable(Exception):
    """Namespace or data keys cannot be had now (the KEK provider cannot unwrap them): a miss in
    process, a 503 with Retry-After from the server (problem type ``KEYS_UNAVAILABLE``) that a
    remote worker turns back into this; never a refusal."""

    dependency = "the key provider"


class FetchFailed(Exception):
    """A chunk could not be fetched: ``reason`` is ``miss``, ``tier_timeout`` or
    ``tier_unavailable``; ``unavailable`` where no tier answered at all (not even with a miss)."""

    def __init__(self, reason: LoadReason, *, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unavailable = unavailable


def prefix_hits(present: Sequence[bool]) -> int:
    """The prefix walk: how many leading chunks are present (it stops at the first miss)."""
    for i, p in enumerate(present):
        if not p:
            return i
    return len(present)


@dataclass(slots=True)
class Located:
    """What the tiers hold of a request's chunks: ``present`` per chunk, the ``errors`` of tiers
    that could not answer (a chunk they hold reads as absent), ``locations`` the tiers of each
    chunk where they were asked for. ``hits`` and ``degraded`` are the prefix walk's answer."""

    present: list[bool]
    errors: list[BaseException] = field(default_factory=list)
    locations: list[list[str]] = field(default_factory=list)
    reported: TierReason | Literal[""] = ""  # the reason a kvgate server gave (remote mode)

    @property
    def hits(self) -> int:
        return prefix_hits(self.present)

    @property
    def degraded(self) -> TierReason | Literal[""]:
        """Why the walk may have ended short (``tier_timeout``/``tier_unavailable``: a tier that
        could not answer may hold the rest); ``""`` where it did not end short or none failed."""
        if self.hits == len(self.present):
            return ""
        return self.reported or failure_reason(self.errors)


@dataclass(frozen=True, slots=True)
class SharedPart:
    """The leading ``count`` chunks of a read come from a published prefix: the namespace of the
    scope's owner (``ns``: its storage keys, its binding secret, its tenant in the envelope
    context; docs/architecture.md, "Published prefixes")."""

    count: int
    ns: NamespaceKeys


@dataclass(slots=True)
class Found:
    chunk: StoredChunk
    passed_over: list[TierError]  # faster tiers that failed before this one served it


class ChunkStats:
    """The chunk path's events, counted in ``gateway.metrics.Metrics`` (where each counter is
    declared): both tier sides and the data plane of either mode count through one of these."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def denied(self) -> None:
        self.metrics.denials += 1

    def key_unavailable(self) -> None:
        self.metrics.key_unavailable += 1

    def lookup(self, hits: int, degraded: LookupReason | Literal[""] = "") -> None:
        """One lookup answered (``degraded``: why it may be short)."""
        m = self.metrics
        if degraded:
            m.lookup_degraded[degraded] += 1
        if hits:
            m.lookup_hits += 1
        else:
            m.lookup_misses += 1

    def load_ended(self, reason: LoadReason) -> None:
        """A load that ended before the prefix it asked for."""
        self.metrics.load_misses += 1
        self.metrics.load_failed[reason] += 1

    def load_hit(self) -> None:
        self.metrics.load_hits += 1

    def load_degraded(self, reason: TierReason | Literal[""]) -> None:
        """A load a slower tier served because a faster one failed."""
        if reason:
            self.metrics.load_degraded[reason] += 1

    def loaded(self, chunks: int, nbytes: int = 0) -> None:
        self.metrics.chunks_loaded += chunks
        self.metrics.bytes_out += nbytes

    def shared_loaded(self) -> None:
        """A published prefix's chunk read from its scope for a member."""
        self.metrics.shared_chunks_loaded += 1

    def loaded_bytes(self, nbytes: int) -> None:
        self.metrics.bytes_out += nbytes

    def stored(self, chunks: int, nbytes: int) -> None:
        self.metrics.chunks_stored += chunks
        self.metrics.bytes_in += nbytes

    def store_failed(self, chunks: int) -> None:
        self.metrics.store_failures += chunks

    def rolled_back(self, removed: int, left: int) -> None:
        self.metrics.store_rollback_removed += removed
        self.metrics.store_rollback_left += left

    def namespace_changed(self) -> None:
        """A store refused whole: it was sealed for a namespace epoch a clear has ended."""
        self.metrics.stores_namespace_changed += 1

    def integrity_failure(self) -> None:
        """An envelope that failed authentication where it was opened."""
        self.metrics.integrity_failures += 1

    def integrity_reported(self) -> None:
        """An integrity failure handled by the chunk service (audited, its copy dropped)."""
        self.metrics.integrity_failures_reported += 1

    def keys_issued(self, purpose: KeyPurpose, n: int) -> None:
        self.metrics.envelope_keys_issued[purpose] += n


class ChunkService:
    def __init__(
        self, *, access: Access, resolver: NamespaceResolver, tiers: TierManager, audit: AuditSink,
        metrics: Metrics,
    ) -> None:
        self.access = access
        self.resolver = resolver
        self.tiers = tiers
        self.audit = audit
        self.counts = ChunkStats(metrics)
        self.shared: Prefixes | None = None  # published prefixes (set where the runtime has them)

    def authorize(self, token: str, op: str, chunk_hashes: Sequence[str]) -> Capability:
        """The capability verified for ``op`` on every chunk (its chunk allowlist included)."""
        return self.access.authorize(token, op, chunks=list(chunk_hashes))

    async def namespace(self, cap: Capability) -> NamespaceKeys:
        """The capability's namespace keys (see the module docstring for what each failure is)."""
        try:
            return await self.resolver.keys(cap.tenant, cap.namespace)
        except TenantUnavailable:  # unknown, or disabled after the capability was minted
            self.counts.denied()
            raise AccessDenied("tenant unavailable") from None
        except (KekError, KeyUnavailable) as exc:
            self.counts.key_unavailable()
            raise KeysUnavailable("the key-encryption key cannot unwrap this namespace now") from exc

    async def open(
        self, cap: Capability, chained_hashes: Sequence[bytes], *, op: str = "", shared: bool = False,
    ) -> NamespaceChunks:
        """The chunks of ``chained_hashes`` in the namespace of a verified capability (for ``op``).

        Published prefixes: a capability of a scope's owner works only on its scope's published
        chunks (``Prefixes.check_write``). With ``shared`` (a caller that opens each chunk in the
        context it names), a read's leading chunks that a scope of the capability publishes are
        read from that scope's namespace, and a store's are reported present where the scope
        holds them (so they are not stored again) while whatever is written stays in the
        capability's own namespace: no member's request ever writes a scope."""
        ns = await self.namespace(cap)
        keys = self.resolver.chunk_keys(ns, chained_hashes)
        prefixes = self.shared
        if is_scope_owner(cap.tenant):
            await self.guard(cap, op, chained_hashes)
        elif prefixes is not None and shared and cap.scopes and op in ("lookup", "get", "put"):
            found = await prefixes.match(cap, chained_hashes)
            if found is not None:
                scope_ns = await self.namespace_of(found.owner, SCOPE_NAMESPACE)
                scope_keys = self.resolver.chunk_keys(scope_ns, chained_hashes[: found.count])
                if op == "put":
                    return NamespaceChunks(self, cap, ns, keys, probe=scope_keys + keys[found.count :])
                part = SharedPart(found.count, scope_ns)
                return NamespaceChunks(self, cap, ns, scope_keys + keys[found.count :], shared=part)
        return NamespaceChunks(self, cap, ns, keys)

    async def guard(self, cap: Capability, op: str, chained_hashes: Sequence[bytes]) -> None:
        """A capability of a sharing scope's owner works only on its scope's published chunks
        (``Prefixes.check_write``; refused outright where this process has no published
        prefixes); any other capability passes."""
        if not is_scope_owner(cap.tenant):
            return
        if self.shared is None:
            self.access.denied(op, "published prefixes are not served here")
            raise AccessDenied("published prefixes are not served here")
        await self.shared.check_write(cap, op, chained_hashes)

    async def namespace_of(self, owner: str, namespace: str) -> NamespaceKeys:
        """A scope's namespace keys (a KEK that cannot unwrap them now: ``KeysUnavailable``)."""
        try:
            return await self.resolver.keys(owner, namespace)
        except TenantUnavailable:  # the scope's keys are gone (a revoke racing this read)
            raise KeysUnavailable("the published prefix's keys are gone") from None
        except (KekError, KeyUnavailable) as exc:
            self.counts.key_unavailable()
            raise KeysUnavailable("the key-encryption key cannot unwrap this namespace now") from exc

    async def epoch_now(self, ns: NamespaceKeys) -> int:
        """The epoch of ``ns``'s namespace as the registry holds it now (-1: the namespace is
        gone). A clear bumps it there before it deletes a chunk, so a read after a chunk landed
        sees any clear whose deletion could have missed it, in this process or another. Where the
        registry cannot be read, this process's view answers (its cached keys, dropped by a clear
        here or by its broadcast); where that cannot be had either, ``ns.epoch``."""
        try:
            rec = await self.resolver.registry.get_namespace(ns.tenant, ns.namespace)
        except DependencyUnavailable:
            try:
                return (await self.resolver.keys(ns.tenant, ns.namespace)).epoch
            except (DependencyUnavailable, TenantUnavailable, KekError, KeyUnavailable):
                return ns.epoch
        return rec.epoch if rec is not None else -1

    async def session(
        self, token: str, op: str, chained_hashes: Sequence[bytes], *, shared: bool = False,
    ) -> NamespaceChunks:
        """``token`` verified for ``op`` on every chunk, then ``open``."""
        cap = self.authorize(token, op, [h.hex() for h in chained_hashes])
        return await self.open(cap, chained_hashes, op=op, shared=shared)

    async def integrity_failure(
        self, cap: Capability, key: ChunkKey, *, tier: str | None = None, index: int | None = None,
        actor: Actor | None = None, envelope_sha256: bytes | None = None, published: bool = False,
    ) -> bool:
        """Audit an envelope that failed authentication and drop its copies; whether any was
        dropped. With ``envelope_sha256`` only a stored copy with that digest is dropped. ``tier``:
        where the bad copy came from (default: the tier that holds it now). ``published``: a
        chunk of a published prefix, audited and never dropped here."""
        self.counts.integrity_reported()
        dropped, kept = False, ""
        if published:
            kept = "a published chunk: only its publisher replaces it"
        try:
            if envelope_sha256 is not None:
                found = await self.tiers.get(key)
                tier = tier or found.tier
                if not hmac.compare_digest(hashlib.sha256(found.data).digest(), envelope_sha256):
                    kept = "the stored copy is another envelope"
            if not kept:
                dropped = await self.tiers.delete(key) > 0
        except ChunkNotFound:
            kept = "no copy is stored"
        except TierError as exc:
            kept = f"tier error: {type(exc).__name__}"
        details: dict[str, object] = {"dropped": dropped}
        if published:
            details["published"] = True
        if index is not None:
            details["chunk_index"] = index
        if kept:
            details["kept"] = kept
        self.audit.emit(
            AuditEvent(
                Actions.INTEGRITY_FAILURE,
                outcome="failure",
                actor=actor or Actor(tenant=cap.tenant, token_id=cap.cap_id),
                target=Target(
                    tenant=cap.tenant, namespace=cap.namespace, chunk_count=1, chunk_digest=keys_digest([key]),
                    tier_from=tier or "unknown",
                ),
                details=details,
            )
        )
        return dropped


class NamespaceChunks:
    """One request's chunks in one namespace (``ChunkService.open``): chunk ``i`` is the ``i``-th
    chained hash it was opened with, stored under ``keys[i]``. A read whose leading chunks are a
    published prefix (``shared``) reads those from the scope's namespace (``owner_of``); a store
    asks whether ``probe`` (the scope's keys for those chunks) is present, and writes ``keys``."""

    def __init__(
        self, service: ChunkService, cap: Capability, ns: NamespaceKeys, keys: list[ChunkKey], *,
        shared: SharedPart | None = None, probe: list[ChunkKey] | None = None,
    ) -> None:
        self.service = service
        self.tiers = service.tiers
        self.counts = service.counts
        self.cap = cap
        self.ns = ns
        self.keys = keys
        self.shared = shared
        self._probe = probe if probe is not None else keys
        self._written: list[ChunkKey] = []  # what ``commit`` and ``put`` stored, for ``confirm``
        self._cancelled = False  # a reserved extent a clear cancelled before its commit

    @property
    def shared_count(self) -> int:
        """How many leading chunks are read from a published prefix."""
        return self.shared.count if self.shared is not None else 0

    def owner_of(self, i: int) -> NamespaceKeys:
        """The namespace chunk ``i`` is read from: its tenant (or scope owner), namespace, binding
        secret; the envelope's context names them."""
        shared = self.shared
        return shared.ns if shared is not None and i < shared.count else self.ns

    async def locate(self, *, where: bool = False) -> Located:
        """What the tiers hold (``Located``: the prefix walk). ``where``: each chunk's tiers too
        (every tier asked at once); else the tiers are asked fastest first, only for what is not
        found yet."""
        if where:
            locations, errors = await self.tiers.locate_many(self._probe)
            return Located([bool(w) for w in locations], list(errors), locations)
        present, errors = await self.tiers.contains_many_checked(self._probe)
        return Located(list(present), list(errors))

    async def fetch(self, i: int) -> Found:
        """Chunk ``i`` from the first tier that has it; FetchFailed with the reason where none
        does (a tier that failed on the way is the reason, not the miss)."""
        try:
            found, passed_over = await self.tiers.get_checked(self.keys[i])
        except ChunkNotFound as exc:
            raise FetchFailed(failure_reason(exc.tier_errors) or "miss") from None
        except TierError as exc:
            raise FetchFailed(failure_reason([exc]) or "tier_unavailable", unavailable=True) from None
        if i < self.shared_count:
            self.counts.shared_loaded()
        return Found(found, passed_over)

    def reserve(self, i: int, nbytes: int) -> Reservation | None:
        """An extent of the fastest tier to put chunk ``i``'s envelope in, or None (no room, or
        a tier that hands none out: then ``put``)."""
        if not self.tiers.can_reserve:
            return None
        try:
            return self.tiers.reserve(self.keys[i], nbytes)
        except (TierError, TypeError, ValueError):  # full (or pinned out)
            return None

    async def commit(self, slot: Reservation) -> list[str]:
        """Publish a reserved extent; the tier that took it (slower tiers are written behind it),
        none where a clear or close cancelled it."""
        if not await self.tiers.commit(slot):
            self._cancelled = True
            return []
        self._written.append(slot.key)
        return [self.tiers.names[0]]

    def abort(self, slot: Reservation) -> None:
        self.tiers.abort(slot)

    async def put(self, i: int, envelope: memoryview) -> list[str]:
        """Store chunk ``i``'s envelope; the tiers that took it (TierError where none did)."""
        self._written.append(self.keys[i])  # before: a write may land although the put fails
        return await self.tiers.put(self.keys[i], envelope)

    async def confirm(self) -> None:
        """Once a store's chunks are in: is the namespace still at the epoch this session's
        storage keys are of (``ChunkService.epoch_now``)? If a clear bumped it meanwhile, its
        deletion may have passed before these chunks landed, where nothing could ever load them
        and a clear was acknowledged to have removed them: everything this session stored is
        removed (counted as a rollback) and ``NamespaceChanged`` raised. No check where nothing
        was stored, unless a clear cancelled a reserved extent (then the store is refused too)."""
        written, self._written = self._written, []
        cancelled, self._cancelled = self._cancelled, False
        if not (written or cancelled) or await self.service.epoch_now(self.ns) == self.ns.epoch:
            return
        left = await self.tiers.delete_many(written)
        self.counts.rolled_back(len(written) - len(left), len(left))
        raise NamespaceChanged()

    async def roll_back(self, indices: Sequence[int]) -> int:
        """Remove these chunks from every tier, best effort; how many a tier that could not be
        reached may still hold (whole, and only this namespace can load them). Counted."""
        left = await self.tiers.delete_many([self.keys[i] for i in indices])
        self.counts.rolled_back(len(indices) - len(left), len(left))
        return len(left)

    async def integrity_failure(
        self, i: int, *, tier: str | None = None, actor: Actor | None = None, envelope_sha256: bytes | None = None,
        index: int | None = None,
    ) -> bool:
        """Chunk ``i``'s envelope failed authentication (``ChunkService.integrity_failure``). A
        published chunk is audited and kept: only its publisher replaces it (a member's report
        never deletes what every member reads)."""
        if i < self.shared_count:
            return await self.service.integrity_failure(
                self.cap, self.keys[i], tier=tier, index=index, actor=actor, envelope_sha256=envelope_sha256,
                published=True,
            )
        return await self.service.integrity_failure(
            self.cap, self.keys[i], tier=tier, index=index, actor=actor, envelope_sha256=envelope_sha256,
        )
