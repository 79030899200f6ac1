"""The Redis tier beyond the shared contract: segment layout, torn reads, TTLs, pins, group
clears, and faults against a throwaway redis-server of the test's own (killed, paused, full).

Shared-server tests use the ``redis_url`` / ``redis_prefix`` fixtures (keys removed afterwards);
fault tests start ``redis-server`` on a free port and stop it by its pid.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from storage import ChunkKey, ChunkNotFound, InvalidChunk, TierFull, TierUnavailable
from storage._redis_breaker import CircuitBreaker
from storage._redis_layout import Header, Layout, pack_header
from storage.redis import RedisTier
from tests.support.redis_server import Server, fill
from tests.support.services import free_port, missing

pytestmark = pytest.mark.redis
KiB, MiB = 1024, 1024 * 1024
BIG = 33_554_432 + 512 * KiB


def key(owner: str = "aa", group: str = "bb") -> ChunkKey:
    return ChunkKey(owner, group, secrets.token_hex(32))


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()


async def keys_under(raw: aioredis.Redis, prefix: str, part: str = "c:") -> set[bytes]:
    return {k async for k in raw.scan_iter(match=f"{prefix}{part}*", count=1000)}


# -- layout ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("size, segments", [(0, 0), (1, 0), (1023, 0), (1024, 0), (1025, 2),
                                            (2048, 2), (2049, 3), (10 * 1024, 10)])
async def test_segment_count_edges(redis_url: str, redis_prefix: str, raw: aioredis.Redis,
                                   size: int, segments: int) -> None:
    payload = secrets.token_bytes(size)
    k = key()
    async with RedisTier(redis_url, prefix=redis_prefix, segment_bytes=1024) as tier:
        await tier.put(k, payload)
        assert len(await keys_under(raw, redis_prefix)) == 1 + segments
        got = await tier.get(k)
        assert bytes(got.data) == payload and got.data.readonly
        assert tier.used_bytes == size


async def test_replacing_across_layouts_leaves_no_orphans(redis_url: str, redis_prefix: str,
                                                          raw: aioredis.Redis) -> None:
    k = key()
    async with RedisTier(redis_url, prefix=redis_prefix, segment_bytes=1024) as tier:
        for size in (5000, 100, 3000, 0, 4096):
            payload = secrets.token_bytes(size)
            await tier.put(k, payload)
            assert bytes((await tier.get(k)).data) == payload
            expected = 1 + (0 if size <= 1024 else -(-size // 1024))
            assert len(await keys_under(raw, redis_prefix)) == expected
            members = await raw.smembers(f"{redis_prefix}g:aa:bb")
            assert len(members) == expected  # index holds exactly the live keys
            assert tier.used_bytes == size
        assert await tier.delete(k) is True
        assert await keys_under(raw, redis_prefix) == set()
        assert await raw.scard(f"{redis_prefix}g:aa:bb") == 0
        assert tier.used_bytes == 0


async def test_large_value_uses_two_mib_segments(redis_url: str, redis_prefix: str,
                                                 raw: aioredis.Redis) -> None:
    payload = bytearray(secrets.token_bytes(BIG))
    k = key()
    async with RedisTier(redis_url, prefix=redis_prefix) as tier:
        await tier.put(k, memoryview(payload))
        assert len(await keys_under(raw, redis_prefix)) == 1 + 17
        got = await tier.get(k)
        assert got.nbytes == BIG and got.data == memoryview(payload) and got.data.readonly
        stats = tier.stats()
        assert stats.bytes_in == BIG and stats.bytes_out == BIG and stats.hits == 1


async def test_foreign_or_broken_values_are_misses(redis_url: str, redis_prefix: str,
                                                   raw: aioredis.Redis) -> None:
    k1, k2, k3 = key(), key(), key()
    lay = Layout(redis_prefix)
    async with RedisTier(redis_url, prefix=redis_prefix, segment_bytes=1024) as tier:
        await raw.set(lay.head(k1), b"not a kvgate header at all, just bytes")
        await raw.set(lay.head(k2), pack_header(Header(10, 0, b"v" * 8)) + b"short")  # truncated
        await tier.put(k3, bytes(4000))
        segments = sorted(await keys_under(raw, redis_prefix, lay.head(k3)[len(redis_prefix):] + ":"))
        assert len(segments) == 4
        await raw.unlink(segments[2])
        for k in (k1, k2, k3):
            with pytest.raises(ChunkNotFound):
                await tier.get(k)
        stats = tier.stats()
        assert stats.corrupt == 2 and stats.misses == 3 and stats.errors == 0
        assert stats.retried_reads >= 1


async def test_bad_input_is_typed(redis_url: str, redis_prefix: str) -> None:
    with pytest.raises(ValueError):
        RedisTier(redis_url, prefix=redis_prefix, op_timeout_s=0)
    with pytest.raises(ValueError):
        RedisTier("http://127.0.0.1:6379", prefix=redis_prefix)
    with pytest.raises(ValueError):
        RedisTier(redis_url, prefix="bad*prefix")
    async with RedisTier(redis_url, prefix=redis_prefix, max_value_bytes=1000) as tier:
        with pytest.raises(TierFull):
            await tier.put(key(), bytes(1001))
        with pytest.raises(InvalidChunk):
            await tier.get("aa:bb:cc")  # type: ignore[arg-type]
        with pytest.raises(InvalidChunk):
            await tier.delete_group("not-hex")
        assert await tier.list_keys() == []


# -- concurrency ----------------------------------------------------------------------------------
async def test_concurrent_writers_never_produce_a_torn_read(redis_url: str, redis_prefix: str,
                                                            raw: aioredis.Redis) -> None:
    """Two writers (separate connections) race on one key with different payloads of many
    segments; readers get one whole payload or the other, never a mix or a partial. A read that
    loses the race to a new version ``_READ_ATTEMPTS`` times in a row is a miss (bounded work,
    counted as retries), never a torn read: on a loaded 2-core CI machine that happens."""
    from storage.redis import _READ_ATTEMPTS

    k = key()
    a, b = bytes([0xA1]) * (700 * KiB), bytes([0xB2]) * (900 * KiB)
    tiers = [RedisTier(redis_url, prefix=redis_prefix, segment_bytes=32 * KiB, op_timeout_s=2.0,
                       put_timeout_s=5.0) for _ in range(4)]
    await tiers[0].put(k, a)
    seen: dict[bytes, int] = {a: 0, b: 0}
    misses = [0]
    stop = time.monotonic() + 1.5

    async def writer(tier: RedisTier, payload: bytes) -> None:
        while time.monotonic() < stop:
            await tier.put(k, payload)

    async def reader(tier: RedisTier) -> None:
        while time.monotonic() < stop:
            try:
                got = bytes((await tier.get(k)).data)
            except ChunkNotFound:
                misses[0] += 1
                continue
            assert got in seen, f"torn read: {len(got)} bytes, {set(got)}"
            seen[got] += 1

    try:
        await asyncio.gather(writer(tiers[0], a), writer(tiers[1], b), reader(tiers[2]), reader(tiers[3]))
        assert seen[a] + seen[b] > 10
        readers = [tiers[2].stats(), tiers[3].stats()]
        # every miss came from losing the race, never from a corrupt or partial version
        assert sum(r.corrupt for r in readers) == 0
        assert sum(r.retried_reads for r in readers) >= _READ_ATTEMPTS * misses[0]
        # after the race: exactly one version's segments remain, all of them indexed
        final = bytes((await tiers[2].get(k)).data)
        n_keys = 1 + -(-len(final) // (32 * KiB))
        assert len(await keys_under(raw, redis_prefix)) == n_keys
        assert await raw.scard(f"{redis_prefix}g:aa:bb") == n_keys
    finally:
        for t in tiers:
            await t.aclose()


# -- TTL and pins ---------------------------------------------------------------------------------
async def test_ttl_expiry(redis_url: str, redis_prefix: str, raw: aioredis.Redis) -> None:
    small, large = key(), key()
    async with RedisTier(redis_url, prefix=redis_prefix, ttl_s=1, segment_bytes=1024) as tier:
        await tier.put(small, b"soon gone")
        await tier.put(large, bytes(5000))
        for name in await keys_under(raw, redis_prefix):
            assert 0 < await raw.pttl(name) <= 1000
        assert await tier.contains_many([small, large]) == [True, True]
        await asyncio.sleep(1.2)
        assert await tier.contains_many([small, large]) == [False, False]
        for k in (small, large):
            with pytest.raises(ChunkNotFound):
                await tier.get(k)
        assert await tier.list_keys() == []  # stale index entries are filtered out


async def test_pin_removes_ttl_and_survives_replacement(redis_url: str, redis_prefix: str,
                                                        raw: aioredis.Redis) -> None:
    k = key()
    async with RedisTier(redis_url, prefix=redis_prefix, ttl_s=30, segment_bytes=1024) as tier:
        with pytest.raises(ChunkNotFound):
            await tier.pin(k)
        await tier.put(k, bytes(3000))
        await tier.pin(k)
        assert await tier.is_pinned(k)
        assert {await raw.pttl(n) for n in await keys_under(raw, redis_prefix)} == {-1}
        await tier.put(k, bytes(5000))  # a replacing put keeps the pin
        assert {await raw.pttl(n) for n in await keys_under(raw, redis_prefix)} == {-1}
        await tier.unpin(k)
        assert not await tier.is_pinned(k)
        ttls = [await raw.pttl(n) for n in await keys_under(raw, redis_prefix)]
        assert len(ttls) == 1 + 5 and all(0 < t <= 30_000 for t in ttls)


# -- group and owner clears -----------------------------------------------------------------------


async def test_delete_group_of_twenty_thousand(redis_url: str, redis_prefix: str,
                                               raw: aioredis.Redis) -> None:
    await fill(redis_url, redis_prefix, "0a", "01", 20_000)
    async with RedisTier(redis_url, prefix=redis_prefix, segment_bytes=1024) as tier:
        other = key("0a", "02")
        same_group_other_owner = key("0b", "01")
        big = key("0a", "01")
        await tier.put(other, b"keep me")
        await tier.put(same_group_other_owner, b"and me")
        await tier.put(big, bytes(10_000))  # segmented: its segments go too
        await tier.pin(big)
        started = time.perf_counter()
        assert await tier.delete_group("01") == 20_000 + 2
        elapsed = time.perf_counter() - started
        assert elapsed < 10, elapsed
        assert await keys_under(raw, redis_prefix, "c:0a:01:") == set()
        assert await keys_under(raw, redis_prefix, "c:0b:01:") == set()
        assert await raw.exists(f"{redis_prefix}g:0a:01", f"{redis_prefix}g:0b:01") == 0
        assert not await tier.is_pinned(big)
        assert bytes((await tier.get(other)).data) == b"keep me"
        assert await tier.list_keys("01") == [] and await tier.list_keys() == [other]
        assert await tier.delete_group("01") == 0


async def test_delete_owner_across_groups(redis_url: str, redis_prefix: str) -> None:
    async with RedisTier(redis_url, prefix=redis_prefix, segment_bytes=1024) as tier:
        mine = [key("0a", g) for g in ("01", "02", "03")] + [key("0a", "01")]
        theirs = [key("0b", "01")]
        for k in mine + theirs:
            await tier.put(k, bytes(2000))
        assert tier.used_bytes == 2000 * 5
        assert await tier.delete_owner("0a") == 4
        assert await tier.list_keys() == theirs
        assert tier.used_bytes == 2000
        # the shared counter is read back by a fresh client
        fresh = await RedisTier.open(redis_url, prefix=redis_prefix)
        assert fresh.used_bytes == 2000
        await fresh.aclose()


# -- the breaker, alone ---------------------------------------------------------------------------
def test_breaker_opens_probes_once_and_closes() -> None:
    now = [0.0]
    br = CircuitBreaker(3, 2.0, clock=lambda: now[0])
    for _ in range(2):
        assert br.allow()
        br.failure()
    assert br.state == "closed"
    br.success()  # a success resets the count: failures must be consecutive
    for _ in range(3):
        assert br.allow()
        br.failure()
    assert br.state == "open" and not br.allow()
    now[0] = 1.9
    assert not br.allow()
    now[0] = 2.0
    assert br.allow()  # the probe
    assert not br.allow() and br.state == "half-open"  # only one at a time
    br.failure()  # probe failed: open for another cooldown
    assert br.state == "open" and not br.allow() and br.trips == 2
    now[0] = 4.0
    assert br.allow()
    br.abandon()  # a cancelled probe gives the turn to the next caller
    assert br.allow()
    br.success()
    assert br.state == "closed" and br.allow() and br.allow()


# -- faults, against a redis-server of our own -----------------------------------------------------


async def test_kill_during_gets_then_breaker_then_recovery(server: Server) -> None:
    tier = RedisTier(server.url, segment_bytes=256 * KiB, op_timeout_s=0.05, read_timeout_s=0.05,
                     breaker_failures=3, breaker_cooldown_s=0.3)
    k = key()
    payload = secrets.token_bytes(4 * MiB)
    try:
        await tier.put(k, payload)
        outcomes: list[str] = []
        killer = asyncio.get_running_loop().call_later(0.1, server.kill)
        stop = time.monotonic() + 0.6
        while time.monotonic() < stop:
            started = time.perf_counter()
            try:
                got = await tier.get(k)
                assert bytes(got.data) == payload  # never corrupt
                outcomes.append("hit")
            except (TierUnavailable, ChunkNotFound) as exc:
                outcomes.append(type(exc).__name__)
            assert time.perf_counter() - started < 0.5
            await asyncio.sleep(0.005)
        killer.cancel()
        assert "hit" in outcomes and "TierUnavailable" in outcomes
        assert tier.breaker.state == "open"
        for _ in range(20):  # failing fast: no connection attempt while open
            started = time.perf_counter()
            with pytest.raises(TierUnavailable):
                await tier.get(k)
            assert time.perf_counter() - started < 0.02  # fails fast: no connection attempt
        assert tier.stats().fast_failures >= 20

        server.start()  # same port, no persistence: the data is gone
        await asyncio.sleep(0.35)  # the cooldown
        await tier.put(k, payload)  # the probe; it closes the circuit
        assert tier.breaker.state == "closed"
        assert bytes((await tier.get(k)).data) == payload
        stats = tier.stats()
        assert stats.breaker_trips >= 1  # (a probe after a cooldown in the get loop re-opens it)
        assert stats.errors <= 3 + stats.breaker_trips  # the dead server was not hammered
    finally:
        await tier.aclose()


async def test_unreachable_server_is_a_prompt_typed_error() -> None:
    tier = RedisTier(f"redis://127.0.0.1:{free_port()}/0", breaker_failures=2)
    try:
        for op in (lambda: tier.get(key()), lambda: tier.put(key(), b"x"), lambda: tier.contains(key()),
                   lambda: tier.delete_group("01"), tier.start):
            started = time.perf_counter()
            with pytest.raises(TierUnavailable):
                await op()
            assert time.perf_counter() - started < 0.5
        assert tier.breaker.state == "open"
    finally:
        await tier.aclose()


async def test_slow_server_times_out_at_op_timeout(server: Server) -> None:
    tier = RedisTier(server.url, op_timeout_s=0.05, read_timeout_s=0.05, breaker_failures=10)
    admin = aioredis.from_url(server.url)
    k = key()
    try:
        await tier.put(k, b"value")
        sleeper = asyncio.create_task(admin.execute_command("DEBUG", "SLEEP", "0.5"))
        await asyncio.sleep(0.05)  # the server is now busy for ~0.45 s
        started = time.perf_counter()
        with pytest.raises(TierUnavailable, match="timed out"):
            await tier.get(k)
        elapsed = time.perf_counter() - started
        assert 0.04 <= elapsed < 0.25, elapsed
        await sleeper
        assert bytes((await tier.get(k)).data) == b"value"  # and it recovers by itself
        assert tier.breaker.state == "closed"
    finally:
        await admin.aclose()
        await tier.aclose()


async def test_full_server_refuses_puts_with_tier_full() -> None:
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed")
    srv = Server("--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    srv.start()
    tier = RedisTier(srv.url, breaker_failures=1, put_timeout_s=5.0, op_timeout_s=2.0)  # no timing asserted here
    try:
        k = key()
        await tier.put(k, b"small")
        with pytest.raises(TierFull):
            for _ in range(8):
                await tier.put(key(), bytes(2 * MiB))
        assert tier.breaker.state == "closed"  # the server is alive: not a breaker failure
        assert bytes((await tier.get(k)).data) == b"small"
    finally:
        await tier.aclose()
        srv.kill()
