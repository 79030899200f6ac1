"""The Redis Cluster tier on a real cluster: six redis-server processes on 127.0.0.1 (three masters,
three replicas) started by tests/support/redis_cluster.py and stopped by process id.

What is proven here: chunks spread over every master and a chunk put through one tier instance is
read through another; a namespace clear leaves nothing on any node; a reshard under load returns
no wrong bytes and loses nothing; a master killed with SIGKILL under load turns loads into misses
within the deadline (never other errors, never wrong bytes), hits resume after the replica is
promoted, and every acknowledged chunk lost had been acknowledged before the kill (the replica had
not received it yet). The figures (misses, recovery time, lost chunks) are printed (-s).
The tier contract itself runs against the shared cluster in test_tier_contract.py; the reshard and
the kill each get a cluster of their own, so whatever state they leave it in no other test sees.
"""


from __future__ import annotations

import asyncio
import hashlib
import random
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import redis.asyncio as aioredis

from storage._cluster_client import node_of, parse_cluster_url
from storage.events import RedisEventChannel
from storage.redis_cluster import RedisClusterTier
from storage.types import (
    ChunkKey,
    ChunkNotFound,
    InvalidChunk,
    TierError,
    TierUnavailable,
)
from tests.support.redis_cluster import (
    Cluster,
    fill,
    replication_caught_up,
)

pytestmark = [pytest.mark.redis]

OWNER, GROUP = "0a", "01"


def value(key: ChunkKey, version: int = 0) -> bytes:
    """A payload that only this key (and version) has: 200 B to 12 KB, so with 4 KiB segments
    some chunks are inline and some are three segments."""
    seed = hashlib.sha256(f"{key.digest}:{version}".encode()).digest()
    size = 200 + int.from_bytes(seed[:2], "little") % 12_000
    return (seed * (size // 32 + 1))[:size]


def new_key(owner: str = OWNER, group: str = GROUP) -> ChunkKey:
    return ChunkKey(owner, group, secrets.token_hex(32))


def make_tier(cluster: Cluster, prefix: str, **kw: float) -> RedisClusterTier:
    opts: dict[str, float] = {"segment_bytes": 4096, "op_timeout_s": 1.0, "read_timeout_s": 0.5,
                              "put_timeout_s": 2.0, "breaker_failures": 3, "breaker_cooldown_s": 0.5}
    opts.update(kw)
    return RedisClusterTier(cluster.url, prefix=prefix, **opts)  # type: ignore[arg-type]


@pytest.fixture
def prefix() -> str:
    return f"kvt:{secrets.token_hex(4)}:"


@pytest.fixture
async def tier(redis_cluster: Cluster, prefix: str) -> AsyncIterator[RedisClusterTier]:
    t = make_tier(redis_cluster, prefix)
    await t.start()
    try:
        yield t
    finally:
        await t.aclose()


async def put_all(tier: RedisClusterTier, keys: list[ChunkKey], concurrency: int = 32) -> None:
    queue = list(keys)

    async def worker() -> None:
        while queue:
            k = queue.pop()
            await tier.put(k, value(k))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def keys_per_node(cluster: Cluster, pattern: str) -> dict[int, int]:
    """How many keys matching ``pattern`` each live node holds (replicas included)."""
    counts = {}
    for port, proc in cluster.procs.items():
        if proc.poll() is not None:
            continue
        r = aioredis.Redis(host="127.0.0.1", port=port)
        try:
            counts[port] = sum([1 async for _ in r.scan_iter(match=pattern, count=5000)])
        finally:
            await r.aclose()
    return counts


# -- layout, spread, sharing -------------------------------------------------------------------
def test_cluster_url_is_parsed_and_bad_ones_are_refused() -> None:
    spec = parse_cluster_url("rediss+cluster://us%40er:p%3Ass@10.0.0.1:7000,10.0.0.2:7001?ssl_ca_certs=/ca.pem")
    assert spec.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001))
    assert (spec.username, spec.password, spec.tls) == ("us@er", "p:ss", True)
    assert spec.node_url("10.0.0.2", 7001) == "rediss://us%40er:p%3Ass@10.0.0.2:7001"
    for bad in ("redis://h:1", "redis+cluster://h", "redis+cluster://h:x", "redis+cluster://h:1?evil=1"):
        with pytest.raises(ValueError):
            RedisClusterTier(bad)
    with pytest.raises(ValueError):  # a brace in the prefix would change every key's hash tag
        RedisClusterTier("redis+cluster://h:1", prefix="kv{x}:")


