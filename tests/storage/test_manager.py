"""Tier manager policies through the gateway: Redis faults, per-tenant quotas, write-back."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import torch

from gateway.services.runtime import open_embedded
from storage.disk import DiskTier
from storage.memory import MemoryTier
from storage.redis import RedisTier
from tests.support.gw import ALL_OPS, gathered, migrate, model_for, random_cache, settings_for, small_geometry, zero_cache
from tests.support.services import free_port

G = small_geometry()
MODEL = model_for(G)


def _redis_server(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
            return proc
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


async def _open(tmp_path, tier_objects, **kw):
    settings = settings_for(tmp_path, **kw)
    await migrate(settings.db_url)
    rt = await open_embedded(settings, tiers=tier_objects)
    await rt.admin.create_tenant("acme")
    await rt.admin.create_tenant("globex")
    return rt


@pytest.mark.redis
async def test_redis_down_means_misses_within_the_timeout_and_hits_resume(tmp_path):
    port = free_port()
    proc = _redis_server(port)
    url = f"redis://127.0.0.1:{port}/0"
    tier = RedisTier(url, prefix="kvgate-t:", breaker_failures=2, breaker_cooldown_s=0.3)
    rt = await _open(tmp_path, [tier], tiers=["redis"], redis_url=url)
    try:
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        src = random_cache(G, 32)
        tokens, blocks = list(range(64)), list(range(16))
        await rt.gateway.store(cap, MODEL, tokens, src, block_ids=blocks)
        assert (await rt.gateway.lookup(cap, MODEL, tokens)).hit_tokens == 64  # positive control
        proc.terminate()
        proc.wait(10)
        for _ in range(5):
            dst = zero_cache(G, 32)
            t0 = time.monotonic()
            got = await rt.gateway.retrieve(cap, MODEL, tokens, dst, block_ids=blocks)
            hit = await rt.gateway.lookup(cap, MODEL, tokens)
            elapsed = time.monotonic() - t0
            assert got.loaded_tokens == 0 and hit.hit_tokens == 0
            assert elapsed < 0.5, elapsed
            assert all(not x.any() for x in dst)  # nothing (corrupt or otherwise) reached the cache
        stored = await rt.gateway.store(cap, MODEL, tokens, src, block_ids=blocks)  # no exception
        assert stored.stored == 0 and stored.bytes_stored == 0 and rt.metrics.store_failures >= 4  # no tier took one
        proc = _redis_server(port)  # back, empty (no persistence)
        await asyncio.sleep(0.4)  # the breaker's cooldown
        deadline = time.monotonic() + 5
        while True:
            await rt.gateway.store(cap, MODEL, tokens, src, block_ids=blocks)
            dst = zero_cache(G, 32)
            if (await rt.gateway.retrieve(cap, MODEL, tokens, dst, block_ids=blocks)).loaded_tokens == 64:
                break
            assert time.monotonic() < deadline, "hits did not resume"
            await asyncio.sleep(0.2)
        assert torch.equal(gathered(src, G, blocks, 64), gathered(dst, G, blocks, 64))
    finally:
        await rt.aclose()
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("quota", [True, False])
async def test_a_flooding_tenant_cannot_evict_another_within_its_quota(tmp_path, quota):
    chunk = G.chunk_nbytes(16)
    envelope = chunk + 56 + 16 * (-(-chunk // 4096))  # header + one tag per 4 KiB segment
    capacity = envelope * 8
    tier = MemoryTier(capacity, owner_quota_bytes=envelope * 4 if quota else None)
    rt = await _open(tmp_path, [tier], tiers=["memory"])
    try:
        cap_a = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        cap_b = await rt.gateway.mint_capability("globex", "default", ALL_OPS, 600)
        src = random_cache(G, 256)
        b_tokens = list(range(48))  # 3 chunks, within a 4-chunk quota
        await rt.gateway.store(cap_b, MODEL, b_tokens, src, block_ids=list(range(12)))
        for i in range(6):  # acme writes 24 chunks, three times the whole tier
            toks = list(range(10_000 + i * 64, 10_000 + (i + 1) * 64))
            await rt.gateway.store(cap_a, MODEL, toks, src, block_ids=list(range(16 + i * 16, 32 + i * 16)))
        hit = (await rt.gateway.lookup(cap_b, MODEL, b_tokens)).hit_tokens
        if quota:
            assert hit == 48
        else:
            assert hit < 48  # the control: without quotas plain LRU evicts globex
    finally:
        await rt.aclose()


async def test_write_back_tier_gets_its_copy_after_store_returns(tmp_path):
    disk = DiskTier(tmp_path / "wb")
    await disk.start()
    rt = await _open(tmp_path, [MemoryTier(64 << 20), disk], tiers=["memory", "disk"], write_back_tiers=["disk"])
    try:
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        src = random_cache(G, 32)
        tokens, blocks = list(range(64)), list(range(16))
        await rt.gateway.store(cap, MODEL, tokens, src, block_ids=blocks)
        await rt.tiers.flush()
        assert len(await disk.list_keys()) == 4
    finally:
        await rt.aclose()
    # a restart finds them on disk
    disk2 = DiskTier(tmp_path / "wb")
    await disk2.start()
    settings = settings_for(tmp_path, tiers=["memory", "disk"])
    rt = await open_embedded(settings, tiers=[MemoryTier(64 << 20), disk2])
    try:
        cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        dst = zero_cache(G, 32)
        assert (await rt.gateway.retrieve(cap, MODEL, tokens, dst, block_ids=blocks)).loaded_tokens == 64
        assert torch.equal(gathered(src, G, blocks, 64), gathered(dst, G, blocks, 64))
    finally:
        await rt.aclose()


class _Counted(MemoryTier):
    """A real memory tier that counts the presence checks it is asked."""

    def __init__(self, name: str) -> None:
        super().__init__(16 << 20)
        self.name = name
        self.calls: list[int] = []

    async def contains(self, key):
        self.calls.append(1)
        return await super().contains(key)

    async def contains_many(self, keys):
        self.calls.append(len(keys))
        return await super().contains_many(keys)


class _Down(MemoryTier):
    name = "down"

    def __init__(self) -> None:
        super().__init__(1 << 20)

    async def contains_many(self, keys):
        from storage.types import TierUnavailable

        raise TierUnavailable("down: connection refused")


async def test_locate_many_asks_each_tier_once_for_every_key_and_names_a_tier_that_could_not_answer(tmp_path):
    """A REST lookup of a 128-chunk prefix answers where each hit lies: one batched presence
    check per tier (not one per chunk per tier), the same answer as asking key by key, and a tier
    that cannot answer is reported (its keys read as absent there) without failing the rest."""
    import secrets

    from storage import ChunkKey
    from storage.manager import TierManager

    fast, slow = _Counted("fast"), _Counted("slow")
    keys = [ChunkKey("a" * 32, "b" * 32, secrets.token_hex(32)) for _ in range(128)]
    for i, k in enumerate(keys):
        if i % 3 != 2:
            await fast.put(k, memoryview(b"x" * 64))
        if i % 2 == 0:
            await slow.put(k, memoryview(b"y" * 64))
    tiers = TierManager([fast, slow])
    where, errors = await tiers.locate_many(keys)
    assert errors == [] and fast.calls == [128] and slow.calls == [128]
    assert where == [await tiers.locate(k) for k in keys]  # the per-key answer (the control)
    assert where[0] == ["fast", "slow"] and where[1] == ["fast"] and where[5] == [] and where[2] == ["slow"]
    down = TierManager([fast, _Down()])
    where, errors = await down.locate_many(keys)
    assert [str(e) for e in errors] == ["down: connection refused"] and down.errors["down"] == 1
    assert where[0] == ["fast"] and where[2] == []
