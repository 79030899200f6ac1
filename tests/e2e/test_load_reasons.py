"""Why a load ended early or a lookup came back short: the core says so (``RetrieveResult.reason``,
``LookupResult.degraded``) and counts it, for every failure kind, beside a clean positive control.
Real tiers: memory, disk, and a redis-server of the test's own that is paused or killed."""

from __future__ import annotations

import os
import signal

import pytest

from gateway.config import Settings
from gateway.services.runtime import open_embedded
from storage.memory import MemoryTier
from storage.redis import RedisTier
from tests.support.gw import ALL_OPS, model_for, random_cache, settings_for, small_geometry, zero_cache

N_BLOCKS, TOKENS = 64, list(range(500, 500 + 64))  # 4 chunks of 16


async def _runtime(tmp_path, tiers):
    from gateway.services import dbschema

    settings = settings_for(tmp_path)
    await __import__("asyncio").to_thread(dbschema.upgrade, settings.db_url)
    rt = await open_embedded(settings, tiers=tiers)
    await rt.admin.create_tenant("acme")
    cap = await rt.gateway.mint_capability("acme", "default", ALL_OPS, 600)
    return rt, cap


async def _stored(rt, cap, g):
    model = model_for(g)
    src = random_cache(g, N_BLOCKS)
    await rt.gateway.store(cap, model, TOKENS, src, block_ids=list(range(16)))
    return model


async def test_reasons_for_integrity_and_miss_beside_a_clean_load(tmp_path):
    g = small_geometry()
    rt, cap = await _runtime(tmp_path, [MemoryTier(64 << 20)])
    try:
        model = await _stored(rt, cap, g)
        dst = zero_cache(g, N_BLOCKS)
        ok = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (ok.loaded_chunks, ok.reason) == (4, "")  # positive control
        keys = await rt.gateway.keys_for("acme", "default", model, TOKENS)
        tier = rt.tiers.tiers[0]
        await tier.delete(keys[2])
        got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (got.loaded_chunks, got.reason) == (2, "miss")
        raw = bytearray((await tier.get(keys[1])).data)
        raw[-5] ^= 1
        await tier.put(keys[1], raw)
        got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (got.loaded_chunks, got.reason, got.integrity_failures) == (1, "integrity", 1)
        assert rt.metrics.load_failed["miss"] == 1 and rt.metrics.load_failed["integrity"] == 1
    finally:
        await rt.aclose()


@pytest.mark.redis
async def test_a_paused_redis_is_a_timeout_and_a_dead_one_unavailable(tmp_path, server):
    g = small_geometry()
    tier = RedisTier(server.url, prefix="kvgate-reasons:", op_timeout_s=0.1, read_timeout_s=0.1, breaker_failures=100)
    rt, cap = await _runtime(tmp_path, [tier])
    try:
        model = await _stored(rt, cap, g)
        dst = zero_cache(g, N_BLOCKS)
        assert (await rt.gateway.lookup(cap, model, TOKENS)).degraded == ""  # positive control
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            look = await rt.gateway.lookup(cap, model, TOKENS)
            got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert (look.hit_tokens, look.degraded) == (0, "tier_timeout")
        assert (got.loaded_chunks, got.reason) == (0, "tier_timeout")
        assert rt.metrics.lookup_degraded["tier_timeout"] == 1
        timeouts = tier.stats().timeouts  # per operation; loads run one get per concurrent batch
        assert timeouts["contains"] == 1 and timeouts["get"] >= 1
        server.kill()
        got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (got.loaded_chunks, got.reason) == (0, "tier_unavailable")
    finally:
        await rt.aclose()


@pytest.mark.redis
async def test_a_torn_redis_value_is_dropped_so_the_next_store_heals_it(tmp_path, server):
    g = small_geometry()
    tier = RedisTier(server.url, prefix="kvgate-torn:")
    rt, cap = await _runtime(tmp_path, [tier])
    try:
        model = await _stored(rt, cap, g)
        keys = await rt.gateway.keys_for("acme", "default", model, TOKENS)
        await tier._redis.set(tier._layout.head(keys[1]), b"torn")  # EXISTS, but no chunk
        assert (await rt.gateway.lookup(cap, model, TOKENS)).hit_chunks == 4
        dst = zero_cache(g, N_BLOCKS)
        got = await rt.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (got.loaded_chunks, got.reason) == (1, "miss")
        assert (await rt.gateway.lookup(cap, model, TOKENS)).hit_chunks == 1  # gone, not a false hit
    finally:
        await rt.aclose()