async def test_chunks_spread_over_every_master_and_are_shared(redis_cluster: Cluster, prefix: str,
                                                              tier: RedisClusterTier) -> None:
    keys = [new_key() for _ in range(1500)]  # one namespace: it must still spread
    await put_all(tier, keys)
    masters = redis_cluster.masters()
    counts = await keys_per_node(redis_cluster, prefix + "*")
    per_master = {p: counts[p] for p in masters}
    print(f"\nkeys per master for one namespace of 1500 chunks: {per_master}")
    assert len(per_master) == 3
    total = sum(per_master.values())
    assert all(n > total * 0.15 for n in per_master.values()), per_master
    # a second instance (another gateway) reads what the first wrote, byte for byte
    other = make_tier(redis_cluster, prefix)
    try:
        await other.start()
        assert other.used_bytes == await tier.refresh_used_bytes() == sum(len(value(k)) for k in keys)
        for k in random.sample(keys, 300):
            assert bytes((await other.get(k)).data) == value(k)
        assert await other.contains_many(keys[:50] + [new_key()]) == [True] * 50 + [False]
        await other.pin(keys[0])
        assert await tier.is_pinned(keys[0])
        assert await tier.delete(keys[1]) is True
        with pytest.raises(ChunkNotFound):
            await other.get(keys[1])
    finally:
        await other.aclose()


async def test_bad_input_changes_nothing_on_any_node(redis_cluster: Cluster, prefix: str,
                                                     tier: RedisClusterTier) -> None:
    with pytest.raises(InvalidChunk):
        await tier.put(new_key(), "text")  # type: ignore[arg-type]
    with pytest.raises(InvalidChunk):
        await tier.delete_group("NOT-HEX")
    assert sum((await keys_per_node(redis_cluster, prefix + "*")).values()) == 0


# -- namespace clear ---------------------------------------------------------------------------
async def test_namespace_clear_of_twenty_thousand_leaves_nothing_on_any_node(
        redis_cluster: Cluster, prefix: str, tier: RedisClusterTier) -> None:
    t0 = time.perf_counter()
    await fill(redis_cluster.url, prefix, OWNER, GROUP, 19_900)
    await fill(redis_cluster.url, prefix, "0b", GROUP, 100)
    fill_s = time.perf_counter() - t0
    segmented = [new_key(OWNER, GROUP) for _ in range(50)]  # real puts too: segments, a pin
    kept = [new_key(OWNER, "02") for _ in range(200)]
    await put_all(tier, segmented + kept)
    await tier.pin(segmented[0])
    t0 = time.perf_counter()
    removed = await tier.delete_group(GROUP)
    clear_s = time.perf_counter() - t0
    print(f"\nfill 20,000 chunks {fill_s:.1f} s; delete_group of 20,050 on the cluster {clear_s:.2f} s")
    assert removed == 20_050
    replication_caught_up(redis_cluster)
    counts = await keys_per_node(redis_cluster, prefix + "{*." + GROUP + ".*}*")
    assert sum(counts.values()) == 0, counts  # nothing of the namespace on any master or replica
    assert await tier.refresh_used_bytes() == sum(len(value(k)) for k in kept)
    for k in kept:  # positive control: the other namespace is whole
        assert bytes((await tier.get(k)).data) == value(k)
    assert await tier.delete_group(GROUP) == 0
    assert await tier.delete_owner(OWNER) == len(kept)
    replication_caught_up(redis_cluster)
    assert sum((await keys_per_node(redis_cluster, prefix + "{" + OWNER + ".*")).values()) == 0
    assert await tier.refresh_used_bytes() == 0


# -- faults under load -------------------------------------------------------------------------
@dataclass
class Load:
    """Loads and stores running against the cluster while something happens to it."""

    reader: RedisClusterTier
    writer: RedisClusterTier
    keys: list[ChunkKey]
    hits: int = 0
    misses: int = 0
    unavailable: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)
    slowest_miss_s: float = 0.0
    hit_times: dict[str, list[float]] = field(default_factory=dict)  # node (before the fault) -> when hits were asked
    acked: dict[ChunkKey, float] = field(default_factory=dict)  # stores acknowledged, and when
    failed_puts: int = 0
    stop: bool = False
    why: dict[str, int] = field(default_factory=dict)  # unavailable, by message

    async def loads(self, node_at_start: dict[ChunkKey, str]) -> None:
        while not self.stop:
            k = random.choice(self.keys)
            t0 = time.monotonic()
            try:
                got = await self.reader.get(k)
            except ChunkNotFound:
                self.misses += 1
            except TierUnavailable as exc:
                self.unavailable += 1
                w = (str(exc) + " " + type(exc.__cause__).__name__ + ": " + str(exc.__cause__))[:160]
                self.why[w] = self.why.get(w, 0) + 1
                self.slowest_miss_s = max(self.slowest_miss_s, time.monotonic() - t0)
            except Exception as exc:
                self.errors.append(repr(exc))
            else:
                if bytes(got.data) != value(k):
                    self.wrong += 1
                else:
                    self.hits += 1
                    self.hit_times.setdefault(node_at_start[k], []).append(t0)  # when it was asked
            await asyncio.sleep(0)

    async def stores(self) -> None:
        while not self.stop:
            k = new_key(group=secrets.token_hex(2))
            try:
                await self.writer.put(k, value(k))
            except TierError:
                self.failed_puts += 1
                await asyncio.sleep(0.01)
            except Exception as exc:
                self.errors.append(repr(exc))
            else:
                self.acked[k] = time.monotonic()

    async def check_all(self, tier: RedisClusterTier) -> tuple[list[ChunkKey], list[ChunkKey], int]:
        """(preloaded keys missing, acknowledged stores missing, wrong values) read after the fault."""
        lost_pre, lost_acked, wrong = [], [], 0
        for keys, lost in ((self.keys, lost_pre), (list(self.acked), lost_acked)):
            for k in keys:
                for attempt in range(50):  # a fresh client may still meet the dead node once
                    try:
                        if bytes((await tier.get(k)).data) != value(k):
                            wrong += 1
                    except ChunkNotFound:
                        lost.append(k)
                    except TierUnavailable:
                        if attempt == 49:
                            raise
                        await asyncio.sleep(0.1)
                        continue
                    break
        return lost_pre, lost_acked, wrong


