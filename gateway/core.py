"""The gateway core: the one door for chunk traffic (DESIGN section 3).

Every data operation takes a capability token and verifies it first (lookup, get, put, pin), then
works only inside the capability's tenant and namespace:

    tokens --chain_hashes--> h_i --HMAC(namespace index key)--> storage key
    paged KV --pack--> staging --seal (AES-256-GCM envelope, AAD binds identity)--> tiers
    tiers --open (every tag checked)--> staging --unpack--> paged KV

A chunk that fails authentication, whose key version is destroyed, or whose tier is unreachable
is a miss: counted, audited where it is an integrity failure, and never handed to the engine.
Control operations (clear, move, rotate, tenants) are the admin surface; the server checks roles
before calling them, and every one is audited.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from opentelemetry import trace

from audit.types import Actions, Actor, AuditEvent, AuditSink, Target, record_durably
from crypto.envelope import EnvelopeContext
from crypto.errors import DecryptionFailed, KekError, KeyUnavailable
from crypto.kek import KekProvider
from gateway.chunking import Chunk, InvalidTokens, chain_hashes
from gateway.datapath import DataPath, OpenJob, SealJob
from gateway.errors import AccessDenied, InvalidRequest, TenantUnavailable
from gateway.types import ClearResult, KVModel, LookupResult, RetrieveResult, StoreResult, check_name
from kernels.errors import KVLayoutError
from kernels.layouts import KVGeometry
from kernels.pack import slots_from_block_ids
from kernels.paged import PagedKV
from storage.manager import TierManager
from storage.types import ChunkKey, ChunkNotFound, TierError, TierTimeout
from tenancy.capabilities import CapabilityAuthority, read_unverified
from tenancy.errors import CapabilityDenied, CapabilityRequestInvalid
from tenancy.keyring import Keyring
from tenancy.namespaces import NamespaceDeriver, NamespaceKeys, lp
from tenancy.registry import Registry, TenantDisabled, UnknownTenant
from tenancy.types import Capability

__all__ = ["Gateway", "KVModel", "StoreResult", "LookupResult", "RetrieveResult", "ClearResult"]

log = logging.getLogger("kvgate.core")
# OpenTelemetry API only: a no-op until the process installs a tracer provider (the server does)
_tracer = trace.get_tracer("kvgate.core")

class _KeysUnavailable(Exception):
    """Namespace or data keys cannot be unwrapped now (KEK provider down): a miss, not an error."""

    def __init__(self, chunks: int) -> None:
        super().__init__("keys unavailable")
        self.chunks = chunks


@dataclass(slots=True)
class _Plan:
    """A validated request: its chunks, their storage keys and their slots."""

    cap: Capability
    ns: NamespaceKeys
    chunks: list[Chunk]
    keys: list[ChunkKey]
    slots: torch.Tensor | None
    kv: PagedKV | None


class Gateway:
    def __init__(
        self,
        *,
        registry: Registry,
        keyring: Keyring,
        kek: KekProvider,
        deriver: NamespaceDeriver,
        tiers: TierManager,
        datapath: DataPath,
        authority: CapabilityAuthority,
        audit: AuditSink,
        chunk_tokens: int = 256,
        _bench_shared_tenant: str | None = None,
    ) -> None:
        # Benchmark only (`kvgate bench` timing attack, shared-cache baseline): when set, every
        # verified capability is mapped to this one pseudo-tenant for namespace keys, keyring and
        # envelope context, i.e. isolation is OFF. Never set from Settings or configuration.
        self._bench_shared_tenant = _bench_shared_tenant
        self.registry = registry
        self.keyring = keyring
        self.kek = kek
        self.deriver = deriver
        self.tiers = tiers
        self.datapath = datapath
        self.authority = authority
        self.audit = audit
        self.chunk_tokens = chunk_tokens
        self.stats: Counter[str] = Counter()
        self._ns_cache: dict[tuple[str, str], NamespaceKeys] = {}
        self._ns_lock = asyncio.Lock()

    # -- capabilities ------------------------------------------------------------------------
    async def mint_capability(
        self,
        tenant: str,
        namespace: str,
        ops: Sequence[str],
        ttl: int | None = None,
        *,
        actor: Actor | None = None,
    ) -> str:
        """Mint a capability for an authenticated principal (the caller has checked its roles)."""
        check_name(tenant, "tenant")
        check_name(namespace, "namespace")
        try:
            await self.registry.require_active(tenant)
        except (UnknownTenant, TenantDisabled) as exc:
            raise TenantUnavailable("tenant unavailable") from exc
        try:
            token, cap = self.authority.issue(tenant, namespace, ops, ttl)
        except CapabilityRequestInvalid as exc:
            raise InvalidRequest(str(exc)) from None
        self.audit.emit(
            AuditEvent(
                Actions.CAPABILITY_MINT,
                actor=actor or Actor(tenant=tenant),
                target=Target(tenant=tenant, namespace=namespace),
                details={"cap_id": cap.cap_id, "ops": sorted(cap.ops), "expires_at": cap.expires_at},
            )
        )
        return token

    def authorize(self, token: str, op: str, *, chunks: Sequence[str] = ()) -> Capability:
        """Verify a capability for one operation (and, if the holder restricted it to a chunk
        allowlist, for every chunk named); every denial is audited and raises AccessDenied.

        The work done does not depend on whether the tenant, namespace or chunk exists: the
        check is a MAC chain and a revocation-set lookup, nothing else. The capability alone
        names the tenant and namespace a request works in."""
        try:
            namespace = read_unverified(token).namespace
            return self.authority.verify(token, tenant=None, namespace=namespace, op=op, chunks=chunks)
        except CapabilityDenied as exc:
            self.stats["denials"] += 1
            self.audit.emit(
                AuditEvent(
                    Actions.AUTHZ_DENIED,
                    outcome="denied",
                    details={"op": op, "reason": exc.reason},
                )
            )
            raise AccessDenied(exc.reason) from None

    # -- namespaces --------------------------------------------------------------------------
    def _salt_context(self, tenant: str, namespace: str, epoch: int) -> bytes:
        return lp("kvgate/ns-salt/v1", tenant, namespace, epoch)

    async def namespace_keys(self, tenant: str, namespace: str) -> NamespaceKeys:
        cached = self._ns_cache.get((tenant, namespace))
        if cached is not None:
            return cached
        async with self._ns_lock:
            cached = self._ns_cache.get((tenant, namespace))
            if cached is not None:
                return cached
            try:
                await self.registry.require_active(tenant)
            except (UnknownTenant, TenantDisabled) as exc:
                raise TenantUnavailable("tenant unavailable") from exc
            rec = await self.registry.get_namespace(tenant, namespace)
            if rec is None:
                wrapped = self.kek.wrap(os.urandom(32), self._salt_context(tenant, namespace, 0))
                rec = await self.registry.create_namespace(tenant, namespace, wrapped)
            salt = self.kek.unwrap(rec.wrapped_salt, self._salt_context(tenant, namespace, rec.epoch))
            keys = self.deriver.derive(tenant, namespace, rec.epoch, salt)
            self._ns_cache[(tenant, namespace)] = keys
            return keys

    def forget_namespace(self, tenant: str | None, namespace: str | None = None) -> None:
        """Drop cached namespace keys (after a clear here or, via broadcast, elsewhere); all of
        them when ``tenant`` is None."""
        for key in [
            k for k in self._ns_cache
            if tenant is None or (k[0] == tenant and (namespace is None or k[1] == namespace))
        ]:
            del self._ns_cache[key]

    # -- planning ----------------------------------------------------------------------------
    async def _plan(
        self,
        token: str,
        op: str,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        *,
        kv_layers: Sequence[torch.Tensor] | None = None,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
    ) -> _Plan:
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.detach().cpu().numpy()
        try:
            chunks = chain_hashes(tokens, model.fingerprint, self.chunk_tokens, vocab_size=model.vocab_size)
        except InvalidTokens as exc:
            raise InvalidRequest(str(exc)) from None
        cap = self.authorize(token, op, chunks=[c.chained_hash.hex() for c in chunks])
        if self._bench_shared_tenant is not None:  # benchmark baseline only: no namespaces
            cap = replace(cap, tenant=self._bench_shared_tenant, namespace="default")
        slots = kv = None
        if kv_layers is not None:
            kv, slots = self._slots(model.geometry, kv_layers, chunks[-1].end, block_ids, slot_mapping)
        try:
            ns = await self.namespace_keys(cap.tenant, cap.namespace)
        except TenantUnavailable:
            self.stats["denials"] += 1
            raise AccessDenied("tenant unavailable") from None
        except (KekError, KeyUnavailable) as exc:  # the KEK provider is unreachable
            self.stats["key_unavailable"] += 1
            raise _KeysUnavailable(len(chunks)) from exc
        keys = [ChunkKey(ns.owner, ns.group, ns.storage_key(c.chained_hash)) for c in chunks]
        trace.get_current_span().set_attribute("kvgate.tenant", ns.owner[:16])  # opaque, not the name
        return _Plan(cap, ns, chunks, keys, slots, kv)

    @staticmethod
    def _slots(
        geometry: KVGeometry,
        kv_layers: Sequence[torch.Tensor] | PagedKV,
        num_tokens: int,
        block_ids: Sequence[int] | torch.Tensor | None,
        slot_mapping: Sequence[int] | torch.Tensor | None,
    ) -> tuple[PagedKV, torch.Tensor]:
        """All slots of the request, validated up front so a bad one stores nothing at all."""
        if (block_ids is None) == (slot_mapping is None):
            raise InvalidRequest("give exactly one of block_ids and slot_mapping")
        try:
            kv = PagedKV.of(kv_layers, geometry)
            num_blocks, device = kv.num_blocks, kv.device
            if block_ids is not None:
                slots = slots_from_block_ids(block_ids, geometry.block_size, 0, num_tokens, device=device)
            else:
                slots = torch.as_tensor(slot_mapping).to(device=device)
                if slots.dtype.is_floating_point or slots.dtype == torch.bool or slots.dim() != 1:
                    raise InvalidRequest("slot_mapping must be a 1-D integer sequence")
                slots = slots.to(torch.int64)
                if slots.numel() != num_tokens:
                    raise InvalidRequest(
                        f"slot_mapping has {slots.numel()} slots for {num_tokens} tokens"
                    )
        except KVLayoutError as exc:
            raise InvalidRequest(str(exc)) from None
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= num_blocks * geometry.block_size:
            raise InvalidRequest(f"slots must lie in [0, {num_blocks * geometry.block_size}), got [{lo}, {hi}]")
        return kv, slots

    def _context(self, plan: _Plan, key: ChunkKey, model: KVModel, version: int) -> EnvelopeContext:
        return EnvelopeContext(
            tenant=plan.cap.tenant,
            namespace=plan.cap.namespace,
            storage_key=key.digest,
            model_fingerprint=model.fingerprint_digest,
            key_version=version,
        )

    # -- data operations ---------------------------------------------------------------------
    async def _store(
        self,
        token: str,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
        skip_existing: bool = True,
    ) -> StoreResult:
        """Encrypt and store every chunk of ``tokens`` whose KV sits in ``kv_layers``."""
        try:
            plan = await self._plan(
                token, "put", model, tokens, kv_layers=kv_layers, block_ids=block_ids, slot_mapping=slot_mapping
            )
        except _KeysUnavailable as exc:  # nothing can be sealed now; the engine goes on
            self.stats["store_failures"] += exc.chunks
            return StoreResult(tokens=len(tokens), chunks=exc.chunks, stored=0, skipped=0, bytes_stored=0)
        assert plan.slots is not None and plan.kv is not None
        todo = list(range(len(plan.chunks)))
        if skip_existing:
            present = await self.tiers.contains_many(plan.keys)
            todo = [i for i in todo if not present[i]]
        jobs: list[SealJob] = []
        for n, i in enumerate(todo):
            c = plan.chunks[i]
            if self.datapath.encrypt:
                try:
                    version, dek = await self.keyring.encryption_key(plan.cap.tenant)
                except (KekError, KeyUnavailable):  # the KEK provider is unreachable: store less
                    self.stats["store_failures"] += len(todo) - n
                    self.stats["key_unavailable"] += 1
                    todo = todo[:n]
                    break
            else:  # the benchmark's plaintext baseline
                version, dek = 0, b""
            ctx = self._context(plan, plan.keys[i], model, version)
            jobs.append(SealJob(plan.slots[c.start : c.end], dek, ctx))
        stored_bytes = 0
        gate = asyncio.Semaphore(max(1, self.datapath.threads))

        async def run(batch: list[int]) -> int:
            async with gate:
                envelopes = await self.datapath.run(
                    self.datapath.seal_batch, plan.kv, plan.ns.binding_secret, [jobs[k] for k in batch]
                )
            stored = 0
            for k, env in zip(batch, envelopes):
                try:
                    await self.tiers.put(plan.keys[todo[k]], env)
                    stored += env.nbytes
                except TierError:  # no tier took it: the cache loses this chunk, the engine goes on
                    self.stats["store_failures"] += 1
            return stored

        for n in await asyncio.gather(*(run(b) for b in self._batches(len(jobs), model, plan))):
            stored_bytes += n
        self.stats["chunks_stored"] += len(todo)
        self.stats["bytes_in"] += stored_bytes
        return StoreResult(
            tokens=plan.chunks[-1].end,
            chunks=len(plan.chunks),
            stored=len(todo),
            skipped=len(plan.chunks) - len(todo),
            bytes_stored=stored_bytes,
        )

    def _batches(self, n: int, model: KVModel, plan: _Plan) -> list[list[int]]:
        """Split n chunks into batches for the CPU pool: at most ~16 MiB each (so tier I/O
        overlaps the next batch's CPU work) and at least one per thread when there is enough."""
        chunk_bytes = model.geometry.chunk_nbytes(plan.chunks[0].num_tokens)
        by_size = max(1, (16 << 20) // chunk_bytes)
        by_threads = max(1, -(-n // max(1, self.datapath.threads)))
        size = min(by_size, by_threads)
        return [list(range(k, min(k + size, n))) for k in range(0, n, size)]

    async def _lookup(self, token: str, model: KVModel, tokens: Sequence[int] | torch.Tensor) -> LookupResult:
        """How many leading tokens are stored (prefix walk, stops at the first miss)."""
        try:
            plan = await self._plan(token, "lookup", model, tokens)
        except _KeysUnavailable as exc:
            self.stats["lookup_misses"] += 1
            self.stats["lookup_degraded_key_unavailable"] += 1
            return LookupResult(hit_tokens=0, hit_chunks=0, total_chunks=exc.chunks, degraded="key_unavailable")
        present, errors = await self.tiers.contains_many_checked(plan.keys)
        hits = 0
        for p in present:
            if not p:
                break
            hits += 1
        degraded = ""
        if errors and hits < len(plan.chunks):  # a tier that could not answer may hold the rest
            degraded = "tier_timeout" if any(isinstance(e, TierTimeout) for e in errors) else "tier_unavailable"
            self.stats[f"lookup_degraded_{degraded}"] += 1
        self.stats["lookup_hits" if hits else "lookup_misses"] += 1
        return LookupResult(
            hit_tokens=plan.chunks[hits - 1].end if hits else 0,
            hit_chunks=hits,
            total_chunks=len(plan.chunks),
            degraded=degraded,
        )

    async def _retrieve(
        self,
        token: str,
        model: KVModel,
        tokens: Sequence[int] | torch.Tensor,
        kv_layers: Sequence[torch.Tensor],
        *,
        block_ids: Sequence[int] | torch.Tensor | None = None,
        slot_mapping: Sequence[int] | torch.Tensor | None = None,
    ) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers``.

        Chunks are fetched, authenticated and unpacked in order; the first miss, failed tag,
        unavailable key or unreachable tier ends the prefix. Returns how many tokens were loaded."""
        try:
            plan = await self._plan(
                token, "get", model, tokens, kv_layers=kv_layers, block_ids=block_ids, slot_mapping=slot_mapping
            )
        except _KeysUnavailable:
            self.stats["load_misses"] += 1
            self.stats["load_failed_key_unavailable"] += 1
            return RetrieveResult(
                loaded_tokens=0, loaded_chunks=0, integrity_failures=0, unavailable=1, reason="key_unavailable"
            )
        assert plan.slots is not None and plan.kv is not None
        slots, kv = plan.slots, plan.kv
        stats = {"failures": 0, "unavailable": 0}
        ended: dict[int, str] = {}  # chunk index -> why the prefix ended there (per batch)
        gate = asyncio.Semaphore(max(1, self.datapath.threads))

        async def run(batch: list[int]) -> int:
            """How many leading chunks of the batch were loaded."""
            jobs: list[OpenJob] = []
            tiers: list[str] = []
            for i in batch:
                c, key = plan.chunks[i], plan.keys[i]
                try:
                    found = await self.tiers.get(key)
                except ChunkNotFound as exc:
                    # the manager says "all" missed; a tier that failed on the way is the reason
                    ended[i] = self._read_failure(exc)
                    break
                except TierError as exc:
                    stats["unavailable"] += 1
                    ended[i] = "tier_timeout" if isinstance(exc, TierTimeout) else "tier_unavailable"
                    break
                try:
                    version = self.datapath.key_version(found.data)
                    dek = await self.keyring.decryption_key(plan.cap.tenant, version) if self.datapath.encrypt else b""
                except (KeyUnavailable, KekError):
                    stats["unavailable"] += 1
                    self.stats["key_unavailable"] += 1
                    ended[i] = "key_unavailable"
                    break
                except DecryptionFailed:  # not even a parsable header
                    jobs.append(OpenJob(found.data, slots[c.start : c.end], b"", self._context(plan, key, model, 1)))
                    tiers.append(found.tier)
                    break
                jobs.append(OpenJob(found.data, slots[c.start : c.end], dek, self._context(plan, key, model, version)))
                tiers.append(found.tier)
            if not jobs:
                return 0
            async with gate:
                loaded, failed = await self.datapath.run(self.datapath.open_batch, kv, plan.ns.binding_secret, jobs)
            if failed:
                stats["failures"] += 1
                ended[batch[loaded]] = "integrity"
                await self._integrity_failure(plan, plan.keys[batch[loaded]], tiers[loaded], batch[loaded])
            self.stats["bytes_out"] += sum(j.envelope.nbytes for j in jobs[:loaded])
            return loaded

        # Batches run concurrently; the prefix ends at the first chunk that did not load. A chunk
        # past that point may have been unpacked already: authentic KV in slots the engine
        # recomputes anyway.
        loaded = 0
        batches = self._batches(len(plan.chunks), model, plan)
        for batch, n in zip(batches, await asyncio.gather(*(run(b) for b in batches))):
            loaded += n
            if n < len(batch):
                break
        failures, unavailable = stats["failures"], stats["unavailable"]
        reason = ""
        if loaded < len(plan.chunks):
            reason = ended.get(loaded, "miss")
            self.stats[f"load_failed_{reason}"] += 1
            log.info("load ended at chunk %d of %d: %s", loaded, len(plan.chunks), reason)  # callers warn
        self.stats["chunks_loaded"] += loaded
        self.stats["load_misses" if loaded < len(plan.chunks) else "load_hits"] += 1
        return RetrieveResult(
            loaded_tokens=plan.chunks[loaded - 1].end if loaded else 0,
            loaded_chunks=loaded,
            integrity_failures=failures,
            unavailable=unavailable,
            reason=reason,
        )

    def _read_failure(self, exc: ChunkNotFound) -> str:
        """Why a get found nothing: "miss", unless a tier failed during it (the manager counts
        tier errors and falls through to the next tier, ending in ChunkNotFound)."""
        if any(isinstance(e, TierTimeout) for e in exc.tier_errors):
            return "tier_timeout"
        return "tier_unavailable" if exc.tier_errors else "miss"

    # -- traced entry points: a span each, the tenant only as its opaque owner label -----------
    async def store(self, token: str, model: KVModel, tokens, kv_layers, **kw) -> StoreResult:
        """Encrypt and store every chunk of ``tokens`` whose KV sits in ``kv_layers``
        (``block_ids`` or ``slot_mapping``; ``skip_existing``). See ``_store``."""
        with _tracer.start_as_current_span("kvgate.store") as span:
            res = await self._store(token, model, tokens, kv_layers, **kw)
            span.set_attributes({"kvgate.chunks": res.chunks, "kvgate.stored": res.stored, "kvgate.bytes": res.bytes_stored})
            return res

    async def lookup(self, token: str, model: KVModel, tokens) -> LookupResult:
        """How many leading tokens are stored (prefix walk, stops at the first miss)."""
        with _tracer.start_as_current_span("kvgate.lookup") as span:
            res = await self._lookup(token, model, tokens)
            span.set_attributes({"kvgate.chunks": res.total_chunks, "kvgate.hit_chunks": res.hit_chunks})
            return res

    async def retrieve(self, token: str, model: KVModel, tokens, kv_layers, **kw) -> RetrieveResult:
        """Load the longest stored prefix of ``tokens`` into ``kv_layers``. See ``_retrieve``."""
        with _tracer.start_as_current_span("kvgate.load") as span:
            res = await self._retrieve(token, model, tokens, kv_layers, **kw)
            span.set_attributes({
                "kvgate.loaded_chunks": res.loaded_chunks, "kvgate.integrity_failures": res.integrity_failures,
                "kvgate.unavailable": res.unavailable,
            })
            return res

    async def _integrity_failure(self, plan: _Plan, key: ChunkKey, tier: str, index: int) -> None:
        """A stored envelope failed authentication: count, audit, and drop every copy of it so
        the engine's recompute stores a good one."""
        self.stats["integrity_failures"] += 1
        log.warning("integrity failure on a chunk in tier %s; treated as a miss", tier)
        self.audit.emit(
            AuditEvent(
                Actions.INTEGRITY_FAILURE,
                outcome="failure",
                actor=Actor(tenant=plan.cap.tenant, token_id=plan.cap.cap_id),
                target=Target(
                    tenant=plan.cap.tenant,
                    namespace=plan.cap.namespace,
                    chunk_count=1,
                    chunk_digest=_digest([key]),
                    tier_from=tier,
                ),
                details={"chunk_index": index},
            )
        )
        try:
            await self.tiers.delete(key)
        except TierError:
            pass

    async def pin(self, token: str, model: KVModel, tokens: Sequence[int] | torch.Tensor, *, pin: bool = True) -> int:
        """Pin (or unpin) every stored chunk of ``tokens``; returns how many chunks were changed."""
        plan = await self._plan(token, "pin", model, tokens)
        changed = 0
        for key in plan.keys:
            if pin:
                try:
                    await self.tiers.pin(key)
                except ChunkNotFound:
                    continue
                await self.registry.add_pin(plan.cap.tenant, plan.cap.namespace, key.digest)
            else:
                await self.tiers.unpin(key)
                await self.registry.remove_pin(plan.cap.tenant, plan.cap.namespace, key.digest)
            changed += 1
        self.audit.emit(
            AuditEvent(
                Actions.PIN if pin else Actions.UNPIN,
                actor=Actor(tenant=plan.cap.tenant, token_id=plan.cap.cap_id),
                target=Target(
                    tenant=plan.cap.tenant,
                    namespace=plan.cap.namespace,
                    chunk_count=changed,
                    chunk_digest=_digest(plan.keys),
                ),
            )
        )
        return changed

    async def keys_for(self, tenant: str, namespace: str, model: KVModel, tokens: Sequence[int]) -> list[ChunkKey]:
        """Storage keys of a prompt's chunks (admin operations: move, chunk-list clear)."""
        try:
            chunks = chain_hashes(tokens, model.fingerprint, self.chunk_tokens, vocab_size=model.vocab_size)
        except InvalidTokens as exc:
            raise InvalidRequest(str(exc)) from None
        ns = await self.namespace_keys(tenant, namespace)
        return [ChunkKey(ns.owner, ns.group, ns.storage_key(c.chained_hash)) for c in chunks]

    async def move(self, keys: Sequence[ChunkKey], src: str, dst: str, *, actor: Actor | None = None) -> int:
        """Move chunks between tiers; returns how many moved (absent ones are skipped)."""
        try:
            self.tiers.tier(src), self.tiers.tier(dst)
        except KeyError as exc:
            raise InvalidRequest(str(exc)) from None
        moved = 0
        for key in keys:
            try:
                await self.tiers.move(key, src, dst)
                moved += 1
            except ChunkNotFound:
                continue
        await record_durably(  # a control action: acknowledged only once its event is durable
            self.audit,
            AuditEvent(
                Actions.MOVE,
                actor=actor or Actor(),
                target=Target(chunk_count=moved, chunk_digest=_digest(keys), tier_from=src, tier_to=dst),
                details={"requested": len(keys)},
            )
        )
        return moved

    async def aclose(self) -> None:
        await self.tiers.aclose()
        self.datapath.close()


def _digest(keys: Sequence[ChunkKey]) -> str:
    h = hashlib.sha256()
    for d in sorted(k.digest for k in keys):
        h.update(d.encode())
    return h.hexdigest()