def test_tier_deadlines_are_settings(tmp_path):
    s = Settings(state_dir=tmp_path, tier_lookup_timeout_s=0.3, tier_read_timeout_s=0.4, tier_write_timeout_s=2)
    assert (s.tier_lookup_timeout_s, s.tier_read_timeout_s, s.tier_write_timeout_s) == (0.3, 0.4, 2)
    with pytest.raises(ValueError, match="tier_read_timeout_s"):
        Settings(state_dir=tmp_path, tier_read_timeout_s=0)


@pytest.mark.redis
async def test_a_stalled_redis_in_front_of_disk_is_answered_by_the_disk(tmp_path, server, caplog):
    """Tiers ["redis", "disk"] as vLLM runs them: the worker's runtime stores, the scheduler's
    runtime (opened before the store, sharing the disk root) looks up. With the redis-server
    SIGSTOP'd by pid, the lookup is answered by the disk tier, and the load the disk serves is
    counted and logged as degraded. Positive control: the same lookup and load with Redis running."""
    from gateway.services import dbschema

    settings = settings_for(tmp_path, tiers=["redis", "disk"], redis_url=server.url,
                            redis_prefix="kvgate-stall:", tier_lookup_timeout_s=0.1, tier_read_timeout_s=0.1)
    await __import__("asyncio").to_thread(dbschema.upgrade, settings.db_url)
    worker = await open_embedded(settings)
    scheduler = await open_embedded(settings)
    try:
        await worker.admin.create_tenant("acme")
        cap = await worker.gateway.mint_capability("acme", "default", ALL_OPS, 600)
        g = small_geometry()
        model = await _stored(worker, cap, g)
        dst = zero_cache(g, N_BLOCKS)
        look = await scheduler.gateway.lookup(cap, model, TOKENS)
        got = await worker.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        assert (look.hit_chunks, look.degraded, got.loaded_chunks, got.degraded) == (4, "", 4, "")  # control
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            look = await scheduler.gateway.lookup(cap, model, TOKENS)
            with caplog.at_level("WARNING", logger="kvgate.core"):
                got = await worker.gateway.retrieve(cap, model, TOKENS, dst, block_ids=list(range(16)))
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert (look.hit_chunks, look.degraded) == (4, "")  # the disk tier holds every chunk
        assert (got.loaded_chunks, got.reason, got.degraded) == (4, "", "tier_timeout")
        assert worker.metrics.load_degraded["tier_timeout"] == 1
        assert any("slower tier" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)
    finally:
        await scheduler.aclose()
        await worker.aclose()


@pytest.mark.redis
async def test_a_remote_worker_gets_the_servers_tier_reason_and_the_server_counts_it(tmp_path, server):
    """`kvgate serve` with tiers ["redis"], a remote worker loading: with the redis-server
    SIGSTOP'd the load says tier_timeout, killed tier_unavailable (not miss), and the server's
    /metrics counts each by that reason. Positive control: a full load while Redis runs."""
    from gateway.remote.client import RemoteGateway
    from tests.support.server_fixture import running_server

    g = small_geometry()
    model = model_for(g)
    src = random_cache(g, N_BLOCKS)
    with running_server(tmp_path / "state", tiers=["redis"], redis_url=server.url, redis_prefix="kvgate-rr:",
                        tier_read_timeout_s=0.1) as live:
        async with live.client() as http:
            tenant = await live.create_tenant(http)

            async def failures() -> dict[str, float]:
                r = await http.get("/metrics", headers=live.headers(live.operator_token()))
                assert r.status_code == 200, r.text
                return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                        for line in r.text.splitlines() if line.startswith("kvgate_load_failures_total{")}

            async with RemoteGateway(live.base_url, live.worker_token(tenant), chunk_tokens=16) as worker:
                await worker.store(model, TOKENS, src, block_ids=list(range(16)))
                dst = zero_cache(g, N_BLOCKS)
                ok = await worker.retrieve(model, TOKENS, dst, block_ids=list(range(16)))
                assert (ok.loaded_chunks, ok.reason) == (4, "")  # control
                assert (await failures())["tier_timeout"] == 0
                os.kill(server.proc.pid, signal.SIGSTOP)
                try:
                    stalled = await worker.retrieve(model, TOKENS, dst, block_ids=list(range(16)))
                finally:
                    os.kill(server.proc.pid, signal.SIGCONT)
                server.kill()
                dead = await worker.retrieve(model, TOKENS, dst, block_ids=list(range(16)))
            counted = await failures()
    assert (stalled.loaded_chunks, stalled.reason) == (0, "tier_timeout")
    assert (dead.loaded_chunks, dead.reason) == (0, "tier_unavailable")
    assert counted["tier_timeout"] >= 1 and counted["tier_unavailable"] >= 1 and counted["miss"] == 0