async def _loaded(cluster: Cluster, prefix: str, n: int) -> Load:
    writer, reader = make_tier(cluster, prefix), make_tier(cluster, prefix)
    await writer.start()
    await reader.start()
    keys = [new_key(group=secrets.token_hex(2)) for _ in range(n)]  # many namespaces: every slot
    await put_all(writer, keys)
    return Load(reader, writer, keys)


@pytest.mark.slow
async def test_reshard_under_load_returns_no_wrong_bytes_and_loses_nothing(own_redis_cluster: Cluster,
                                                                         prefix: str) -> None:
    redis_cluster = own_redis_cluster  # it moves slots: the shared cluster never sees that
    load = await _loaded(redis_cluster, prefix, 1500)
    nodes = {k: node_of(load.reader._redis, load.reader._layout.head(k)) for k in load.keys}
    src, dst = redis_cluster.masters()[:2]
    tasks = [asyncio.create_task(load.loads(nodes)) for _ in range(6)] + [asyncio.create_task(load.stores())
                                                                         for _ in range(2)]
    try:
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await asyncio.to_thread(redis_cluster.reshard, src, dst, 1000)
        reshard_s = time.monotonic() - t0
        await asyncio.sleep(0.5)
    finally:
        load.stop = True
        await asyncio.gather(*tasks)
    checker = make_tier(redis_cluster, prefix)
    try:
        lost_pre, lost_acked, wrong = await load.check_all(checker)
        moved = sum(1 for k in load.keys if node_of(checker._redis, checker._layout.head(k)) != nodes[k])
    finally:
        await checker.aclose()
        await load.reader.aclose()
        await load.writer.aclose()
    total = load.hits + load.misses + load.unavailable + load.wrong
    print(f"\nreshard of 1000 slots ({moved} of the 1500 preloaded chunks moved) in {reshard_s:.1f} s under load: "
          f"{total} loads, {load.hits} hits, "
          f"{load.misses} misses, {load.unavailable} unavailable (slowest {load.slowest_miss_s * 1e3:.0f} ms), "
          f"{load.wrong} wrong; {len(load.acked)} stores acked, {load.failed_puts} refused; "
          f"lost: {len(lost_pre)} preloaded, {len(lost_acked)} acked; why unavailable: {load.why}")
    assert load.errors == []
    assert load.wrong == 0 and wrong == 0
    assert lost_pre == [] and lost_acked == []
    assert load.misses == 0  # every preloaded key stayed present: a miss would be a lost chunk
    assert load.unavailable <= max(20, total // 20)  # bounded: deadlines missed on a loaded box
    assert total > 500 and len(load.acked) > 50 and moved > 30


@pytest.mark.slow
async def test_master_killed_under_load(own_redis_cluster: Cluster, prefix: str) -> None:
    redis_cluster = own_redis_cluster  # it kills a master: however that ends, no other test sees it
    load = await _loaded(redis_cluster, prefix, 1500)
    replication_caught_up(redis_cluster)  # what was preloaded is on the replicas: none may be lost
    nodes = {k: node_of(load.reader._redis, load.reader._layout.head(k)) for k in load.keys}
    seeds = [port for _, port in parse_cluster_url(redis_cluster.url).nodes]
    victim = next(p for p in seeds if p in redis_cluster.masters())
    victim_name = f"127.0.0.1:{victim}"
    assert sum(1 for n in nodes.values() if n == victim_name) > 200
    # the event channel, subscribed on the victim first, must move on and say it may have missed some
    order = [victim] + [p for p in redis_cluster.ports if p != victim]
    events_url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in order)
    got: list[bytes] = []
    reconnects: list[float] = []

    async def on_message(m: bytes) -> None:
        got.append(m)

    sub = RedisEventChannel(events_url, prefix + "events")
    pub = RedisEventChannel(redis_cluster.url, prefix + "events")
    await sub.subscribe(on_message, lambda: reconnects.append(time.monotonic()))
    tasks = [asyncio.create_task(load.loads(nodes)) for _ in range(6)] + [asyncio.create_task(load.stores())
                                                                         for _ in range(2)]
    try:
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        await asyncio.to_thread(redis_cluster.kill, victim)
        # a lookup while the master is down: its keys answer False, the others still answer
        probe = random.sample(load.keys, 200)
        try:
            answer = await load.reader.contains_many(probe)
        except TierUnavailable:  # allowed only if every master failed to answer in time
            answer = None
        deadline = killed_at + 45
        while time.monotonic() < deadline:  # until a key of the dead master's slots hits again
            if any(t > killed_at for t in load.hit_times.get(victim_name, [])):
                break
            await asyncio.sleep(0.05)
        recovered_s = min(t for t in load.hit_times.get(victim_name, [killed_at + 999]) if t > killed_at) - killed_at
        await asyncio.sleep(1.0)
    finally:
        load.stop = True
        await asyncio.gather(*tasks)
    for _ in range(100):
        if reconnects:
            break
        await asyncio.sleep(0.1)
    assert await pub.publish(b"after the failover")
    for _ in range(50):
        if b"after the failover" in got:
            break
        await asyncio.sleep(0.1)
    await sub.aclose()
    await pub.aclose()
    checker = make_tier(redis_cluster, prefix)
    try:
        lost_pre, lost_acked, wrong = await load.check_all(checker)
        stats = load.reader.stats()
    finally:
        await checker.aclose()
        await load.reader.aclose()
        await load.writer.aclose()
    lost_after_kill = [k for k in lost_acked if load.acked[k] > killed_at]
    total = load.hits + load.misses + load.unavailable + load.wrong
    print(f"\nkill -9 of master {victim}: hits on its slots again after {recovered_s:.2f} s; {total} loads, "
          f"{load.hits} hits, {load.unavailable} unavailable (slowest {load.slowest_miss_s * 1e3:.0f} ms, "
          f"breaker trips {stats.breaker_trips}), {load.misses} not found, {load.wrong} wrong; "
          f"{len(load.acked)} stores acked, {load.failed_puts} refused; lost: {len(lost_pre)} of the "
          f"replicated preload, {len(lost_acked)} acked stores ({len(lost_after_kill)} acked after the kill); "
          f"event channel reconnected: {bool(reconnects)}")
    if answer is not None:
        survivors = [a for k, a in zip(probe, answer) if nodes[k] != victim_name]
        print(f"contains_many during the failover: {sum(survivors)} of {len(survivors)} keys on live masters found")
    assert load.errors == []
    assert load.wrong == 0 and wrong == 0
    assert recovered_s < 30
    assert lost_pre == []
    assert lost_after_kill == []  # only what the replica had not received can be lost
    assert load.misses == 0  # loads read the replicated preload: "not found" would be a lost chunk
    assert load.slowest_miss_s < 0.5 + 1.5  # within the read deadline (+ a loaded box's lag)
    assert reconnects and b"after the failover" in got


