"""Wiring: build the services from Settings, once each (nothing at import time).

``open_runtime(settings)`` checks the schema (refusing to start on one that is behind), loads or
creates the KEK-wrapped gateway secrets, opens the tiers, starts the audit writer, opens the
audit signer and starts periodic checkpoints, resumes any interrupted secure clear, and returns
the ``Runtime`` record of what it built, to close when done (the server holds one).
``open_embedded`` adds the ``Gateway`` over those services, for a process that runs chunk traffic
itself; ``gateway_over`` builds one over any Runtime.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from audit.checkpointer import Checkpointer
from audit.signing import AuditSigner
from audit.writer import AuditWriter
from crypto.contexts import secret_context
from crypto.kek import KekProvider, LocalFileKek, Secret
from gateway.chunks.service import ChunkService
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.protocol.shmpages import POPULATE_WRITE, populate_behind, prefault_behind
from gateway.services.access import Access
from gateway.services.admin import Admin
from gateway.services.auditing import close_signer, make_audit_signer, make_checkpointer
from gateway.services.broadcast import Broadcaster
from gateway.services.core import Gateway
from gateway.services.dbschema import check_schema
from gateway.services.invalidation import Invalidation
from gateway.services.namespaces import NamespaceResolver
from gateway.services.pins import Pins
from gateway.services.prefixes import Prefixes
from storage.base import Tier
from storage.disk import DiskTier
from storage.manager import TierManager
from storage.memory import MemoryTier
from tenancy.capabilities import CapabilityAuthority, RevocationList
from tenancy.keyring import Keyring
from tenancy.namespaces import NamespaceDeriver
from tenancy.registry import Registry

if TYPE_CHECKING:
    from gateway.datapath.path import DataPath

__all__ = ["EmbeddedRuntime", "Runtime", "gateway_over", "make_datapath", "make_kek", "open_embedded", "open_runtime"]


def make_datapath(settings: Settings) -> DataPath:
    """The data path of this process (loads torch: called at the first data operation)."""
    from crypto.envelope import ChunkCipher
    from gateway.datapath.path import DataPath

    return DataPath(
        ChunkCipher(segment_bytes=settings.segment_bytes), settings.cpu_threads,
        device_cipher=settings.device_cipher, device_aes=settings.device_aes, store_nice=settings.store_nice,
        store_prefault=settings.store_prefault,
    )


def make_kek(settings: Settings) -> KekProvider:
    """The configured KEK provider (HSM and KMS libraries are imported only when chosen)."""
    if settings.kek_provider == "pkcs11":
        from crypto.kek import Secret
        from crypto.kek_pkcs11 import Pkcs11Kek

        assert settings.pkcs11_module and settings.pkcs11_token_label and settings.pkcs11_pin  # validated
        return Pkcs11Kek(
            settings.pkcs11_module, settings.pkcs11_token_label,
            Secret(settings.pkcs11_pin.get_secret_value().encode("utf-8")), settings.pkcs11_key_label,
        )
    if settings.kek_provider == "kms":
        from crypto.kek_kms import KmsKek

        assert settings.kms_key_id  # validated
        return KmsKek(
            settings.kms_key_id, region=settings.kms_region, endpoint_url=settings.kms_endpoint_url,
            previous_key_ids=settings.kms_previous_key_ids, state_ttl_s=settings.kms_key_state_ttl_s,
        )
    settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    return LocalFileKek(settings.kek_path)


async def _gateway_secret(registry: Registry, kek: KekProvider, name: str) -> bytes:
    context = secret_context(name)
    stored = await registry.get_secret(name)
    if stored is None:
        wrapped = await asyncio.to_thread(kek.wrap, os.urandom(32), context)
        stored = await registry.put_secret_if_absent(name, wrapped, kek.key_id)
    return await asyncio.to_thread(kek.unwrap, stored[0], context)


async def _tiers(settings: Settings) -> list[Tier]:
    tiers: list[Tier] = []
    for name in settings.tiers:
        if name == "memory":
            memory = MemoryTier(
                settings.memory_bytes, owner_quota_bytes=settings.memory_owner_quota_bytes,
                prefault=settings.memory_prefault == "start", group_arenas=settings.shm_max_bytes > 0 and settings.shm_arenas,
                ahead_bytes=settings.memory_bytes // 2 if settings.shm_arena_ahead_bytes is None else settings.shm_arena_ahead_bytes,
                populate=prefault_behind,
            )
            if settings.memory_prefault == "behind" and not memory.group_arenas:
                arena = memory.arena
                populate_behind(arena.region(), POPULATE_WRITE, lambda: arena.closed)
            tiers.append(memory)
        elif name == "disk":
            tiers.append(
                await DiskTier.open(settings.chunk_dir, capacity_bytes=settings.disk_bytes, fsync=settings.disk_fsync)
            )
        elif name == "redis":
            from storage.redis import RedisTier  # redis-py only where the tier is chosen
            from storage.redis_cluster import RedisClusterTier

            assert settings.redis_url is not None  # validated by Settings
            cluster = settings.redis_url.startswith(("redis+cluster://", "rediss+cluster://"))
            tiers.append(await (RedisClusterTier if cluster else RedisTier).open(
                settings.redis_url, prefix=settings.redis_prefix, op_timeout_s=settings.tier_lookup_timeout_s,
                read_timeout_s=settings.tier_read_timeout_s, put_timeout_s=settings.tier_write_timeout_s,
            ))
        else:  # pragma: no cover - validated by Settings
            raise ValueError(f"tier {name!r} is not available in this build")
    return tiers


@dataclass(kw_only=True)
class Runtime:
    """The services of one process, each built once by ``open_runtime`` (docs/architecture.md,
    section 2). A plain record: the server's routes, the admin commands and ``Gateway`` take what
    they need from it; nothing here builds or looks up anything."""

    settings: Settings
    registry: Registry
    kek: KekProvider
    deriver: NamespaceDeriver
    authority: CapabilityAuthority
    access: Access
    resolver: NamespaceResolver
    keyring: Keyring
    tiers: TierManager
    pins: Pins
    chunks: ChunkService
    metrics: Metrics
    audit: AuditWriter
    invalidation: Invalidation
    admin: Admin
    prefixes: Prefixes
    broadcaster: Broadcaster | None = None
    signer: AuditSigner | None = None
    checkpointer: Checkpointer | None = None
    checkpoint_task: asyncio.Task[None] | None = None
    checkpoint_close: Callable[[], Awaitable[None]] | None = None  # closes the checkpoint stream mirror
    # keys the pseudonyms of other tenants' actors in a tenant's own audit export (KEK-wrapped in
    # the registry: the same on every replica and after restarts, whatever signs the audit log)
    pseudonym_secret: Secret | None = None

    async def aclose(self) -> None:
        if self.checkpoint_task is not None:
            self.checkpoint_task.cancel()
            try:
                await self.checkpoint_task
            except asyncio.CancelledError:
                pass
        if self.broadcaster is not None:
            await self.broadcaster.aclose()
        await self._close_data()
        await self.tiers.aclose()
        await self.audit.aclose()
        if self.checkpoint_close is not None:
            await self.checkpoint_close()
        if self.signer is not None:
            close_signer(self.signer)
        await self.registry.aclose()
        close = getattr(self.kek, "close", None)  # an HSM session, say
        if close is not None:
            close()

    async def _close_data(self) -> None:
        """What a subclass runs data operations with, closed before the tiers."""


@dataclass(kw_only=True)
class EmbeddedRuntime(Runtime):
    """A Runtime and the ``Gateway`` over it: what a process that runs chunk traffic itself holds
    (the embedded connector, the demo, benchmarks). The server holds a plain Runtime."""

    gateway: Gateway

    @classmethod
    def over(cls, rt: Runtime, gateway: Gateway) -> EmbeddedRuntime:
        return cls(**{f.name: getattr(rt, f.name) for f in fields(Runtime)}, gateway=gateway)

    async def _close_data(self) -> None:
        await self.gateway.aclose()


def gateway_over(rt: Runtime, *, datapath: Callable[[], DataPath] | None = None) -> Gateway:
    """The data operations over ``rt``'s services; ``datapath`` builds the data path on first use
    (default ``make_datapath(settings)``). The caller closes it (``Gateway.aclose``)."""
    settings = rt.settings
    return Gateway(
        access=rt.access, resolver=rt.resolver, keyring=rt.keyring, chunks=rt.chunks, pins=rt.pins,
        metrics=rt.metrics, datapath=datapath or (lambda: make_datapath(settings)), chunk_tokens=settings.chunk_tokens,
    )


AccessFactory = Callable[[CapabilityAuthority, Registry, AuditWriter, Metrics], Access]


async def open_embedded(
    settings: Settings,
    *,
    tiers: list[Tier] | None = None,
    auto_migrate: bool = False,
    datapath: Callable[[], DataPath] | None = None,
    access: AccessFactory = Access,
) -> EmbeddedRuntime:
    """``open_runtime`` and the Gateway over it (``gateway_over``; ``datapath`` as there)."""
    rt = await open_runtime(settings, tiers=tiers, auto_migrate=auto_migrate, access=access)
    return EmbeddedRuntime.over(rt, gateway_over(rt, datapath=datapath))


async def open_runtime(
    settings: Settings,
    *,
    tiers: list[Tier] | None = None,
    auto_migrate: bool = False,
    access: AccessFactory = Access,
) -> Runtime:
    """Open everything; ``tiers`` overrides the configured tiers (tests and benchmarks) and
    ``access`` builds the access service (a seam a benchmark uses for its baselines).
    ``auto_migrate``: an embedded SQLite database is brought to the current schema here (nobody
    else shares it); any other database behind the schema raises SchemaBehind, which names
    `kvgate migrate`."""
    from gateway.services.statefiles import open_kek, prepare_state

    prepare_state(settings)  # 0700 / 0600, or InsecureStateFiles
    kek = await open_kek(settings)  # a key file only for the registry it wrapped, or KekNotForRegistry
    if auto_migrate and settings.db_url.startswith("sqlite"):
        from gateway.services import dbschema

        await asyncio.to_thread(dbschema.upgrade, settings.db_url)
    registry = Registry.from_url(settings.db_url)
    try:
        await check_schema(registry.engine)
        master = await _gateway_secret(registry, kek, "namespace-master")
        cap_key = await _gateway_secret(registry, kek, "capability-key")
        pseudonym_secret = Secret(await _gateway_secret(registry, kek, "audit-pseudonym"))
        revocations = RevocationList()
        revocations.load(
            {"kind": "id", "cap_id": c, "until": exp} if c else {"kind": "tenant", "tenant": t, "before": nb}
            for t, c, nb, exp in await registry.live_revocations(time.time())
        )
        authority = CapabilityAuthority(
            {"k1": cap_key}, "k1", max_ttl=settings.capability_max_ttl_s, revocations=revocations
        )
        audit = AuditWriter(settings.db_url, spool_dir=settings.state_dir / "audit-spool")
        await audit.start()
        try:
            signer = make_audit_signer(settings)
        except BaseException:
            await audit.aclose()
            close = getattr(kek, "close", None)  # give back an HSM login
            if close is not None:
                close()
            raise
    except BaseException:
        await registry.aclose()
        raise
    metrics = Metrics()
    tier_manager = TierManager(
        tiers if tiers is not None else await _tiers(settings), write_back=settings.write_back_tiers,
        write_mode="behind" if settings.tier_write_mode == "write_behind" else "through",
    )
    keyring = Keyring(registry, kek, invocation_limit=settings.invocation_limit, cache_ttl=settings.kek_cache_ttl_s)
    deriver = NamespaceDeriver(master)
    resolver = NamespaceResolver(registry, kek, deriver)
    checks = access(authority, registry, audit, metrics)
    pins = Pins(tier_manager, registry, audit)
    chunks = ChunkService(access=checks, resolver=resolver, tiers=tier_manager, audit=audit, metrics=metrics)
    invalidation = Invalidation(resolver, keyring, tier_manager)
    broadcaster = None
    if settings.redis_url:
        broadcaster = Broadcaster(invalidation, checks, settings.redis_url, prefix=settings.redis_prefix)
        await broadcaster.start()
    admin = Admin(
        registry=registry, keyring=keyring, resolver=resolver, access=checks, tiers=tier_manager,
        invalidation=invalidation, audit=audit, broadcaster=broadcaster,
    )
    await admin.resume_clears()
    prefixes = Prefixes(
        registry=registry, keyring=keyring, resolver=resolver, tiers=tier_manager, authority=authority, access=checks,
        invalidation=invalidation, audit=audit, chunk_tokens=settings.chunk_tokens, broadcaster=broadcaster,
    )
    chunks.shared = prefixes  # reads of published prefixes, and the guard on their scopes
    checks.scopes_of = prefixes.scopes_of
    invalidation.listeners.append(prefixes.forgotten)
    await prefixes.resume()
    checkpointer, checkpoint_close = make_checkpointer(settings, audit.store, signer, audit)
    task = None
    if settings.audit_checkpoint_interval_s > 0:
        task = asyncio.create_task(
            checkpointer.run_every(settings.audit_checkpoint_interval_s), name="kvgate-audit-checkpoints"
        )
    return Runtime(
        settings=settings, registry=registry, kek=kek, deriver=deriver, authority=authority, access=checks,
        resolver=resolver, keyring=keyring, tiers=tier_manager, pins=pins, chunks=chunks, metrics=metrics, audit=audit,
        invalidation=invalidation, admin=admin, prefixes=prefixes, broadcaster=broadcaster, signer=signer,
        checkpointer=checkpointer,
        checkpoint_task=task, checkpoint_close=checkpoint_close, pseudonym_secret=pseudonym_secret,
    )


def new_state_dir(base: Path) -> Path:
    path = base / secrets.token_hex(4)
    path.mkdir(parents=True, mode=0o700)
    return path
