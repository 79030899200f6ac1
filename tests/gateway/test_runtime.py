"""Wiring from settings: the memory tier's prefault setting reaches its arena."""

from __future__ import annotations

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
