"""The bench's two baselines, the only place that builds a kvgate without encryption or without
isolation. Nothing outside ``gateway/bench/`` may call them; the product has no setting for either.

- :func:`plaintext_runtime`: the same runtime and data path with encryption left out, so the
  encrypted figures can be read against a plaintext store/load of the same bytes.
- :func:`shared_tenant_runtime`: one shared cache without namespaces (every capability is served
  from one pseudo-tenant's namespace, data key and envelope context), the target of the
  prefix-cache timing attack's ``shared-baseline``.

Both are built from the product's public seams, passed to the normal constructors: a plaintext
envelope codec (``gateway.bench.plaintext``) as the data path's codec, and an access service that
maps every verified capability to one pseudo-tenant. The core has no parameter that turns
encryption or isolation off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from audit.types import AuditSink
from gateway.config import Settings
from gateway.metrics import Metrics
from gateway.services.access import Access
from gateway.services.runtime import EmbeddedRuntime, open_embedded
from storage.base import Tier
from tenancy.capabilities import CapabilityAuthority
from tenancy.registry import Registry
from tenancy.types import Capability, Namespace, TenantId

__all__ = ["SharedTenantAccess", "plaintext_runtime", "shared_tenant_runtime"]


class SharedTenantAccess(Access):
    """Capabilities are verified as in the product, then every one is served from one
    pseudo-tenant's namespace (isolation OFF: the shared cache the timing attack targets)."""

    def __init__(
        self, pseudo_tenant: str, authority: CapabilityAuthority, registry: Registry, audit: AuditSink,
        metrics: Metrics,
    ) -> None:
        super().__init__(authority, registry, audit, metrics)
        self.pseudo_tenant = pseudo_tenant

    def authorize(self, token: str, op: str, *, chunks: Sequence[str] = ()) -> Capability:
        cap = super().authorize(token, op, chunks=chunks)
        return replace(cap, tenant=TenantId(self.pseudo_tenant), namespace=Namespace("default"))


async def plaintext_runtime(settings: Settings, *, tiers: list[Tier]) -> EmbeddedRuntime:
    """A runtime whose data path stores and loads plaintext (benchmark baseline only): the same
    data path, buffers and threads, with the plaintext codec in place of AES-256-GCM."""
    from gateway.bench.plaintext import PlaintextCodec
    from gateway.datapath.path import DataPath

    def datapath() -> DataPath:
        return DataPath(
            PlaintextCodec(settings.segment_bytes), settings.cpu_threads,
            device_cipher=settings.device_cipher, device_aes=settings.device_aes,
        )

    return await open_embedded(settings, tiers=tiers, datapath=datapath)


async def shared_tenant_runtime(settings: Settings, *, tiers: list[Tier], pseudo_tenant: str) -> EmbeddedRuntime:
    """A runtime with isolation OFF: every verified capability, of whichever tenant, is served
    from ``pseudo_tenant``'s namespace (created here), as in a shared cache without namespaces
    (benchmark baseline only: the timing attack's ``shared-baseline``)."""

    def access(authority: CapabilityAuthority, registry: Registry, audit: AuditSink, metrics: Metrics) -> Access:
        return SharedTenantAccess(pseudo_tenant, authority, registry, audit, metrics)

    rt = await open_embedded(settings, tiers=tiers, access=access)
    try:
        await rt.admin.create_tenant(pseudo_tenant)
    except BaseException:
        await rt.aclose()
        raise
    return rt
