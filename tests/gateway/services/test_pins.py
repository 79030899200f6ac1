"""The pins service (gateway/services/pins.py), directly over a runtime's services: pin and unpin
(tiers, registry, audit), strict mode on a chunk that is not stored, a tenant that cannot pin or
unpin another tenant's chunks (as an attacker with its own capability would try), and pinned
chunks that survive eviction while the unpinned ones around them go."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gateway.errors import ChunkMissing
from gateway.services.core import Gateway
from gateway.services.runtime import Runtime, gateway_over, open_runtime
from storage.memory import MemoryTier
from storage.types import ChunkKey
from tests.support.gw import ALL_OPS, migrate, model_for, settings_for, small_geometry

CHUNK_BYTES = 8 << 10
CAPACITY = 8 * CHUNK_BYTES  # room for eight chunks
MODEL = model_for(small_geometry())
TOKENS = list(range(100, 100 + 3 * 16))  # three chunks of 16 tokens


@dataclass
class Env:
    rt: Runtime
    gw: Gateway
    tier: MemoryTier


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    settings = settings_for(tmp_path / "state", tiers=["memory"])
    await migrate(settings.db_url)
    tier = MemoryTier(CAPACITY)
    rt = await open_runtime(settings, tiers=[tier])
    gw = gateway_over(rt)
    try:
        for tenant in ("acme", "globex"):
            await rt.admin.create_tenant(tenant)
        yield Env(rt, gw, tier)
    finally:
        await gw.aclose()
        await rt.aclose()


async def _store(env: Env, tenant: str, tokens: list[int] = TOKENS) -> list[ChunkKey]:
    """Put an envelope-sized blob at each of the prompt's storage keys (pins never read them)."""
    keys = await env.gw.keys_for(tenant, "default", MODEL, tokens)
    for key in keys:
        await env.rt.tiers.put(key, bytes(CHUNK_BYTES))
    return keys


async def _cap(env: Env, tenant: str) -> Any:
    return env.rt.access.authorize(await env.rt.access.mint(tenant, "default", ALL_OPS, 600), "pin")


async def _pin_events(rt: Runtime) -> list[tuple[str, int]]:
    await rt.audit.flush(10)
    return [
        (r.event.action, r.event.target.chunk_count)
        async for r in rt.audit.store.iter_records()
        if r.event.action in ("pin", "unpin")
    ]


async def test_pin_and_unpin_reach_the_tiers_the_registry_and_the_audit_log(env: Env) -> None:
    keys = await _store(env, "acme")
    cap = await _cap(env, "acme")
    assert not any(env.tier.is_pinned(k) for k in keys)  # the control: nothing pinned yet
    assert await env.rt.pins.set(cap, keys) == 3
    assert all(env.tier.is_pinned(k) for k in keys)
    assert sorted(await env.rt.registry.list_pins("acme")) == sorted(("default", k.digest) for k in keys)
    assert await env.rt.pins.set(cap, keys[:2], pin=False) == 2
    assert [env.tier.is_pinned(k) for k in keys] == [False, False, True]
    assert await env.rt.registry.list_pins("acme") == [("default", keys[2].digest)]
    assert await _pin_events(env.rt) == [("pin", 3), ("unpin", 2)]


async def test_strict_mode_refuses_a_chunk_that_is_not_stored_and_changes_nothing(env: Env) -> None:
    stored = await _store(env, "acme")
    (absent,) = await env.gw.keys_for("acme", "default", MODEL, list(range(16)))
    cap = await _cap(env, "acme")
    with pytest.raises(ChunkMissing):
        await env.rt.pins.set(cap, [absent], strict=True)
    with pytest.raises(ChunkMissing):  # unpinning what is not pinned
        await env.rt.pins.set(cap, [stored[0]], pin=False, strict=True)
    assert await env.rt.registry.list_pins("acme") == [] and await _pin_events(env.rt) == []
    assert not env.tier.is_pinned(stored[0])
    # not strict: the absent chunk is skipped; the control: a stored one pins in strict mode
    assert await env.rt.pins.set(cap, [absent, stored[0]]) == 1
    assert await env.rt.pins.set(cap, [stored[1]], strict=True) == 1
    assert [env.tier.is_pinned(k) for k in stored] == [True, True, False]
    assert await _pin_events(env.rt) == [("pin", 1), ("pin", 1)]


async def test_a_tenant_cannot_pin_or_unpin_another_tenants_chunks(env: Env) -> None:
    victim = await _store(env, "acme")
    acme = await env.rt.access.mint("acme", "default", ALL_OPS, 600)
    globex = await env.rt.access.mint("globex", "default", ALL_OPS, 600)
    # the attacker names the victim's prompt with its own capability: its namespace, its keys
    assert await env.gw.pin(globex, MODEL, TOKENS) == 0
    assert not any(env.tier.is_pinned(k) for k in victim)
    assert await env.rt.registry.list_pins("acme") == [] and await env.rt.registry.list_pins("globex") == []
    # the control: the owner's capability pins the same prompt
    assert await env.gw.pin(acme, MODEL, TOKENS) == 3
    assert all(env.tier.is_pinned(k) for k in victim)
    # the attacker's unpin touches only its own namespace: the victim's pins stay
    await env.gw.pin(globex, MODEL, TOKENS, pin=False)
    assert all(env.tier.is_pinned(k) for k in victim)
    assert len(await env.rt.registry.list_pins("acme")) == 3


async def test_pinned_chunks_survive_eviction(env: Env) -> None:
    keys = await _store(env, "acme")
    cap = await _cap(env, "acme")
    assert await env.rt.pins.set(cap, keys[:2]) == 2
    # twelve more chunks through a tier with room for eight: the oldest unpinned ones go first
    filler = await _store(env, "globex", list(range(5000, 5000 + 12 * 16)))
    assert env.tier.stats().evictions >= 6
    present = await env.rt.tiers.contains_many(keys)
    assert present == [True, True, False]  # the control: the unpinned chunk stored with them went
    assert not all(await env.rt.tiers.contains_many(filler))
    # unpinned, they are ordinary chunks again and go under the same pressure
    assert await env.rt.pins.set(cap, keys[:2], pin=False) == 2
    await _store(env, "globex", list(range(9000, 9000 + 12 * 16)))
    assert await env.rt.tiers.contains_many(keys) == [False, False, False]