@pytest.mark.slow
async def test_a_put_stands_when_only_its_byte_counter_master_is_dead(own_redis_cluster: Cluster, prefix: str) -> None:
    """A chunk's own keys on a live master, the total byte counter's shard on a killed one: the
    put is not reported as failed (the chunk is written, whole), and a delete of it removes it.
    Positive control: the same before the kill, with the counter moving."""
    cluster = own_redis_cluster
    tier = make_tier(cluster, prefix, breaker_failures=1000)
    await tier.start()
    try:
        lay = tier._layout

        def where(name: str) -> str:
            return node_of(tier._redis, name)

        key = new_key()
        while where(lay.head(key)) == where(lay.shard(key)):
            key = new_key()
        before = tier.used_bytes
        await tier.put(key, value(key))  # the control: both masters alive
        assert bytes((await tier.get(key)).data) == value(key) and tier.used_bytes == before + len(value(key))
        other = new_key()
        while where(lay.head(other)) != where(lay.head(key)) or lay.shard(other) != lay.shard(key):
            other = new_key()
        replication_caught_up(cluster)
        await asyncio.to_thread(cluster.kill, int(where(lay.shard(key)).rsplit(":", 1)[1]))
        await tier.put(other, value(other))  # its shard's master is dead: the chunk is written all the same
        assert bytes((await tier.get(other)).data) == value(other)
        assert await tier.delete(other) is True
        with pytest.raises(ChunkNotFound):
            await tier.get(other)
    finally:
        await tier.aclose()
