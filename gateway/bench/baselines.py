"""The bench's two baselines, the only place that builds a kvgate without encryption or without
isolation. Nothing outside ``gateway/bench/`` may call them; the product has no setting for either.

- :func:`plaintext_runtime`: the same runtime and data path with encryption left out, so the
  encrypted figures can be read against a plaintext store/load of the same bytes.
- :func:`shared_tenant_runtime`: one shared cache without namespaces (every capability is served
  from one pseudo-tenant's namespace, data key and envelope context), the target of the
  prefix-cache timing attack's ``shared-baseline``.

For now both reach the two benchmark switches that still exist in the core
(``open_runtime(encrypt=False)`` threading ``DataPath(encrypt=False)``, and the private
``Gateway._bench_shared_tenant``). Issue 14 removes those switches from ``gateway/core.py``,
``gateway/datapath.py`` and ``gateway/runtime.py``; these two functions are then re-implemented
on public seams passed to the normal constructors (a plaintext cipher in place of the AEAD, and a
shared-tenant namespace resolver), with the same signatures, so the bench does not change.
"""

from __future__ import annotations

from gateway.config import Settings
from gateway.runtime import Runtime, open_runtime
from storage.base import Tier

__all__ = ["plaintext_runtime", "shared_tenant_runtime"]


async def plaintext_runtime(settings: Settings, *, tiers: list[Tier]) -> Runtime:
    """A runtime whose data path stores and loads plaintext (benchmark baseline only).

    Today: ``open_runtime(..., encrypt=False)``. After issue 14: ``open_runtime`` with a plaintext
    cipher passed through its public cipher seam; the core keeps no ``encrypt`` parameter."""
    return await open_runtime(settings, tiers=tiers, encrypt=False)


async def shared_tenant_runtime(settings: Settings, *, tiers: list[Tier], pseudo_tenant: str) -> Runtime:
    """A runtime with isolation OFF: every verified capability, of whichever tenant, is served
    from ``pseudo_tenant``'s namespace (created here), as in a shared cache without namespaces
    (benchmark baseline only: the timing attack's ``shared-baseline``).

    Today: sets the private ``Gateway._bench_shared_tenant``. After issue 14: ``open_runtime`` with
    a shared-tenant namespace resolver passed to the normal constructors; the core keeps no
    switch that turns isolation off."""
    rt = await open_runtime(settings, tiers=tiers)
    try:
        await rt.admin.create_tenant(pseudo_tenant)
        rt.gateway._bench_shared_tenant = pseudo_tenant
    except BaseException:
        await rt.aclose()
        raise
    return rt
