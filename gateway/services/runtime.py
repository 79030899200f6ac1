"""Wiring: build the gateway core and its parts from Settings (nothing at import time).

``open_runtime(settings)`` checks the schema (refusing to start on one that is behind), loads or
creates the KEK-wrapped gateway secrets, opens the tiers, starts the audit writer, opens the
audit signer and starts periodic checkpoints, resumes any interrupted secure clear, and returns
a Runtime to close when done.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from audit.checkpointer import Checkpointer
from audit.signing import AuditSigner
from audit.writer import AuditWriter
from crypto.contexts import secret_context
from crypto.kek import KekProvider, LocalFileKek, Secret
from gateway.chunks.envelopes import EnvelopePlane
from gateway.config import Settings
from gateway.services.access import Access
from gateway.services.admin import Admin
from gateway.services.auditing import close_signer, make_audit_signer, make_checkpointer
from gateway.services.broadcast import Broadcaster
from gateway.services.core import Gateway
from gateway.services.dbschema import check_schema
from gateway.services.invalidation import Invalidation
from gateway.services.namespaces import NamespaceResolver
from gateway.services.pins import Pins
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

__all__ = ["Runtime", "open_runtime", "make_kek", "make_datapath"]


def make_datapath(settings: Settings) -> DataPath:
    """The data path of this process (loads torch: called at the first data operation)."""
    from crypto.envelope import ChunkCipher
    from gateway.datapath.path import DataPath

    return DataPath(
        ChunkCipher(segment_bytes=settings.segment_bytes), settings.cpu_threads,
        device_cipher=settings.device_cipher, device_aes=settings.device_aes, store_nice=settings.store_nice,
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
            tiers.append(MemoryTier(
                settings.memory_bytes, owner_quota_bytes=settings.memory_owner_quota_bytes,
                prefault=settings.memory_prefault,
            ))
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


@dataclass
class Runtime:
    settings: Settings
    registry: Registry
    gateway: Gateway
    admin: Admin
    audit: AuditWriter
    broadcaster: Broadcaster | None = None
    signer: AuditSigner | None = None
    checkpointer: Checkpointer | None = None
    checkpoint_task: asyncio.Task[None] | None = None
    checkpoint_close: object | None = None  # closes the checkpoint stream mirror
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
        await self.gateway.aclose()
        await self.audit.aclose()
        if self.checkpoint_close is not None:
            await self.checkpoint_close()  # type: ignore[operator]  # held as object: the stream mirror's close coroutine function
        if self.signer is not None:
            close_signer(self.signer)
        await self.registry.aclose()
        close = getattr(self.gateway.kek, "close", None)  # an HSM session, say
        if close is not None:
            close()

    # the services, for the server and tools (the gateway is a facade over the same objects)
    @property
    def access(self) -> Access:
        return self.gateway.access

    @property
    def resolver(self) -> NamespaceResolver:
        return self.gateway.resolver

    @property
    def tiers(self) -> TierManager:
        return self.gateway.tiers

    def envelope_plane(self, *, max_chunk_bytes: int) -> EnvelopePlane:
        """The remote data plane over this runtime's services (the server's chunk routes)."""
        gw = self.gateway
        return EnvelopePlane(
            access=gw.access, resolver=gw.resolver, keyring=gw.keyring, tiers=gw.tiers, pins=gw.pins,
            audit=gw.audit, stats=gw.stats, chunks=gw.chunks, max_chunk_bytes=max_chunk_bytes,
        )


async def open_runtime(
    settings: Settings,
    *,
    tiers: list[Tier] | None = None,
    auto_migrate: bool = False,
    datapath: Callable[[], DataPath] | None = None,
    access: Callable[[CapabilityAuthority, Registry, AuditWriter, Counter[str]], Access] = Access,
) -> Runtime:
    """Open everything; ``tiers`` overrides the configured tiers (tests and benchmarks).
    ``datapath`` builds the data path (default ``make_datapath(settings)``, on first use) and
    ``access`` the access service: seams a benchmark uses for its baselines. ``auto_migrate``: an
    embedded SQLite database is brought to the current schema here (nobody else shares it); any
    other database behind the schema raises SchemaBehind, which names `kvgate migrate`."""
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
    stats: Counter[str] = Counter()
    tier_manager = TierManager(
        tiers if tiers is not None else await _tiers(settings), write_back=settings.write_back_tiers,
        write_mode="behind" if settings.tier_write_mode == "write_behind" else "through",
    )
    keyring = Keyring(registry, kek, invocation_limit=settings.invocation_limit, cache_ttl=settings.kek_cache_ttl_s)
    resolver = NamespaceResolver(registry, kek, NamespaceDeriver(master))
    checks = access(authority, registry, audit, stats)
    pins = Pins(tier_manager, registry, audit)
    gateway = Gateway(
        registry=registry,
        access=checks,
        resolver=resolver,
        keyring=keyring,
        tiers=tier_manager,
        datapath=datapath or (lambda: make_datapath(settings)),
        audit=audit,
        stats=stats,
        pins=pins,
        chunk_tokens=settings.chunk_tokens,
    )
    invalidation = Invalidation(resolver, keyring, tier_manager)
    admin = Admin(
        registry=registry, keyring=keyring, resolver=resolver, access=checks, tiers=tier_manager,
        invalidation=invalidation, audit=audit,
    )
    broadcaster = None
    if settings.redis_url:
        broadcaster = Broadcaster(invalidation, checks, settings.redis_url, prefix=settings.redis_prefix)
        await broadcaster.start()
        admin.broadcaster = broadcaster
    await admin.resume_clears()
    checkpointer, checkpoint_close = make_checkpointer(settings, audit.store, signer, audit)
    task = None
    if settings.audit_checkpoint_interval_s > 0:
        task = asyncio.create_task(
            checkpointer.run_every(settings.audit_checkpoint_interval_s), name="kvgate-audit-checkpoints"
        )
    return Runtime(
        settings, registry, gateway, admin, audit, broadcaster, signer, checkpointer, task, checkpoint_close,
        pseudonym_secret=pseudonym_secret,
    )


def new_state_dir(base: Path) -> Path:
    path = base / secrets.token_hex(4)
    path.mkdir(parents=True, mode=0o700)
    return path
