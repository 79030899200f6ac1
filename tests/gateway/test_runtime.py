"""Wiring from settings: each service built once and shared by whoever uses it (the Gateway of an
embedded process included; the server holds no Gateway), and the memory tier's prefault setting
reaches its arena."""

from __future__ import annotations

import dataclasses
import resource

from storage.memory import MemoryTier
from storage.types import ChunkKey
from tests.support.gw import gateway_runtime


def _key(i: int) -> ChunkKey:
    return ChunkKey("aa", "bb", f"{i:064x}")


async def _faults_of_a_first_fill(tier: MemoryTier, n: int = 6) -> int:
    data = bytes(2 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(n):
        await tier.put(_key(i), data)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


async def test_memory_prefault_setting_faults_the_arena_in_at_start(tmp_path) -> None:
    async with gateway_runtime(tmp_path / "cold", tiers=["memory"], memory_bytes=32 << 20) as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier)
        cold = await _faults_of_a_first_fill(tier)
    async with gateway_runtime(tmp_path / "warm", tiers=["memory"], memory_bytes=32 << 20, memory_prefault=True) as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier)
        warm = await _faults_of_a_first_fill(tier)
    assert cold > 1000, cold  # the control: 12 MiB into fresh 4 KiB pages (~3k faults)
    assert warm < cold / 4, (cold, warm)  # measured here: 3,586 and 458


async def test_services_are_built_once_and_shared_by_whoever_uses_them(tmp_path) -> None:
    from gateway.services.runtime import EmbeddedRuntime, Runtime

    async with gateway_runtime(tmp_path / "state", tiers=["memory"], memory_bytes=32 << 20) as rt:
        assert isinstance(rt, EmbeddedRuntime)
        gw = rt.gateway
        assert (gw.access, gw.resolver, gw.keyring, gw.chunks, gw.pins, gw.metrics) == (
            rt.access, rt.resolver, rt.keyring, rt.chunks, rt.pins, rt.metrics,
        )
        assert rt.chunks.access is rt.access and rt.chunks.resolver is rt.resolver and rt.chunks.tiers is rt.tiers
        assert rt.admin.access is rt.access and rt.admin.tiers is rt.tiers and rt.admin.invalidation is rt.invalidation
        assert rt.access.metrics is rt.metrics and rt.access.authority is rt.authority
        assert rt.resolver.deriver is rt.deriver and rt.resolver.kek is rt.kek and rt.keyring is rt.invalidation.keyring
        assert rt.pins.tiers is rt.tiers and rt.pins.registry is rt.registry
        # a denial counted by the access service is the metric every reader sees
        rt.access.denied("get", "expired")
        assert rt.metrics.denials == gw.metrics.denials == 1
    # the plain record carries no Gateway: nothing there runs data operations
    assert "gateway" not in {f.name for f in dataclasses.fields(Runtime)}


def test_the_server_holds_a_runtime_and_no_gateway(tmp_path) -> None:
    from gateway.services.runtime import EmbeddedRuntime, Runtime
    from tests.support.server_fixture import running_server

    with running_server(tmp_path / "state") as live:
        assert type(live.runtime) is Runtime and not isinstance(live.runtime, EmbeddedRuntime)
        assert not hasattr(live.runtime, "gateway")
        plane = live.state.plane  # the chunk routes' plane, over the same services
        assert plane.chunks is live.runtime.chunks and plane.keyring is live.runtime.keyring
