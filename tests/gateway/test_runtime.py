"""Wiring from settings: each service built once and shared by whoever uses it (the Gateway of an
embedded process included; the server holds no Gateway), and the memory tier's prefault setting
reaches its arena (at start, or behind on a thread of its own)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import resource
import threading
import time
from collections.abc import Callable

import pytest
from pydantic import ValidationError

from storage.memory import MemoryTier
from storage.types import ChunkKey
from tests.support.gw import gateway_runtime, settings_for
from tests.support.memfd import resident_pages


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


async def _resident_within(tier: MemoryTier, seconds: float) -> tuple[int, int]:
    """The arena's resident and total pages once all are resident, or as they are after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        resident, pages = resident_pages(tier.arena.region())
        if resident == pages or time.monotonic() > deadline:
            return resident, pages
        await asyncio.sleep(0.05)


async def test_memory_prefault_behind_faults_the_arena_in_on_a_thread_of_its_own(tmp_path) -> None:
    async with gateway_runtime(tmp_path / "cold", tiers=["memory"], memory_bytes=32 << 20) as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier)
        idle = await _resident_within(tier, 1.0)
        cold = await _faults_of_a_first_fill(tier)
    async with gateway_runtime(tmp_path / "warm", tiers=["memory"], memory_bytes=32 << 20, memory_prefault="behind") as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier)
        resident, pages = await _resident_within(tier, 30.0)
        warm = await _faults_of_a_first_fill(tier)
    # the control: off, a second later the arena is still almost all holes, and a fill faults
    assert idle[0] < idle[1] // 8, idle
    assert cold > 1000, cold
    # behind: every page of the arena is in before any store, and the fill writes into them
    assert resident == pages > 8000, (resident, pages)
    assert warm < cold / 4, (cold, warm)


async def test_memory_prefault_behind_stops_when_the_tier_closes(tmp_path, monkeypatch) -> None:
    import gateway.services.runtime as runtime

    calls: list[tuple[threading.Thread, Callable[[], bool]]] = []
    real = runtime.populate_behind

    def spy(view, advice, stop, done=None):
        thread = real(view, advice, stop, done)
        calls.append((thread, stop))
        return thread

    monkeypatch.setattr(runtime, "populate_behind", spy)
    async with gateway_runtime(tmp_path, tiers=["memory"], memory_bytes=2 << 30, memory_prefault="behind") as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier)
        assert len(calls) == 1  # one thread, over the whole arena, told to go on while the tier is open
        (thread, stop), = calls
        assert not stop() and tier.arena.region().nbytes >= 2 << 30
    assert stop()  # closed: it stops within a step
    thread.join(10.0)
    assert not thread.is_alive()


async def _arena_resident_within(tier: MemoryTier, group: str, nbytes: int, seconds: float) -> int:
    """Bytes with memory behind them in ``group``'s arena once at least ``nbytes``, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        held = os.fstat(tier.group_arena(group).fd).st_blocks * 512
        if held >= nbytes or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.05)


@pytest.mark.parametrize(("ahead", "expected"), [(None, 16 << 20), (8 << 20, 8 << 20), (0, 0)])
async def test_a_servers_namespace_arenas_are_populated_ahead_by_half_the_budget_by_default(tmp_path, ahead, expected) -> None:
    async with gateway_runtime(
        tmp_path, tiers=["memory"], memory_bytes=32 << 20, shm_max_bytes=64 << 20, shm_arena_ahead_bytes=ahead,
    ) as rt:
        tier = rt.tiers.tiers[0]
        assert isinstance(tier, MemoryTier) and tier.group_arenas
        held = await _arena_resident_within(tier, "ns", max(expected, 1), 30.0 if expected else 1.0)
    assert expected <= held <= expected + (64 << 10), (held, expected)  # 0 ahead: the arena stays holes


def test_memory_prefault_reads_true_and_false_as_start_and_off(tmp_path) -> None:
    def prefault(value: object) -> str:
        return settings_for(tmp_path, memory_prefault=value).memory_prefault

    assert settings_for(tmp_path).memory_prefault == "off"
    assert [prefault(v) for v in (True, "true", "1", False, "False", "0")] == ["start"] * 3 + ["off"] * 3
    assert [prefault(v) for v in ("behind", "start", "off")] == ["behind", "start", "off"]
    with pytest.raises(ValidationError, match="memory_prefault"):
        prefault("eager")


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
